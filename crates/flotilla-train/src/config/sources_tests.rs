//! The tests of [`super`] (a child module, so they see its private parts): the order of
//! sources, aliases, errors, and the round trip of every declared key through its flag, its
//! environment names and its aliases.

use super::*;
use keys::{KEYS, Kind};
use serde_json::json;

fn no_env() -> Vec<(String, String)> {
    Vec::new()
}

#[test]
fn flag_lr_beats_a_files_lr_in_either_spelling() {
    for file in [
        "lr: 0.1\n",
        "optimizer: {name: sgd, lr: 0.1, momentum: 0.9}\n",
        "optimizer: {lr: 0.1}\n",
    ] {
        let sources = Sources::defaults()
            .yaml(file, "run.yaml")
            .expect("file")
            .env(no_env(), false)
            .expect("env")
            .flag("lr", json!(0.5))
            .expect("flags");
        let c = sources.extract().expect("config");
        assert_eq!(c.optimizer.lr(), 0.5, "{file}");
        assert_eq!(c.base_lr(), 0.5, "{file}");
        let p = sources.provenance().expect("provenance");
        let lr = p.iter().find(|p| p.path == "optimizer.lr").expect("lr");
        assert_eq!(lr.source, "flag --lr");
    }
}

#[test]
fn sources_win_in_order_and_say_where_values_came_from() {
    let env = vec![
        ("FLOTILLA_DATA__BATCH_SIZE".to_string(), "16".to_string()),
        ("FLOTILLA_SEED".to_string(), "9".to_string()),
        ("FLOTILLA_SECRET".to_string(), "s3cret".to_string()),
        (
            "FLOTILLA_SECRET_FILE".to_string(),
            "/nonexistent".to_string(),
        ),
        ("WORLD_SIZE".to_string(), "3".to_string()),
    ];
    let sources = Sources::defaults()
        .yaml("batch_size: 32\nseed: 1\nepochs: 2\n", "run.yaml")
        .expect("file")
        .env(env, true)
        .expect("env")
        .flag("seed", json!(7))
        .expect("flags");
    let c = sources.extract().expect("config");
    assert_eq!(c.data.batch_size, 16);
    assert_eq!(c.model.seed, 7);
    assert_eq!(c.schedule.epochs, 2);
    assert_eq!(c.topology.world_size, 3);
    let p = sources.provenance().expect("provenance");
    let src = |path: &str| {
        p.iter()
            .find(|p| p.path == path)
            .map(|p| p.source.clone())
            .expect(path)
    };
    assert_eq!(src("data.batch_size"), "env FLOTILLA_DATA__BATCH_SIZE");
    assert_eq!(src("model.seed"), "flag --seed");
    assert_eq!(src("schedule.epochs"), "file run.yaml");
    assert_eq!(src("topology.world_size"), "env WORLD_SIZE");
    assert_eq!(src("comm.bucket_mb"), "default");
    let shown = format!("{c:?} {p:?}");
    assert!(
        !shown.contains("s3cret"),
        "the secret is no config value: {shown}"
    );
}

#[test]
fn a_value_set_twice_in_one_source_is_an_error_naming_it() {
    let e = Sources::defaults()
        .yaml("lr: 0.1\noptimizer: {name: sgd, lr: 0.2}\n", "run.yaml")
        .expect_err("twice")
        .to_string();
    assert!(e.contains("optimizer.lr") && e.contains("run.yaml"), "{e}");
}

#[test]
fn an_optimizer_named_in_a_source_replaces_the_one_below() {
    let c = Sources::defaults()
        .yaml("optimizer: {name: adam, lr: 0.001}\n", "r")
        .expect("file")
        .extract()
        .expect("adam without momentum from the defaults");
    assert!(matches!(
        c.optimizer,
        flotilla_engine::OptimizerSpec::Adam { .. }
    ));
}

#[test]
fn unknown_environment_keys_are_errors_naming_the_variable() {
    let env = vec![("FLOTILLA_DATA__BATCHSIZE".to_string(), "3".to_string())];
    let e = Sources::defaults()
        .env(env, false)
        .expect_err("unknown")
        .to_string();
    assert!(e.contains("FLOTILLA_DATA__BATCHSIZE"), "{e}");
}

