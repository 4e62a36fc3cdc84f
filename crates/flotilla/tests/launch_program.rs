//! `flotilla launch -n N -- PROGRAM`: a user's own burn program (`examples/custom_model.rs`,
//! `lenet5_program.rs` for the library's run of a user's module, `pipeline_model.rs` for a
//! program's own stage modules in the library's pipeline, `pipeline_mnist.rs` for flotilla-train's pipeline; built
//! by `cargo test --release --workspace` with the other examples) as the ranks of a job. The equalities train with SGD and momentum (`OPTIMIZER=sgd`): Adam would divide
//! a wrongly scaled average of the gradients out of its steps.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{
    assert_bitwise, checkpoint_tensors, config_file, cores_of, example, flotilla, relative_error,
    run_with_deadline, safetensors_file, text, tmp,
};

/// The secret of the jobs the tests below start.
const SECRET: &str = "test-secret-0123456789";

/// Tensors by name, as `safetensors_file` reads them.
type Tensors = BTreeMap<String, Vec<f32>>;

/// The `custom_model` example's binary.
fn custom_model() -> PathBuf {
    example("custom_model")
}

/// `flotilla launch -n N -- PROGRAM` with `env`; its output.
fn launch(
    program: &str,
    n: usize,
    env: &[(&str, String)],
    limit: Duration,
) -> std::process::Output {
    let mut cmd = flotilla();
    cmd.args(["launch", "-n", &n.to_string(), "--"])
        .arg(example(program));
    for (k, v) in env {
        cmd.env(k, v);
    }
    run_with_deadline(cmd, limit)
}

#[test]
fn a_user_program_on_2_ranks_or_a_server_and_2_workers_trains_as_on_1_rank_with_the_same_global_batch()
 {
    let dir = tmp();
    // `trainers` of the `n` ranks train on data: all of them, or the workers under one
    // parameter server (`MODE=ps`, rank 0); each on its share of a global batch of 64.
    let run_as =
        |program: &str, mode: &str, n: usize, trainers: usize, steps: usize, name: &str| {
            let out = dir.path().join(name);
            let env = [
                ("STEPS", steps.to_string()),
                ("BATCH", (64 / trainers).to_string()),
                ("OUT", out.display().to_string()),
                ("MODE", mode.to_string()),
                ("OPTIMIZER", "sgd".to_string()),
            ];
            let o = launch(program, n, &env, Duration::from_secs(240));
            assert!(o.status.success(), "{n} ranks:\n{}", text(&o));
            safetensors_file(&out)
        };
    let run =
        |n: usize, steps: usize, name: &str| run_as("custom_model", "sync", n, n, steps, name);
    let initial = run(1, 0, "initial.safetensors");
    let one = run(1, 50, "one.safetensors");
    let two = run(2, 50, "two.safetensors");
    assert!(
        relative_error(&one, &initial) > 1e-2,
        "50 steps did not train"
    );
    let e = relative_error(&two, &one);
    assert!(
        e <= 1e-5,
        "2 ranks vs 1 rank after 50 steps: relative error {e}"
    );
    // A sync parameter server's rounds average its 2 workers' gradients, as 1 rank's batch:
    // LeNet-5 of a program on the library's run (`flotilla_burn::train`), by the settings a
    // config job reads.
    let lenet = |yaml: &str, name: &str| {
        let out = dir.path().join(name);
        let common = "model: lenet5\nseed: 3\noptimizer: {name: sgd, lr: 0.04, momentum: 0.9}\n";
        let cfg = config_file(
            dir.path(),
            &format!("{name}.yaml"),
            &format!("{common}{yaml}"),
        );
        let mut c = flotilla();
        c.args([
            "launch",
            &cfg,
            "--output",
            out.to_str().expect("utf8"),
            "--",
        ])
        .arg(example("lenet5_program"));
        let o = run_with_deadline(c, Duration::from_secs(240));
        assert!(o.status.success(), "{name}:\n{}", text(&o));
        checkpoint_tensors(&out)
    };
    let one_lenet = lenet(
        "world_size: 1\nbatch_size: 64\nmax_steps: 50\n",
        "one-lenet",
    );
    let ps = lenet(
        "arch: flat\nparameter_server: {aggr_type: sync, num_workers: 2}\nbatch_size: 32\n\
         num_server_rounds: 50\n",
        "ps",
    );
    let e = relative_error(&ps, &one_lenet);
    assert!(
        e <= 1e-5,
        "a server and 2 workers vs 1 rank after 50 steps: relative error {e}"
    );
    // The module's own parameter names, as PyTorch would give them.
    let names: Vec<&str> = one.keys().map(String::as_str).collect();
    assert_eq!(
        names,
        [
            "conv1.bias",
            "conv1.weight",
            "conv2.bias",
            "conv2.weight",
            "fc1.bias",
            "fc1.weight",
            "fc2.bias",
            "fc2.weight"
        ]
    );
}

