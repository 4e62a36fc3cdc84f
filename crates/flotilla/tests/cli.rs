//! End-to-end tests: real `flotilla` processes over 127.0.0.1, on the vendored MNIST.
//!
//! Every child runs with a deadline and is killed when the test ends (see [`Proc`]).

mod common;
#[path = "common/running.rs"]
mod running;
#[path = "common/watched.rs"]
mod watched;

use common::*;
use watched::{assert_within, run_watched};

use std::process::Command;
use std::time::{Duration, Instant};

#[test]
fn a_rank_that_never_joins_is_named_within_the_deadline() {
    let dir = tmp();
    let cfg = dir.path().join("c.yaml");
    std::fs::write(&cfg, "world_size: 3\njoin_timeout_s: 3\ntimeout_s: 3\n").expect("write");
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port().to_string()
    };
    let started = Instant::now();
    let spawn = |rank: &str| {
        let mut c = flotilla_rank();
        c.args([
            "train",
            cfg.to_str().expect("utf8"),
            "--rank",
            rank,
            "--master-port",
            &port,
        ])
        .args(["--output", dir.path().join("out").to_str().expect("utf8")]);
        std::thread::spawn(move || run_with_deadline(c, Duration::from_secs(60)))
    };
    let r0 = spawn("0");
    let r1 = spawn("1");
    let (o0, o1) = (r0.join().expect("rank 0"), r1.join().expect("rank 1"));
    // The join deadline (3 s) plus slack for starting two processes on a loaded machine.
    assert!(
        started.elapsed() < Duration::from_secs(3 + 5),
        "took {:?}",
        started.elapsed()
    );
    assert!(!o0.status.success() && !o1.status.success());
    let e0 = String::from_utf8_lossy(&o0.stderr);
    assert!(
        e0.contains("rendezvous timed out after 3s: rank(s) 2 never joined (2 of 3 present)"),
        "rank 0 must name rank 2:\n{}",
        text(&o0)
    );
    assert!(
        !o1.stderr.is_empty(),
        "rank 1 must fail with an error too:\n{}",
        text(&o1)
    );
}

/// Runs `flotilla ARGS`, which must fail with an error that mentions each of `want`.
fn check(args: &[&str], want: &[&str]) {
    let mut c = flotilla();
    c.args(args);
    let o = run_with_deadline(c, Duration::from_secs(60));
    assert!(!o.status.success(), "{args:?} should fail\n{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    for w in want {
        assert!(
            err.contains(w),
            "{args:?}: error should mention {w:?}\n{}",
            text(&o)
        );
    }
}

/// A near miss names the key it was meant to be, with its place; a flag's number must be a
/// finite one; a missing data path is refused once, by the launcher, before any rank starts.
#[test]
fn settings_errors_say_what_to_change() {
    let dir = tmp();
    let near = dir.path().join("near.yaml");
    std::fs::write(&near, "batchsize: 32\nschedule: {epoch: 1}\n").expect("write");
    check(
        &["config", near.to_str().expect("utf8")],
        &[
            "near.yaml",
            "`batchsize`; did you mean `batch_size` (data.batch_size)?",
        ],
    );
    check(
        &["launch", "-n", "2", "--lr", "nan"],
        &["--lr", "nan is not a finite number"],
    );
    check(
        &["launch", "-n", "2", "--lr=-0.1"],
        &["optimizer.lr", "must be a finite positive number"],
    );
    // A program's launch checks the settings it hands the ranks, once, before any starts.
    let mut c = flotilla();
    c.args(["launch", "-n", "2", "--", "true"])
        .env("FLOTILLA_COMM__CHUNK_KB", "0");
    let o = run_with_deadline(c, Duration::from_secs(60));
    let all = text(&o);
    assert!(!o.status.success(), "{all}");
    assert!(
        all.contains("`comm.chunk_kb`: must be from 1 to") && !all.contains("launching"),
        "{all}"
    );
    // A data path given and missing: said once, by the launcher, for a config job and for a
    // program (`sh -c 'echo started'` would print if any rank were started).
    let program = ["--", "sh", "-c", "echo rank-started"];
    for tail in [&[][..], &program[..]] {
        let mut c = flotilla();
        c.args(["launch", "-n", "2", "--data", "/nonexistent-flotilla-data"])
            .args(tail);
        let o = run_with_deadline(c, Duration::from_secs(60));
        assert!(!o.status.success(), "{}", text(&o));
        let all = text(&o);
        assert_eq!(
            all.matches("/nonexistent-flotilla-data").count(),
            1,
            "said once, by the launcher:\n{all}"
        );
        assert!(
            all.contains("does not exist")
                && !all.contains("[rank")
                && !all.contains("rank-started"),
            "{all}"
        );
    }
}