#[test]
fn a_retired_variable_is_refused_with_its_new_name() {
    let env = vec![("FLOTILLA_COMM_TIMEOUT_SECS".to_string(), "5".to_string())];
    let e = Sources::defaults()
        .env(env, false)
        .expect_err("retired")
        .to_string();
    assert!(
        e.contains("FLOTILLA_COMM_TIMEOUT_SECS")
            && e.contains("FLOTILLA_COMM__TIMEOUT_S (seconds)"),
        "{e}"
    );
}

#[test]
fn one_layer_names_an_optimizer_and_sets_its_fields() {
    let env = [
        ("FLOTILLA_OPTIMIZER__LR", "0.2"),
        ("FLOTILLA_OPTIMIZER__MOMENTUM", "0.5"),
        ("FLOTILLA_OPTIMIZER__NAME", "sgd"),
    ]
    .map(|(k, v)| (k.to_string(), v.to_string()));
    let c = Sources::defaults()
        .yaml("optimizer: {name: adam, lr: 0.01}\n", "file r")
        .expect("file")
        .env(env, false)
        .expect("env")
        .extract()
        .expect("config");
    let text = format!("{:?}", c.optimizer);
    assert!(
        text.starts_with("Sgd") && text.contains("momentum: 0.5"),
        "{text}"
    );
    assert!(
        !text.contains("0.01"),
        "the file's Adam is replaced whole: {text}"
    );
}

#[test]
fn nested_sections_and_aliases_mix() {
    let c = Sources::defaults()
        .yaml(
            "model: mlp\nschedule: {epochs: 3, warmup_steps: 5}\ncomm: {timeout_s: 9}\n",
            "r",
        )
        .expect("file")
        .extract()
        .expect("config");
    assert_eq!(c.model.spec, "mlp");
    assert_eq!(c.schedule.epochs, 3);
    assert_eq!(c.schedule.warmup_steps, 5);
    assert_eq!(c.comm.timeout_s, 9.0);
}

/// The default of every key, as serde writes it.
fn default_of(k: &keys::Key) -> Value {
    let defaults = serde_json::to_value(TrainConfig::default()).expect("json");
    defaults[k.section()][k.field()].clone()
}

/// `{section: {field: value}}` of `k`.
fn at(k: &keys::Key, value: Value) -> serde_json::Map<String, Value> {
    let mut tree = serde_json::Map::new();
    set(&mut tree, k.path, value, "test").expect("set");
    tree
}

#[test]
fn every_key_is_set_by_its_environment_names_and_its_aliases() {
    for k in KEYS {
        let mut names = vec![k.env_name()];
        names.extend(
            k.aliases
                .iter()
                .map(|a| format!("FLOTILLA_{}", a.to_ascii_uppercase())),
        );
        for name in names {
            let s = Sources::defaults()
                .env([(name.clone(), "7".to_string())], false)
                .expect(&name);
            let source = s.sources.last().expect("a source");
            assert_eq!(source.name, format!("env {name}"));
            assert_eq!(source.tree, at(k, json!(7)), "{name}");
            // And the effective config says so, for every key a variable can set.
            let text = match default_of(k) {
                Value::String(text) => text,
                v @ (Value::Number(_) | Value::Bool(_)) => v.to_string(),
                _ => continue,
            };
            let p = Sources::defaults()
                .env([(name.clone(), text)], false)
                .and_then(|s| s.provenance())
                .expect(&name);
            let got = p.iter().find(|p| p.path == k.path).expect(k.path);
            assert_eq!(got.source, format!("env {name}"));
        }
        for alias in k.aliases {
            let s = Sources::defaults()
                .tree(json!({ *alias: 7 }), "file t.yaml")
                .expect(alias);
            let source = s.sources.last().expect("a source");
            assert_eq!(source.tree, at(k, json!(7)), "{alias}");
        }
    }
}

#[test]
fn every_flag_sets_its_key_and_the_provenance_names_it() {
    let mut sources = Sources::defaults();
    let mut want = Vec::new();
    for (k, f) in keys::flags() {
        let value = match f.kind {
            Kind::Switch => json!(true),
            Kind::SwitchOff => json!(false),
            Kind::Text => default_of(k),
            Kind::Path => json!("some/where"),
            Kind::U16 => json!(4321),
            Kind::U32 => json!(3),
            Kind::U64 => json!(11),
            Kind::Usize => json!(5),
            Kind::F64 => json!(2.5),
        };
        assert!(!value.is_null(), "--{}", f.long);
        sources = sources.flag(f.long, value.clone()).expect(f.long);
        want.push((k.path, format!("flag --{}", f.long), value));
    }
    let p = sources.provenance().expect("provenance");
    for (path, source, value) in want {
        let got = p.iter().find(|p| p.path == path).expect(path);
        assert_eq!(got.source, source);
        let shown: Value = serde_json::from_str(&got.value).expect("json");
        assert_eq!(shown, value, "{path}");
    }
    let e = Sources::defaults()
        .flag("no-such", json!(1))
        .expect_err("undeclared");
    assert!(e.to_string().contains("--no-such"), "{e}");
}