#[test]
fn ranks_whose_models_differ_are_named_at_start() {
    let dir = tmp();
    let mut cmd = flotilla();
    let script = format!(
        "if [ \"$RANK\" = 1 ]; then export HIDDEN=64; fi; exec {}",
        custom_model().display()
    );
    cmd.args(["launch", "-n", "2", "--", "sh", "-c", &script])
        .env("STEPS", "5")
        .env("OUT", dir.path().join("x.safetensors"));
    let started = Instant::now();
    let o = run_with_deadline(cmd, Duration::from_secs(60));
    let all = text(&o);
    assert!(!o.status.success(), "{all}");
    assert!(
        all.contains(
            "the ranks' models differ: rank 1 has `fc1.weight [512, 64]` where rank 0 has \
             `fc1.weight [512, 128]` (parameter tensor 4)"
        ),
        "{all}"
    );
    // Named at start: before any step, so well within the join.
    assert!(started.elapsed() < Duration::from_secs(30), "{all}");
}

/// The join deadline comes from the launcher's config file: it reaches the program only
/// through the settings the launcher passes (`FLOTILLA_COMM__JOIN_TIMEOUT_S`), read back by
/// `flotilla_burn::init`; with the default (60 s) the deadline below fails.
#[test]
fn a_rank_that_exits_before_joining_is_named_by_the_launcher() {
    let dir = tmp();
    let config = config_file(dir.path(), "job.yaml", "comm: {join_timeout_s: 3}\n");
    let script = format!(
        "if [ \"$RANK\" = 1 ]; then exit 0; fi; exec {}",
        custom_model().display()
    );
    let mut cmd = flotilla();
    cmd.args(["launch", &config])
        .args(["-n", "2", "--", "sh", "-c", &script])
        .env("RUST_BACKTRACE", "0");
    let started = Instant::now();
    let o = run_with_deadline(cmd, Duration::from_secs(60));
    let all = text(&o);
    assert!(!o.status.success(), "{all}");
    assert!(
        all.contains("Rank(s) 1 had exited (code 0) while the others still ran"),
        "{all}"
    );
    assert!(
        all.contains("rank(s) 1 never joined (1 of 2 present)"),
        "{all}"
    );
    // The join deadline (3 s) and a few seconds of slack.
    assert!(
        started.elapsed() < Duration::from_secs(3 + 6),
        "{:?}\n{all}",
        started.elapsed()
    );
}

#[test]
fn a_missing_program_is_an_error_naming_it() {
    let mut cmd = flotilla();
    cmd.args(["launch", "-n", "2", "--", "/nonexistent/program", "--flag"]);
    let o = run_with_deadline(cmd, Duration::from_secs(30));
    assert!(!o.status.success());
    assert!(
        text(&o).contains("starting /nonexistent/program --flag: starting rank 0"),
        "{}",
        text(&o)
    );
}