#[test]
fn bad_inputs_give_clear_errors() {
    let dir = tmp();
    let unknown = dir.path().join("unknown.yaml");
    std::fs::write(&unknown, "epochs: 1\nlearning_rate: 0.1\n").expect("write");
    check(
        &["config", unknown.to_str().expect("utf8")],
        &["unknown.yaml", "learning_rate"],
    );

    let spec = dir.path().join("bad-model.yaml");
    std::fs::write(
        &spec,
        "input: [1, 28, 28]\nlayers:\n  - conv2d: {out: 4, k: 3}\n  - linear: {out: 10}\n",
    )
    .expect("write");
    check(
        &["launch", "-n", "1", "--model", spec.to_str().expect("utf8")],
        &["layer 1 (linear)", "flatten"],
    );

    let empty = dir.path().join("no-data");
    std::fs::create_dir(&empty).expect("mkdir");
    let out = dir.path().join("out");
    check(
        &[
            "train",
            "-n",
            "1",
            "--data",
            empty.to_str().expect("utf8"),
            "--output",
            out.to_str().expect("utf8"),
        ],
        &["train-images-idx3-ubyte", "no-data"],
    );

    let corrupt = dir.path().join("corrupt");
    std::fs::create_dir(&corrupt).expect("mkdir");
    for f in [
        "train-images-idx3-ubyte.gz",
        "train-labels-idx1-ubyte.gz",
        "t10k-images-idx3-ubyte.gz",
        "t10k-labels-idx1-ubyte.gz",
    ] {
        std::fs::copy(repo().join("data/mnist").join(f), corrupt.join(f)).expect("copy");
    }
    std::fs::write(
        corrupt.join("t10k-labels-idx1-ubyte.gz"),
        [0u8, 0, 8, 3, 0, 0, 0, 1],
    )
    .expect("write");
    check(
        &[
            "train",
            "-n",
            "1",
            "--data",
            corrupt.to_str().expect("utf8"),
            "--output",
            out.to_str().expect("utf8"),
        ],
        &["t10k-labels-idx1-ubyte", "magic"],
    );
}

#[test]
fn checkpoint_loads_in_python_safetensors_with_pytorch_shapes() {
    let dir = tmp();
    let out = dir.path().join("run");
    launch(
        &[
            "-n",
            "2",
            "--max-steps",
            "5",
            "--output",
            out.to_str().expect("utf8"),
        ],
        Duration::from_secs(120),
    );
    let root = out.join("checkpoints");
    let name = std::fs::read_to_string(root.join("latest")).expect("latest");
    let ckpt = root.join(name.trim()).join("model.safetensors");
    let probe = Command::new("python3")
        .args(["-c", "import safetensors.numpy, numpy"])
        .output();
    if !probe.is_ok_and(|o| o.status.success()) {
        assert!(
            std::env::var("CI").is_err(),
            "CI must have python3 with safetensors and numpy (see .ci/run)"
        );
        eprintln!(
            "SKIPPED: python3 with safetensors+numpy not installed (pip install safetensors numpy)"
        );
        return;
    }
    let mut c = Command::new("python3");
    c.arg(repo().join("scripts/check_checkpoint.py"))
        .arg(&ckpt)
        .args(["--model", "lenet5"]);
    let o = run_with_deadline(c, Duration::from_secs(60));
    assert!(o.status.success(), "python check failed\n{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("OK 10 tensors"),
        "{}",
        text(&o)
    );
}