/// A number that is not finite is refused by every source, naming where it came from and
/// saying so (JSON has no NaN: it would arrive as null, "invalid type: found unit").
#[test]
fn numbers_that_are_not_finite_are_refused_by_every_source() {
    let file = Sources::defaults().yaml("optimizer: {name: sgd, lr: .nan}\n", "run.yaml");
    let e = file.expect_err(".nan").to_string();
    assert!(
        e.contains("run.yaml") && e.contains("`optimizer.lr`: .nan is not a finite number"),
        "{e}"
    );
    for (var, raw) in [
        ("FLOTILLA_LR", "nan"),
        ("FLOTILLA_OPTIMIZER__LR", ".inf"),
        ("FLOTILLA_LR", "-inf"),
    ] {
        let env = Sources::defaults().env([(var.to_string(), raw.to_string())], false);
        let e = env.expect_err(raw).to_string();
        assert!(
            e.contains(var) && e.contains(&format!("{raw} is not a finite number")),
            "{e}"
        );
    }
    assert_eq!(finite_number(" 0.05"), Ok(0.05));
    assert!(finite_number("inf").is_err() && finite_number("x").is_err());
    let ok = Sources::defaults().env([("FLOTILLA_LR".to_string(), "0.25".to_string())], false);
    assert_eq!(
        ok.expect("lr").extract().expect("config").optimizer.lr(),
        0.25
    );
}

/// `strategy: async_allreduce` is the all-reduce architecture in async mode from every
/// source: a file's flat key, its section, the environment and `--strategy`.
#[test]
fn an_all_reduce_strategy_sets_the_mode_from_every_source() {
    use crate::config::AllReduceMode;
    let env = |v: &str| vec![("FLOTILLA_TOPOLOGY__ARCH".to_string(), v.to_string())];
    let each = [
        Sources::defaults().yaml("strategy: async_allreduce\n", "run.yaml"),
        Sources::defaults().yaml("topology: {arch: async_allreduce}\n", "run.yaml"),
        Sources::defaults().env(env("async_allreduce"), false),
        Sources::defaults().flag("strategy", json!("async_allreduce")),
    ];
    for sources in each {
        let c = sources.expect("sources").extract().expect("config");
        assert_eq!(c.topology.arch, flotilla_cluster::Arch::Allreduce);
        assert_eq!(c.allreduce.mode, AllReduceMode::Async);
    }
    let c = Sources::defaults()
        .flag("strategy", json!("pipeline"))
        .and_then(|s| s.extract())
        .expect("pipeline");
    assert_eq!(c.topology.arch, flotilla_cluster::Arch::Pipeline);
}

/// `--stages` over a file's `split_points` (and a later file's `split_points` over an
/// earlier `stages`) chooses the stages: the two keys are one setting, not silently the
/// file's points.
#[test]
fn the_last_source_to_choose_the_stages_chooses_them() {
    let file = "strategy: pipeline\nsplit_points: [4]\n";
    let c = Sources::defaults()
        .yaml(file, "r")
        .expect("file")
        .flag("stages", json!(3))
        .expect("flag")
        .extract()
        .expect("config");
    assert_eq!(c.pipeline.split_points, None);
    assert_eq!(c.pipeline.num_stages(), 3);
    let c = Sources::defaults()
        .yaml("strategy: pipeline\nstages: 3\n", "a")
        .expect("file")
        .yaml(file, "b")
        .expect("file")
        .extract()
        .expect("config");
    assert_eq!(c.pipeline.num_stages(), 2);
    // One source giving both as ranges and points is still refused.
    let both = "strategy: pipeline\nstages: [[0, 3], [4, 11]]\nsplit_points: [4]\n";
    let e = Sources::defaults().yaml(both, "r").expect("file").extract();
    assert!(e.is_err() || e.is_ok_and(|c| c.validate().is_err()));
}
