//! One mechanism for building a [`TrainConfig`]: its sources merged in order, later ones
//! winning key by key — defaults < config file < environment < command-line flags — with every
//! value's source remembered ([`Sources::provenance`], printed by `flotilla config`).
//!
//! Merging and provenance are [`figment`]'s; this module adds what is Flotilla's own:
//! - **aliases**: the flat keys of earlier versions and of hcddl (`lr`, `batch_size`,
//!   `arch`, `num_server_rounds`, `model: lenet5`, ...) are rewritten to their place in the
//!   sections before merging, so there is one place per value (a file's `lr:` *is*
//!   `optimizer.lr`, and `--lr` beats it like any flag beats any file value). A source that
//!   sets a value both ways is an error naming both;
//! - **optimizer replacement**: a source that names an optimizer (`optimizer.name`)
//!   replaces the optimizer of the sources below instead of merging into it (Adam has no momentum);
//! - **environment**: `FLOTILLA_<SECTION>__<KEY>` (e.g. `FLOTILLA_OPTIMIZER__LR=0.05`) or a
//!   flat alias (`FLOTILLA_BATCH_SIZE=32`); and, for processes started by a launcher,
//!   world size and rendezvous of torchrun, Open MPI, MPICH, Slurm (the first host of
//!   `SLURM_JOB_NODELIST`) and Kubernetes, read in the order of
//!   [`flotilla_cluster::launcher_env`], under the `FLOTILLA_` variables.

use std::path::Path;

use figment::value::{Dict, Map};
use figment::{Figment, Metadata, Profile, Provider};
use serde_json::Value;

use crate::config::TrainConfig;
use crate::error::{Result, TrainError};

/// The sections of a config; any other top-level key is an alias or an error.
const SECTIONS: &[&str] = &[
    "model",
    "data",
    "optimizer",
    "schedule",
    "topology",
    "pipeline",
    "allreduce",
    "comm",
    "telemetry",
];

/// Flat keys and where they live.
const ALIASES: &[(&str, &str)] = &[
    ("model", "model.spec"),
    ("seed", "model.seed"),
    ("device", "model.device"),
    ("data", "data.path"),
    ("batch_size", "data.batch_size"),
    ("train_limit", "data.train_limit"),
    ("lr", "optimizer.lr"),
    ("epochs", "schedule.epochs"),
    ("max_steps", "schedule.max_steps"),
    ("lr_schedule", "schedule.lr_schedule"),
    ("warmup_steps", "schedule.warmup_steps"),
    ("eval_every", "schedule.eval_every"),
    ("checkpoint_every", "schedule.checkpoint_every"),
    ("resume", "schedule.resume"),
    ("num_server_rounds", "schedule.num_server_rounds"),
    ("target_accuracy", "schedule.target_accuracy"),
    (
        "divergence_check_rounds",
        "schedule.divergence_check_rounds",
    ),
    ("abort_on_divergence", "schedule.abort_on_divergence"),
    ("world_size", "topology.world_size"),
    ("arch", "topology.arch"),
    ("parameter_server", "topology.parameter_server"),
    ("global_server", "topology.global_server"),
    ("servers", "topology.servers"),
    ("max_staleness", "topology.max_staleness"),
    ("staleness_lr", "topology.staleness_lr"),
    ("async_momentum", "topology.async_momentum"),
    ("local_steps", "topology.local_steps"),
    ("inventory", "topology.inventory"),
    ("strategy", "topology.arch"),
    ("stages", "pipeline.stages"),
    ("split_points", "pipeline.split_points"),
    ("micro_batches", "pipeline.micro_batches"),
    // A string, not the `schedule` section: `schedule: 1f1b`.
    ("schedule", "pipeline.schedule"),
    ("data_parallel", "pipeline.data_parallel"),
    ("cycle_duration_ms", "allreduce.cycle_duration_ms"),
    ("all_reduce_buffer_size", "allreduce.all_reduce_buffer_size"),
    ("staleness", "allreduce.staleness"),
    ("overlap", "allreduce.overlap"),
    ("correction", "allreduce.correction"),
    ("stall_warning_s", "allreduce.stall_warning_s"),
    ("stall_shutdown_s", "allreduce.stall_shutdown_s"),
    ("backend", "comm.backend"),
    ("master_addr", "comm.master_addr"),
    ("master_port", "comm.master_port"),
    ("timeout_s", "comm.timeout_s"),
    ("join_timeout_s", "comm.join_timeout_s"),
    ("compression", "comm.compression"),
    ("wire_format", "comm.wire_format"),
    ("bucket_mb", "comm.bucket_mb"),
    ("output", "telemetry.output"),
    ("timeline_path", "telemetry.timeline_path"),
    ("metrics_port", "telemetry.metrics_port"),
];