#[test]
fn lenet5_default_job_reaches_99_percent() {
    let dir = tmp();
    let out = dir.path().join("lenet");
    let o = launch(
        &["--output", out.to_str().expect("utf8")],
        Duration::from_secs(900),
    );
    let f = final_fields(&o);
    assert!(
        f["test_acc"] >= 0.99,
        "LeNet-5 test accuracy {} < 0.99\n{}",
        f["test_acc"],
        text(&o)
    );
    // What the user looks at afterwards: the run's figures and its plots.
    let summary: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("summary.json")).expect("summary.json"))
            .expect("json");
    let run = &summary["run"];
    assert_eq!(run["final_acc"].as_f64(), Some(f["test_acc"]), "{run}");
    let at_99 = &run["time_to_accuracy"]["0.99"];
    assert!(at_99["wall_s"].as_f64().is_some_and(|s| s > 0.0), "{run}");
    for plot in ["loss.svg", "accuracy.svg"] {
        let svg = std::fs::read_to_string(out.join(plot)).expect(plot);
        assert!(
            svg.starts_with("<svg") && svg.contains("against wall time"),
            "{plot}"
        );
    }
}

#[test]
fn mlp_reaches_97_5_percent() {
    let dir = tmp();
    let out = dir.path().join("mlp");
    let o = launch(
        &[
            "examples/mnist-mlp.yaml",
            "--output",
            out.to_str().expect("utf8"),
        ],
        Duration::from_secs(900),
    );
    let f = final_fields(&o);
    assert!(
        f["test_acc"] >= 0.975,
        "MLP test accuracy {} < 0.975\n{}",
        f["test_acc"],
        text(&o)
    );
}

#[test]
fn async_parameter_server_trains_on_when_a_worker_dies() {
    let dir = tmp();
    let cfg = config_file(
        dir.path(),
        "async.yaml",
        "arch: flat\nparameter_server: {aggr_type: async, num_workers: 3}\nnum_server_rounds: 150\noptimizer: {name: sgd, lr: 0.05, momentum: 0.5}\nwarmup_steps: 0\n",
    );
    let out = dir.path().join("run");
    let mut c = flotilla();
    c.args(["launch", &cfg, "--output", out.to_str().expect("utf8")])
        .env("FLOTILLA_FAULT", "rank=3,step=20,action=exit");
    let o = run_with_deadline(c, Duration::from_secs(300));
    assert!(
        o.status.success(),
        "the job must survive a dead async worker\n{}",
        text(&o)
    );
    let f = final_fields(&o);
    assert_eq!(f["steps"], 150.0);
    assert!(
        f["test_acc"] > 0.8,
        "accuracy {}\n{}",
        f["test_acc"],
        text(&o)
    );
    let log = run_log(&out, 0);
    assert!(
        log.contains("rank 3 lost"),
        "the root logs the loss of rank 3:\n{log}"
    );
    assert!(log.contains("lost children [3]"), "{log}");
}

#[test]
fn sync_parameter_server_names_a_missing_worker() {
    let dir = tmp();
    let cfg = config_file(
        dir.path(),
        "sync.yaml",
        "arch: flat\nparameter_server: {aggr_type: sync, num_workers: 2}\nnum_server_rounds: 100\ntimeout_s: 3\n",
    );
    let mut c = flotilla();
    c.args([
        "launch",
        &cfg,
        "--output",
        dir.path().join("run").to_str().expect("utf8"),
    ])
    .env("FLOTILLA_FAULT", "rank=2,step=5,action=hang");
    let (status, job) = run_watched(c, Duration::from_secs(120));
    assert!(!status.success(), "{}", job.text());
    // The server waits `timeout_s` (3 s) for the round's pushes, then names the silent rank.
    let hung = "FLOTILLA_FAULT: rank stops responding after step 5";
    let bound = Duration::from_secs(3 + 4);
    assert_within(&job, hung, "no message from rank(s) 2", bound);
    assert_within(&job, hung, "rank 2 stopped responding", bound);
}