#[test]
fn max_restarts_starts_a_failed_program_again() {
    let dir = tmp();
    let flag = dir.path().join("failed-once");
    // Rank 1 fails the first time only.
    let script = format!(
        "if [ \"$RANK\" = 1 ] && [ ! -f {f} ]; then touch {f}; exit 3; fi; exec {e}",
        f = flag.display(),
        e = custom_model().display()
    );
    let mut cmd = flotilla();
    cmd.args([
        "launch",
        "-n",
        "2",
        "--max-restarts",
        "1",
        "--",
        "sh",
        "-c",
        &script,
    ])
    .env("STEPS", "3")
    .env("OUT", dir.path().join("x.safetensors"));
    let o = run_with_deadline(cmd, Duration::from_secs(120));
    let all = text(&o);
    assert!(o.status.success(), "{all}");
    assert!(
        all.contains("[launcher] restart 1/1 after: rank 1 failed (exit code 3)"),
        "{all}"
    );
    assert_eq!(all.matches("test accuracy").count(), 1, "{all}");
}

/// Each rank's cores as it sees them, from `flotilla launch ARGS -n N -- sh -c ...`.
fn ranks_cores(n: usize, args: &[&str]) -> Vec<Vec<usize>> {
    let mut cmd = flotilla();
    cmd.arg("launch")
        .args(args)
        .args(["-n", &n.to_string(), "--"]);
    cmd.args(["sh", "-c", "grep Cpus_allowed_list /proc/self/status"]);
    let out = run_with_deadline(cmd, Duration::from_secs(60));
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    (0..n)
        .map(|r| {
            let prefix = format!("[rank {r}] Cpus_allowed_list:");
            let line = stdout.lines().find_map(|l| l.strip_prefix(&prefix));
            cores_of(line.unwrap_or_else(|| panic!("no line of rank {r}: {}", text(&out))))
        })
        .collect()
}

/// `--bind core` binds rank `r` of a program to the `r`-th of the launcher's cores
/// (round-robin); `auto` (the default) leaves a program's ranks unbound, as `none` does (the
/// launcher cannot tell a program's computing ranks from its waiting ones).
#[test]
fn a_programs_ranks_are_bound_to_cores_with_bind_core() {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let mine = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .map(cores_of)
        .expect("this process's cores");
    let n = mine.len() + 1;
    let bound = ranks_cores(n, &["--bind", "core"]);
    let expected: Vec<Vec<usize>> = (0..n).map(|r| vec![mine[r % mine.len()]]).collect();
    assert_eq!(bound, expected, "--bind core, {n} ranks on cores {mine:?}");
    assert_eq!(ranks_cores(n, &["--bind", "none"]), vec![mine.clone(); n]);
    assert_eq!(
        ranks_cores(n, &[]),
        vec![mine.clone(); n],
        "auto, a program"
    );
}

/// `examples/pipeline_model.rs` launched with `args` (after the config) for 40 steps of 64
/// (SGD with momentum) into `dir/name`, `env` set: its final checkpoint's tensors under the whole
/// module's names (a pipeline's `stage<k>.` as the module's field of stage `k`), and the
/// run's summary.json.
fn pipeline_example(
    dir: &Path,
    name: &str,
    args: &[&str],
    env: &[(&str, &str)],
) -> (Tensors, serde_json::Value) {
    let cfg = config_file(
        dir,
        &format!("{name}.yaml"),
        "batch_size: 64\nmax_steps: 40\nseed: 3\n\
         optimizer: {name: sgd, lr: 0.05, momentum: 0.9}\n",
    );
    let out = dir.join(name);
    let mut c = flotilla();
    c.args(["launch", &cfg, "--output", out.to_str().expect("utf8")])
        .args(args)
        .arg("--")
        .arg(example("pipeline_model"))
        .env("FLOTILLA_SECRET", SECRET)
        .envs(env.iter().copied());
    let o = run_with_deadline(c, Duration::from_secs(240));
    assert!(o.status.success(), "{name}:\n{}", text(&o));
    let fields = ["stem", "body", "head"];
    let tensors = checkpoint_tensors(&out)
        .into_iter()
        .map(
            |(k, v)| match k.strip_prefix("stage").and_then(|r| r.split_once('.')) {
                Some((s, rest)) => (
                    format!("{}.{rest}", fields[s.parse::<usize>().expect("k")]),
                    v,
                ),
                None => (k, v),
            },
        )
        .collect();
    let summary: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("summary.json")).expect("summary.json"),
    )
    .expect("summary");
    (tensors, summary)
}