/// One source: a nested tree of values and the name of where it came from.
#[derive(Debug, Clone)]
struct Source {
    name: String,
    tree: serde_json::Map<String, Value>,
}

impl Provider for Source {
    fn metadata(&self) -> Metadata {
        Metadata::named(self.name.clone())
    }

    fn data(&self) -> std::result::Result<Map<Profile, Dict>, figment::Error> {
        figment::providers::Serialized::defaults(&self.tree).data()
    }
}

/// Where each value of an effective config came from.
#[derive(Debug, Clone, PartialEq)]
pub struct Provenance {
    /// Dotted path (`optimizer.lr`).
    pub path: String,
    /// The value, as JSON text.
    pub value: String,
    /// The source that set it (`default`, `file run.yaml`, `env FLOTILLA_SEED`, `flag --lr`).
    pub source: String,
}

/// A config's sources, lowest first.
#[derive(Debug, Clone)]
pub struct Sources {
    sources: Vec<Source>,
}

fn err(source: &str, msg: impl Into<String>) -> TrainError {
    TrainError::config(source, msg.into())
}

impl Sources {
    /// Just the defaults.
    pub fn defaults() -> Self {
        let tree = match serde_json::to_value(TrainConfig::default()) {
            Ok(Value::Object(m)) => m,
            _ => serde_json::Map::new(),
        };
        Self {
            sources: vec![Source {
                name: "default".into(),
                tree,
            }],
        }
    }

    /// Adds a source of YAML text (`source` names it).
    pub fn yaml(self, text: &str, source: &str) -> Result<Self> {
        if text.trim().is_empty() {
            return Ok(self);
        }
        let v: Value = serde_norway::from_str(text).map_err(|e| err(source, e.to_string()))?;
        let v = match v {
            Value::Null => return Ok(self),
            v => v,
        };
        self.tree(v, &format!("file {source}"))
    }