/// A push that no retry can make acceptable (here of the wrong length, once, by fault
/// injection) is refused by the server, which changes nothing; the worker, told so, stops at
/// once naming its server and the reason, and the launcher ends the job naming that worker
/// (before, a worker pulled and pushed again after every refusal, without end).
#[test]
fn a_push_of_the_wrong_length_is_refused_and_its_worker_stops_naming_why() {
    let dir = tmp();
    let cfg = config_file(
        dir.path(),
        "sync.yaml",
        "arch: flat\nparameter_server: {aggr_type: sync, num_workers: 2}\nnum_server_rounds: 30\n",
    );
    let out = dir.path().join("run");
    let mut c = flotilla();
    c.args(["launch", &cfg, "--output", out.to_str().expect("utf8")])
        .env("FLOTILLA_FAULT", "rank=1,step=3,action=bad_len");
    let o = run_with_deadline(c, Duration::from_secs(120));
    assert!(!o.status.success(), "{}", text(&o));
    let reason = "push has 30853 values but the model has 61706 parameters";
    let root = run_log(&out, 0);
    assert!(
        root.contains(&format!("rejected push from rank 1 (for good): {reason}")),
        "{root}"
    );
    let all = text(&o);
    assert!(
        all.contains(&format!(
            "rank 1 failed: rank 0 refused this rank's push for good: {reason}"
        )) && all.contains("error: rank 1 failed (exit code 1)"),
        "{all}"
    );
}

#[test]
fn hierarchical_async_and_model_averaging_train() {
    let dir = tmp();
    let cases = [
        (
            "sync-async",
            "arch: hierarchical\nglobal_server:\n  aggr_type: sync\n  local_servers:\n    - {type: async, num_workers: 2}\n    - {type: async, num_workers: 1}\nnum_server_rounds: 200\nwarmup_steps: 0\noptimizer: {name: sgd, lr: 0.05, momentum: 0.0}\n",
        ),
        (
            "async-sync",
            "arch: hierarchical\nglobal_server:\n  aggr_type: async\n  local_servers:\n    - {type: sync, num_workers: 1}\n    - {type: sync, num_workers: 1}\nnum_server_rounds: 150\nwarmup_steps: 0\nstaleness_lr: true\noptimizer: {name: sgd, lr: 0.05, momentum: 0.5}\n",
        ),
        (
            "sharded-async",
            "arch: flat\nservers: 2\nparameter_server: {aggr_type: async, num_workers: 2}\nnum_server_rounds: 150\nwarmup_steps: 0\noptimizer: {name: sgd, lr: 0.05, momentum: 0.5}\n",
        ),
        (
            "averaging",
            "arch: flat\nparameter_server: {aggr_type: sync, num_workers: 2}\nlocal_steps: 4\nnum_server_rounds: 40\nwarmup_steps: 0\n",
        ),
    ];
    for (name, yaml) in cases {
        let cfg = config_file(dir.path(), &format!("{name}.yaml"), yaml);
        let out = dir.path().join(name);
        let o = launch(
            &[&cfg, "--output", out.to_str().expect("utf8")],
            Duration::from_secs(300),
        );
        let f = final_fields(&o);
        assert!(
            f["test_acc"] > 0.8,
            "{name}: accuracy {}\n{}",
            f["test_acc"],
            text(&o)
        );
    }
}

#[test]
fn residual_models_train_from_their_shipped_specs() {
    let dir = tmp();
    let cases = [
        (
            "resnet-mnist",
            "model: resnet-mnist\nwarmup_steps: 0\nmax_steps: 200\nbatch_size: 32\noptimizer: {name: adam, lr: 0.002}\n",
            0.75,
        ),
        (
            "resmlp",
            "model: resmlp\nmax_steps: 300\nbatch_size: 64\n",
            0.9,
        ),
    ];
    for (name, yaml, want) in cases {
        let cfg = config_file(dir.path(), &format!("{name}.yaml"), yaml);
        let out = dir.path().join(name);
        let o = launch(
            &[&cfg, "--output", out.to_str().expect("utf8")],
            Duration::from_secs(300),
        );
        let acc = final_fields(&o)["test_acc"];
        assert!(
            acc >= want,
            "{name}: test accuracy {acc} < {want}\n{}",
            text(&o)
        );
    }
}