/// The pipeline example's three stage modules (a skip tensor from the first straight to the
/// last) in the library's one pipeline train what the same program's whole module trains on
/// one rank: bit for bit with one micro-batch (a stage's backward hands on exactly the
/// gradient the whole module's would), within rounding with four (the micro-batches'
/// gradients summed), and GPipe and 1F1B give the same bits.
#[test]
fn the_pipeline_examples_stage_modules_train_what_its_whole_module_trains() {
    let dir = tmp();
    let dir = dir.path();
    let pipe = |micro: &'static str| {
        [
            "--strategy",
            "pipeline",
            "--stages",
            "3",
            "--micro-batches",
            micro,
        ]
    };
    let (whole, summary) = pipeline_example(dir, "whole", &["-n", "1"], &[]);
    let acc = summary["run"]["final_acc"].as_f64().expect("final_acc");
    let (one, _) = pipeline_example(dir, "one", &pipe("1"), &[]);
    let (four, _) = pipeline_example(dir, "four", &pipe("4"), &[]);
    let gpipe = [("FLOTILLA_PIPELINE__SCHEDULE", "gpipe")];
    let (gpipe, summary) = pipeline_example(dir, "gpipe", &pipe("4"), &gpipe);
    assert_eq!(summary["config"]["pipeline"]["schedule"], "gpipe");
    assert!(acc >= 0.8, "40 steps did not train: test accuracy {acc}");
    assert_bitwise("3 stages, 1 micro-batch vs the whole module", &one, &whole);
    assert_bitwise("GPipe vs 1F1B", &gpipe, &four);
    let e = relative_error(&four, &whole);
    assert!(
        e > 0.0 && e <= 1e-5,
        "3 stages, 4 micro-batches vs the whole module: relative error {e}"
    );
}

/// What rank 0 of `examples/pipeline_mnist.rs` printed at the end: test accuracy and loss
/// (`stage 0 of 2: test accuracy 0.9123, loss 0.2841, 3.1 s`).
fn pipeline_mnist_figures(o: &std::process::Output) -> (f64, f64) {
    let stdout = String::from_utf8_lossy(&o.stdout);
    let figure = |line: &str, name: &str| -> Option<f64> {
        let rest = line.split(name).nth(1)?;
        rest.split([',', ' ']).next()?.parse().ok()
    };
    stdout
        .lines()
        .find_map(|l| Some((figure(l, "test accuracy ")?, figure(l, ", loss ")?)))
        .unwrap_or_else(|| panic!("no test accuracy and loss printed:\n{}", text(o)))
}