    /// Adds a config file.
    pub fn file(self, path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| TrainError::io(path, e))?;
        self.yaml(&text, &path.display().to_string())
    }

    /// Adds a source given as a tree of flat aliases and/or sections (`source` names it).
    pub fn tree(mut self, v: Value, source: &str) -> Result<Self> {
        let tree = normalize(v, source)?;
        if !tree.is_empty() {
            self.sources.push(Source {
                name: source.to_string(),
                tree,
            });
        }
        Ok(self)
    }

    /// One source per value a launcher's variables set (world size, rendezvous host and
    /// port; see [`flotilla_cluster::launcher_env`] for which variables, in which order).
    fn launcher_sources(&mut self, vars: &[(String, String)]) -> Result<()> {
        let map: std::collections::HashMap<&str, &str> =
            vars.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let e = flotilla_cluster::LauncherEnv::read(&|k| map.get(k).map(|v| v.to_string()))
            .map_err(|e| err("environment", e.to_string()))?;
        let found = [
            e.world_size
                .map(|v| ("topology.world_size", Value::from(v.value), v.var)),
            e.master_addr
                .map(|v| ("comm.master_addr", Value::from(v.value), v.var)),
            e.master_port
                .map(|v| ("comm.master_port", Value::from(v.value), v.var)),
        ];
        for (path, value, var) in found.into_iter().flatten() {
            let source = format!("env {var}");
            let mut tree = serde_json::Map::new();
            set(&mut tree, path, value, &source)?;
            self.sources.push(Source { name: source, tree });
        }
        Ok(())
    }

    /// Adds one source per setting the environment makes: `FLOTILLA_...` variables, and with
    /// `launcher` the launcher variables (world size, rendezvous address and port).
    pub fn env(
        mut self,
        vars: impl IntoIterator<Item = (String, String)>,
        launcher: bool,
    ) -> Result<Self> {
        let mut vars: Vec<(String, String)> = vars
            .into_iter()
            .filter(|(_, v)| !v.trim().is_empty())
            .collect();
        vars.sort();
        if launcher {
            // Under the FLOTILLA_ variables, which are read after them and so win.
            self.launcher_sources(&vars)?;
        }
        for (name, raw) in vars {
            let value = scalar(&raw);
            let source = format!("env {name}");
            let path = if let Some(key) = name.strip_prefix("FLOTILLA_") {
                let key = key.to_ascii_lowercase();
                if key.contains("__") {
                    let path = key.replace("__", ".");
                    if !known_path(&path) {
                        return Err(err(&source, format!("no config key `{path}`")));
                    }
                    path
                } else if ALIASES.iter().any(|(a, _)| *a == key) {
                    // A flat key, rewritten as in a file (one may set two paths).
                    let one = serde_json::Map::from_iter([(key, value)]);
                    let tree = normalize(Value::Object(one), &source)?;
                    self.sources.push(Source { name: source, tree });
                    continue;
                } else {
                    // Other FLOTILLA_ variables belong to other parts (the secret, fault tests).
                    continue;
                }
            } else {
                continue;
            };
            let mut tree = serde_json::Map::new();
            set(&mut tree, &path, value, &source)?;
            self.sources.push(Source { name: source, tree });
        }
        Ok(self)
    }

    /// The merged figment: a source that names an optimizer replaces the optimizer below it.
    fn figment(&self) -> Figment {
        let last_named = self.sources.iter().rposition(|l| {
            l.tree
                .get("optimizer")
                .and_then(|o| o.get("name"))
                .is_some()
        });
        let mut f = Figment::new();
        for (i, source) in self.sources.iter().enumerate() {
            let mut source = source.clone();
            if last_named.is_some_and(|n| i < n) {
                source.tree.remove("optimizer");
            }
            f = f.merge(source);
        }
        f
    }

    /// The effective config.
    pub fn extract(&self) -> Result<TrainConfig> {
        self.figment().extract().map_err(|e| {
            let source = e
                .metadata
                .as_ref()
                .map_or_else(|| "config".to_string(), |m| m.name.to_string());
            let path = e.path.join(".");
            let mut kind = e.kind.to_string();
            if !path.is_empty() {
                kind = format!("`{path}`: {kind}");
            }
            err(&source, kind)
        })
    }

    /// Every leaf of the effective config with the source that set it.
    pub fn provenance(&self) -> Result<Vec<Provenance>> {
        let config = self.extract()?;
        let f = self.figment();
        let tree = serde_json::to_value(&config).unwrap_or_default();
        let mut out = Vec::new();
        leaves(&tree, String::new(), &mut |path, value| {
            let source = f
                .find_value(&path)
                .ok()
                .and_then(|v| f.get_metadata(v.tag()).map(|m| m.name.to_string()))
                .unwrap_or_else(|| "default".into());
            out.push(Provenance {
                path,
                value: value.to_string(),
                source,
            });
        });
        Ok(out)
    }
}

impl TrainConfig {
    /// Parses a config from YAML text over the defaults; `source_name` names it in errors.
    pub fn from_yaml(text: &str, source_name: &str) -> Result<Self> {
        Sources::defaults().yaml(text, source_name)?.extract()
    }