/// A job started the way `srun` starts it: no flags, only Slurm's variables (rank, task
/// count, local id, and the node list whose first host is the rendezvous).
#[test]
fn slurm_variables_alone_start_a_job() {
    let dir = tmp();
    let out = dir.path().join("slurm");
    let port = free_port();
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            let mut c = flotilla_rank();
            c.args(["train", "--max-steps", "20", "--output"])
                .arg(out.to_str().expect("utf8"))
                .env("SLURM_PROCID", rank.to_string())
                .env("SLURM_LOCALID", rank.to_string())
                .env("SLURM_NTASKS", "2")
                .env("SLURM_JOB_NODELIST", "127.0.0.1")
                .env("MASTER_PORT", &port);
            std::thread::spawn(move || run_with_deadline(c, Duration::from_secs(120)))
        })
        .collect();
    for h in ranks {
        let o = h.join().expect("rank thread");
        assert!(o.status.success(), "{}", text(&o));
        assert_eq!(final_fields(&o)["steps"], 20.0, "{}", text(&o));
    }
    let log = run_log(&out, 1);
    assert!(
        log.contains("rank 1/2 up") && log.contains("local_rank=1 ($SLURM_LOCALID)"),
        "{log}"
    );
    // A variable that does not parse is named.
    let mut c = flotilla();
    c.args(["train", "--max-steps", "1"])
        .env("SLURM_PROCID", "first");
    let o = run_with_deadline(c, Duration::from_secs(30));
    assert!(!o.status.success());
    assert!(text(&o).contains("$SLURM_PROCID=\"first\""), "{}", text(&o));
}

/// Reads `<dir>/summary.json`.
fn summary_of(dir: &std::path::Path) -> serde_json::Value {
    let path = dir.join("summary.json");
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_slice(&bytes).expect("summary.json is JSON")
}

/// A short LeNet-5 run: enough steps to be far above chance, in seconds.
const SHORT_RUN: &str = "train_limit: 4000\nepochs: 2\nwarmup_steps: 0\nbatch_size: 64\n";

/// Ranks started the way mpirun or torchrun start them (RANK, WORLD_SIZE, MASTER_*), with
/// no `flotilla launch`: rank 0 still leaves the run's report.
#[test]
fn a_job_started_without_the_launcher_leaves_its_report() {
    let dir = tmp();
    let cfg = config_file(dir.path(), "short.yaml", SHORT_RUN);
    let out = dir.path().join("by-hand");
    let port = free_port();
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            let mut c = flotilla_rank();
            c.args(["train", &cfg, "--output", out.to_str().expect("utf8")])
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port);
            std::thread::spawn(move || run_with_deadline(c, Duration::from_secs(120)))
        })
        .collect();
    let outputs: Vec<_> = ranks.into_iter().map(|h| h.join().expect("rank")).collect();
    for o in &outputs {
        assert!(o.status.success(), "{}", text(o));
    }
    let s = summary_of(&out);
    let run = &s["run"];
    let acc = run["final_acc"].as_f64().expect("final_acc");
    assert!(acc > 0.5, "accuracy {acc} is not above chance: {run}");
    assert_eq!(Some(acc), Some(final_fields(&outputs[0])["test_acc"]));
    // 2 epochs of 31 steps (each rank's 2000 samples in whole batches of 64).
    assert_eq!(run["steps"], 62, "{run}");
    assert_eq!(run["samples"], 62 * 128, "{run}");
    // All-reduce of LeNet-5's 61,706 f32 gradients: over TCP each rank sends at least its
    // 2 (N-1)/N share of the buffer per step; over shared memory (these ranks share a host)
    // each copies its whole buffer into the segment. Either way at least 4 bytes per
    // parameter per step in all (plus evaluation, the initial broadcast and headers).
    let moved = run["bytes_moved"].as_f64().expect("bytes_moved");
    assert!(moved >= 62.0 * 61_706.0 * 4.0, "{run}");
    let per_sample = run["bytes_per_sample"].as_f64().expect("bytes_per_sample");
    assert!((per_sample - moved / (62.0 * 128.0)).abs() < 1e-6, "{run}");
    assert!(run["samples_per_s"].as_f64() > Some(0.0), "{run}");
    assert_eq!(s["topology"]["roles"], serde_json::json!(["peer", "peer"]));
    assert_eq!(s["config"]["model"]["spec"], "lenet5");
    assert_eq!(s["history"].as_array().map(Vec::len), Some(2), "{s}");
    assert_eq!(s["ranks"][1]["role"], "peer");
    assert!(s["ranks"][1]["bytes_sent"].as_u64() > Some(0));
    for plot in ["loss.svg", "accuracy.svg"] {
        let svg = std::fs::read_to_string(out.join(plot)).expect(plot);
        assert!(
            svg.starts_with("<svg") && svg.contains("<polyline"),
            "{plot}"
        );
    }
}