/// `examples/pipeline_mnist.rs` (LeNet-5 cut into 2 stages by flotilla-train's `Pipeline`,
/// SGD with momentum) as the ranks of a job, 200 steps of a global batch of 64: its plain
/// loop (forward, the loss and its gradient, backward, step), `train_batch` with the GPipe
/// schedule, and 2 replicas of the stages each on its half of the batch all train LeNet-5
/// past 90% test accuracy, and end within 0.5% of accuracy and 0.01 of test loss of one
/// another (the same maths; not bitwise: 200 steps amplify their different rounding).
#[test]
fn the_pipeline_mnist_example_trains_alike_in_its_loops_and_on_2_replicas() {
    let run = |replicas: usize, schedule: Option<&str>| -> (f64, f64) {
        let mut env = vec![
            ("STEPS", "200".to_string()),
            ("DATA_PARALLEL", replicas.to_string()),
            ("BATCH", (64 / replicas).to_string()),
            ("FLOTILLA_SECRET", SECRET.to_string()),
        ];
        env.extend(schedule.map(|s| ("SCHEDULE", s.to_string())));
        let o = launch(
            "pipeline_mnist",
            2 * replicas,
            &env,
            Duration::from_secs(300),
        );
        assert!(o.status.success(), "{env:?}:\n{}", text(&o));
        pipeline_mnist_figures(&o)
    };
    let plain = run(1, None);
    assert!(plain.0 >= 0.9, "200 steps reach 90%: {plain:?}");
    for (name, other) in [
        ("gpipe's train_batch", run(1, Some("gpipe"))),
        ("2 replicas", run(2, None)),
    ] {
        assert!(
            (other.0 - plain.0).abs() <= 0.005 && (other.1 - plain.1).abs() <= 0.01,
            "{name} vs the plain loop on 1 replica (test accuracy, loss): {other:?} vs {plain:?}"
        );
    }
}

/// A program that meets its peers by itself binds `MASTER_PORT` in rank 0, as under
/// torchrun: the launcher leaves that port free (its own rendezvous socket, which a Flotilla
/// rank 0 inherits, is at `FLOTILLA_COMM__MASTER_PORT`). Rank 0 of a plain Python program
/// binds it; a torch program's 3 ranks all-reduce over gloo with `init_process_group`'s
/// `env://` (with the torch of `FLOTILLA_TORCH_PYTHON`; under `CI` its absence fails).
#[test]
fn a_program_that_binds_master_port_itself_meets_its_peers_as_under_torchrun() {
    const BIND: &str = "import os, socket\n\
        s = socket.socket()\n\
        s.bind((os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT'])))\n\
        print('bound', os.environ['MASTER_PORT'], 'ours', os.environ['FLOTILLA_COMM__MASTER_PORT'])\n";
    const TORCH: &str = "import torch, torch.distributed as dist\n\
        dist.init_process_group('gloo')\n\
        t = torch.tensor([float(dist.get_rank() + 1)])\n\
        dist.all_reduce(t)\n\
        print(f'sum={t.item()}')\n\
        dist.destroy_process_group()\n";
    let run = |python: &str, n: usize, script: &str| {
        let mut cmd = flotilla();
        cmd.args(["launch", "-n", &n.to_string(), "--", python, "-c", script])
            .env("FLOTILLA_SECRET", SECRET);
        let o = run_with_deadline(cmd, Duration::from_secs(120));
        assert!(o.status.success(), "{}", text(&o));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let out = run("python3", 1, BIND);
    let line = out.lines().find(|l| l.starts_with("[rank 0] bound "));
    let line = line.unwrap_or_else(|| panic!("{out}"));
    let ports: Vec<&str> = line
        .split_whitespace()
        .filter(|w| w.parse::<u16>().is_ok())
        .collect();
    assert!(ports.len() == 2 && ports[0] != ports[1], "{line}");
    let python = std::env::var("FLOTILLA_TORCH_PYTHON").ok();
    let Some(python) = python.filter(|p| common::python_has(p, "torch")) else {
        assert!(
            std::env::var("CI").is_err(),
            "CI runs a torch program: FLOTILLA_TORCH_PYTHON names no Python with torch (.ci/run installs it)"
        );
        eprintln!("SKIPPED the torch program: FLOTILLA_TORCH_PYTHON names no Python with torch");
        return;
    };
    let out = run(&python, 3, TORCH);
    for rank in 0..3 {
        assert!(
            out.contains(&format!("[rank {rank}] sum=6.0")),
            "rank {rank}:\n{out}"
        );
    }
}