    /// Reads a config file over the defaults. Relative `data`, `output` and `model` paths
    /// stay relative to the working directory, as with every command-line tool.
    pub fn load(path: &Path) -> Result<Self> {
        Sources::defaults().file(path)?.extract()
    }
}

/// Parses an environment value as a YAML scalar (numbers, booleans), else a string.
fn scalar(raw: &str) -> Value {
    match serde_norway::from_str::<Value>(raw) {
        Ok(v @ (Value::Number(_) | Value::Bool(_))) => v,
        _ => Value::String(raw.to_string()),
    }
}

/// Whether `a.b` names a key of the config (a section or a field of one).
fn known_path(path: &str) -> bool {
    let tree = serde_json::to_value(TrainConfig::default()).unwrap_or_default();
    let mut parts = path.split('.');
    let Some(section) = parts.next() else {
        return false;
    };
    let Some(sec) = tree.get(section) else {
        return false;
    };
    match parts.next() {
        None => true,
        // The optimizer's keys depend on its kind; serde checks them.
        Some(_) if section == "optimizer" => true,
        Some(key) => sec.as_object().is_some_and(|m| m.contains_key(key)),
    }
}

/// Rewrites flat aliases into sections; a value set twice in one source is an error.
fn normalize(v: Value, source: &str) -> Result<serde_json::Map<String, Value>> {
    let Value::Object(top) = v else {
        return Err(err(source, "the top level must be a mapping of keys"));
    };
    let mut out = serde_json::Map::new();
    for (key, value) in top {
        let is_section = SECTIONS.contains(&key.as_str()) && value.is_object();
        if is_section {
            let Value::Object(fields) = value else {
                continue;
            };
            for (field, v) in fields {
                set(&mut out, &format!("{key}.{field}"), v, source)?;
            }
        } else if let Some(mode) = allreduce_strategy(&key, &value) {
            // `strategy: async_allreduce` is the all-reduce architecture in async mode.
            set(&mut out, "topology.arch", Value::from("allreduce"), source)?;
            set(&mut out, "allreduce.mode", Value::from(mode), source)?;
        } else if let Some((_, path)) = ALIASES.iter().find(|(a, _)| *a == key) {
            set(&mut out, path, value, source)?;
        } else {
            // Left for serde to reject, naming the key.
            out.insert(key, value);
        }
    }
    Ok(out)
}

/// The all-reduce mode a `strategy` / `arch` value of `sync_allreduce` or `async_allreduce`
/// names.
fn allreduce_strategy(key: &str, value: &Value) -> Option<&'static str> {
    if key != "strategy" && key != "arch" {
        return None;
    }
    match value.as_str()? {
        "sync_allreduce" => Some("sync"),
        "async_allreduce" => Some("async"),
        _ => None,
    }
}

/// Sets `section.key` in a tree; an error if the source already set it.
fn set(
    tree: &mut serde_json::Map<String, Value>,
    path: &str,
    value: Value,
    source: &str,
) -> Result<()> {
    let (section, key) = path.split_once('.').unwrap_or((path, ""));
    let entry = tree
        .entry(section.to_string())
        .or_insert_with(|| Value::Object(serde_json::Map::new()));
    let Value::Object(m) = entry else {
        return Err(err(source, format!("`{section}` must be a mapping")));
    };
    if m.contains_key(key) {
        return Err(err(
            source,
            format!(
                "`{path}` is set twice (a flat key and its section, e.g. `lr` and `optimizer.lr`)"
            ),
        ));
    }
    m.insert(key.to_string(), value);
    Ok(())
}

fn leaves(v: &Value, prefix: String, f: &mut dyn FnMut(String, &Value)) {
    match v {
        Value::Object(m) if !m.is_empty() => {
            for (k, child) in m {
                let path = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                leaves(child, path, f);
            }
        }
        _ => f(prefix, v),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
                .tree(json!({"lr": 0.5}), "flag --lr")
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
            .tree(json!({"seed": 7}), "flag --seed")
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
}