#[test]
fn compare_runs_each_strategy_and_reports_them() {
    let dir = tmp();
    // A pipeline cannot cut a batch of 64 into 128 micro-batches: that strategy fails in its
    // row, the others run.
    let cfg = config_file(
        dir.path(),
        "short.yaml",
        &format!("{SHORT_RUN}micro_batches: 128\n"),
    );
    let out = dir.path().join("compare");
    let started = Instant::now();
    let o = run_with_deadline(
        {
            let mut c = flotilla();
            c.args(["compare", &cfg, "-n", "2", "--target-accuracy", "0.5"])
                .args(["--strategies", "sync_allreduce,pipeline,ps_flat_sync"])
                .args(["--output", out.to_str().expect("utf8")]);
            c
        },
        Duration::from_secs(180),
    );
    assert!(o.status.success(), "{}", text(&o));
    eprintln!("compare of 2 strategies took {:?}", started.elapsed());
    let md = std::fs::read_to_string(out.join("compare.md")).expect("compare.md");
    let row = |name: &str| -> Vec<String> {
        let line = md
            .lines()
            .find(|l| l.starts_with(&format!("| {name} |")))
            .unwrap_or_else(|| panic!("no row for {name}:\n{md}"));
        line.split('|').map(|c| c.trim().to_string()).collect()
    };
    let pct = |cell: &str| -> f64 { cell.trim_end_matches('%').parse().expect(cell) };
    let (ar, ps) = (row("sync_allreduce"), row("ps_flat_sync"));
    assert_eq!(ar[2], "2 (2 peer)", "{md}");
    assert_eq!(ps[2], "3 (1 root, 2 worker)", "{md}");
    let pipeline = row("pipeline");
    assert!(
        pipeline[3].starts_with("failed: ") && pipeline[3].contains("128 micro-batches"),
        "{md}"
    );
    for r in [&ar, &ps] {
        assert!(
            r[3].ends_with(')') && r[3].contains(" s (step "),
            "time to 50%: {md}"
        );
        assert!(pct(&r[4]) > 50.0, "final accuracy: {md}");
        assert!(r[6].parse::<f64>().expect("samples/s") > 0.0, "{md}");
        assert!(r[7].ends_with("KiB"), "bytes per sample: {md}");
    }
    // Per sample, a flat server's workers each push and pull the whole model every round;
    // the ring moves about one model per rank per step: the server moves more.
    let bytes = |dir: &str| summary_of(&out.join(dir))["run"]["bytes_per_sample"].as_f64();
    assert!(bytes("ps_flat_sync") > bytes("sync_allreduce"), "{md}");
    let svg = std::fs::read_to_string(out.join("compare.svg")).expect("compare.svg");
    assert!(
        svg.contains("sync_allreduce") && svg.contains("ps_flat_sync") && svg.contains("<polyline"),
        "compare.svg"
    );
    assert!(
        !svg.lines().any(|l| l.trim() == "pipeline"),
        "a failed strategy has no line in the legend"
    );

    // An unknown name is refused before anything runs, with the known names.
    let mut c = flotilla();
    c.args(["compare", &cfg, "--strategies", "sync_allreduce,ps_flat"])
        .args(["--output", dir.path().join("never").to_str().expect("utf8")]);
    let o = run_with_deadline(c, Duration::from_secs(30));
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("unknown strategy `ps_flat`") && err.contains("ps_hierarchical"),
        "{}",
        text(&o)
    );
    assert!(!dir.path().join("never").exists());
}

/// A local job larger than the machine is refused before anything starts, naming the limit;
/// `flotilla train` of a multi-rank job with no rank and no rendezvous says what to set at
/// once instead of waiting for a rank 0 nobody started.
#[test]
fn impossible_jobs_are_refused_at_once() {
    let started = std::time::Instant::now();
    let mut c = flotilla();
    // (Beyond 65,536 processes the topology itself refuses, before the machine is asked.)
    c.args(["launch", "-n", "20000", "--output"])
        .arg(tmp().path().join("huge"));
    let o = run_with_deadline(c, Duration::from_secs(20));
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("20000 local ranks is more than this machine runs: at most 8 ranks per core")
            && err.contains("--oversubscribe"),
        "{}",
        text(&o)
    );
    assert!(!String::from_utf8_lossy(&o.stdout).contains("[rank "));

    let mut c = flotilla();
    c.args(["train", "--output"])
        .arg(tmp().path().join("alone"));
    let o = run_with_deadline(c, Duration::from_secs(20));
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("nothing says which rank it is or where rank 0 listens: set RANK"),
        "{}",
        text(&o)
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
}

/// A launcher killed by SIGKILL (no cleanup code runs) leaves no rank behind, even ranks
/// that print nothing (so no closed pipe would end them): rank 1 hangs, rank 0 waits for it
/// in a collective with a long deadline, and both get the parent-death signal.
#[test]
fn a_killed_launcher_leaves_no_rank_behind() {
    let dir = tmp();
    let out = dir.path().join("orphans");
    let mut c = flotilla();
    c.args(["launch", "--epochs", "50", "--timeout-s", "300", "--output"])
        .arg(&out)
        .env("FLOTILLA_FAULT", "rank=1,step=2,action=hang")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let mut launcher = Proc(c.spawn().expect("launch"));
    let needle = out.join("launch-config.yaml");
    let needle = needle.to_str().expect("utf8");
    /// Kills what the test started if it fails (the ranks are not its children).
    struct Reaper<'a>(&'a str);
    impl Drop for Reaper<'_> {
        fn drop(&mut self) {
            for (pid, _) in processes_mentioning(self.0) {
                let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            }
        }
    }
    let _reaper = Reaper(needle);
    let started = Instant::now();
    while processes_mentioning(needle).len() < 2 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "ranks never started"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Past the rendezvous and into the hang (a few steps take well under a second).
    std::thread::sleep(Duration::from_secs(4));
    launcher.0.kill().expect("SIGKILL the launcher");
    let _ = launcher.0.wait();
    assert_none_left(needle, Duration::from_secs(5));
}

/// `-n` on a job whose size its config fixes (a pipeline's stages × replicas, a hierarchical
/// parameter-server tree, a flat server's workers) is refused naming the size, not silently
/// ignored; an elastic range as it was given, with the MAX to give.
#[test]
fn n_that_the_config_overrules_is_refused_naming_the_size() {
    for (config, n, size) in [
        (
            "examples/mnist-pipeline.yaml",
            "4",
            "2 ranks (2 stages × 1 replica)",
        ),
        (
            "examples/ps-hierarchical.yaml",
            "4",
            "7 ranks (1 global server",
        ),
        (
            "examples/ps-flat-sync.yaml",
            "2:3",
            "5 ranks (1 server, 4 workers) (`-n MIN:5`)",
        ),
    ] {
        let mut c = flotilla();
        c.args(["launch", config, "-n", n, "--output"])
            .arg(tmp().path().join("n"));
        let o = run_with_deadline(c, Duration::from_secs(60));
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            !o.status.success()
                && err.contains(&format!(
                    "-n {n}: this job's size comes from its config, not from -n: {size}"
                )),
            "{config}: {}",
            text(&o)
        );
        assert!(!String::from_utf8_lossy(&o.stdout).contains("[rank "));
    }
}
