//! `strategy: pipeline` through the CLI: real `flotilla` processes over 127.0.0.1 on the
//! vendored MNIST. A pipeline trains exactly what one process (or data parallel over its
//! replicas, with ZeRO-1 among them too) trains, its merged checkpoint has the whole model's
//! PyTorch names, it resumes bitwise (a stage's state above a frame too), a dead stage is named by the others, and a cut that does not fit is refused
//! before any rank starts.

mod common;
#[path = "common/running.rs"]
mod running;
#[path = "common/watched.rs"]
mod watched;

use common::*;
use watched::{assert_survivors_name, train_by_hand_watched};

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

type Tensors = BTreeMap<String, Vec<f32>>;

const LIMIT: Duration = Duration::from_secs(300);

/// The residual CNN (a skip tensor crosses the cut at layer 8), momentum SGD, past the
/// warm-up into the cosine decay.
const COMMON: &str = "model: resnet-mnist\nbatch_size: 32\nmax_steps: 50\nwarmup_steps: 20\nlr_schedule: cosine\noptimizer: {name: sgd, lr: 0.05, momentum: 0.9}\n";

fn run(dir: &Path, name: &str, yaml: &str) -> (Tensors, String) {
    let cfg = config_file(dir, &format!("{name}.yaml"), &format!("{COMMON}{yaml}"));
    let out = dir.join(name);
    let o = launch(&[&cfg, "--output", out.to_str().expect("utf8")], LIMIT);
    assert_eq!(final_fields(&o)["steps"], 50.0, "{name}\n{}", text(&o));
    // What the launcher printed (the plan) and rank 0's log.
    let said = format!("{}{}", String::from_utf8_lossy(&o.stdout), run_log(&out, 0));
    (checkpoint_tensors(&out), said)
}

/// The parameters before the first step (a run of zero steps checkpoints them).
fn initial(dir: &Path) -> Tensors {
    let cfg = config_file(dir, "initial.yaml", &format!("{COMMON}world_size: 1\n"));
    let out = dir.join("initial");
    let out_s = out.to_str().expect("utf8");
    launch(&[&cfg, "--max-steps", "0", "--output", out_s], LIMIT);
    checkpoint_tensors(&out)
}

fn assert_close(name: &str, a: &Tensors, b: &Tensors, tol: f64) {
    let e = relative_error(a, b);
    assert!(e <= tol, "{name}: relative error {e} > {tol}");
}

#[test]
fn a_pipeline_trains_what_one_process_trains_and_resumes_bitwise() {
    let dir = tmp();
    let (single, _) = run(dir.path(), "single", "world_size: 1\n");
    let (piped, log) = run(
        dir.path(),
        "piped",
        "strategy: pipeline\nsplit_points: [8]\nmicro_batches: 4\nschedule: 1f1b\ncheckpoint_every: 25\n",
    );
    assert!(
        log.contains("crossings: ~main 0→1, b2_in 0→1"),
        "the plan names the skip tensor crossing the cut:\n{log}"
    );
    // The merged checkpoint holds the whole model, in the same names as one process's.
    assert_close("2-stage 1F1B pipeline vs 1 process", &piped, &single, 1e-5);
    let moved = relative_error(&piped, &initial(dir.path()));
    assert!(moved > 1e-2, "parameters barely moved ({moved})");

    // Killed after the step-25 checkpoint, resumed with the same config: bitwise the same.
    let cfg = config_file(
        dir.path(),
        "resumed.yaml",
        &format!(
            "{COMMON}strategy: pipeline\nsplit_points: [8]\nmicro_batches: 4\nschedule: 1f1b\ncheckpoint_every: 25\n"
        ),
    );
    let out = dir.path().join("resumed");
    let out_s = out.to_str().expect("utf8");
    let mut c = flotilla();
    c.args(["launch", &cfg, "--output", out_s])
        .env("FLOTILLA_FAULT", "rank=1,step=35,action=exit");
    let o = run_with_deadline(c, LIMIT);
    assert!(
        !o.status.success(),
        "the fault must stop the job\n{}",
        text(&o)
    );
    let o = launch(&[&cfg, "--output", out_s, "--resume"], LIMIT);
    assert!(
        run_log(&out, 0).contains("(step 25)"),
        "must resume from step 25:\n{}",
        run_log(&out, 0)
    );
    assert_eq!(final_fields(&o)["steps"], 50.0);
    let resumed = checkpoint_tensors(&out);
    assert_eq!(
        relative_error(&resumed, &piped),
        0.0,
        "resume is not bitwise"
    );
}

#[test]
fn pipeline_replicas_train_what_data_parallel_trains() {
    let dir = tmp();
    let (dp, _) = run(dir.path(), "dp", "world_size: 2\n");
    // One micro-batch: the same sums in the same order as data parallel, so bitwise equal.
    // (With micro-batches the sums are grouped differently: measured 1e-9 relative after one
    // step, 1e-8 after 10, 5e-5 after 50 as training amplifies rounding; the first test
    // bounds that at 1e-5 against one process.)
    let (piped, log) = run(
        dir.path(),
        "piped-dp",
        "strategy: pipeline\nstages: [[0, 5], [6, 14], [15, 23]]\nmicro_batches: 1\ndata_parallel: 2\n",
    );
    assert!(log.contains("3 stages × 2 replicas"), "{log}");
    assert_eq!(
        relative_error(&piped, &dp),
        0.0,
        "3 stages × 2 replicas vs 2-rank all-reduce"
    );
}

/// 2 stages × 2 replicas with ZeRO-1 (each replica steps its half of its stage's Adam
/// state) train the bits of 2-rank data parallel, through a checkpoint and a resume, and so
/// do ZeRO-2 (the gradient reduce-scattered among the replicas) and ZeRO-3 (the parameters
/// sharded too, gathered for each use, one micro-batch a step): the MLP is wide (a 3000 ×
/// 3000 layer in stage 1, whose Adam state, 72 MB, is more than a frame, `max_frame_bytes`,
/// 64 MiB), and each replica writes its half of it into the checkpoint and reads it back.
#[test]
fn a_wide_pipeline_with_zero_1_2_or_3_trains_data_parallels_bits_through_a_resume() {
    let dir = tmp();
    let d = dir.path();
    let spec = "input: [1, 28, 28]\nlayers:\n  - flatten\n  - linear: {out: 3000}\n  - relu\n  - linear: {out: 3000}\n  - relu\n  - linear: {out: 10}\n";
    std::fs::write(d.join("wide.yaml"), spec).expect("spec");
    let common = format!(
        "model: {}\nbatch_size: 32\nmax_steps: 4\ntest_limit: 100\noptimizer: {{name: adam, lr: 0.001}}\n",
        d.join("wide.yaml").display()
    );
    let launched = |name: &str, yaml: &str, extra: &[&str]| {
        let cfg = config_file(d, &format!("{name}.yaml"), &format!("{common}{yaml}"));
        let out = d.join(name).to_str().expect("utf8").to_string();
        let mut c = flotilla();
        c.args(["launch", &cfg, "--output", &out]).args(extra);
        (c, d.join(name))
    };
    let (c, out) = launched("dp", "world_size: 2\n", &[]);
    let o = run_with_deadline(c, LIMIT);
    assert!(o.status.success(), "{}", text(&o));
    let dp = checkpoint_tensors(&out);

    let zero_2 =
        "strategy: pipeline\nsplit_points: [3]\nmicro_batches: 1\ndata_parallel: 2\nzero: 2\n";
    let (c, out) = launched("piped-2", zero_2, &[]);
    let o = run_with_deadline(c, LIMIT);
    assert!(o.status.success(), "{}", text(&o));
    let log = run_log(&out, 0);
    assert!(log.contains("ZeRO stage 2 among the replicas"), "{log}");
    assert_eq!(
        relative_error(&checkpoint_tensors(&out), &dp),
        0.0,
        "2 stages × 2 replicas, ZeRO-2, vs 2-rank all-reduce"
    );

    for zero in [1, 3] {
        let name = format!("piped-{zero}-resumed");
        let piped = format!(
            "strategy: pipeline\nsplit_points: [3]\nmicro_batches: 1\ndata_parallel: 2\nzero: {zero}\ncheckpoint_every: 2\n"
        );
        let (mut c, out) = launched(&name, &piped, &[]);
        c.env("FLOTILLA_FAULT", "rank=1,step=3,action=exit");
        let o = run_with_deadline(c, LIMIT);
        assert!(
            !o.status.success(),
            "the fault must stop the job\n{}",
            text(&o)
        );
        let (c, _) = launched(&name, &piped, &["--resume"]);
        let o = run_with_deadline(c, LIMIT);
        assert!(o.status.success(), "{}", text(&o));
        assert!(
            run_log(&out, 0).contains("(step 2)"),
            "{}",
            run_log(&out, 0)
        );
        assert_eq!(final_fields(&o)["steps"], 4.0);
        // Stage 1's Adam moments (9,033,010 parameters, 8 bytes each), half on each replica.
        let summary: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.join("summary.json")).expect("summary"))
                .expect("json");
        let held: Vec<f64> = [1, 3]
            .map(|r| {
                summary["ranks"][r]["figures"]["optimizer_state_bytes"]
                    .as_f64()
                    .expect("bytes")
            })
            .to_vec();
        assert_eq!(held.iter().sum::<f64>(), 8.0 * 9_033_010.0, "{held:?}");
        assert!(
            held.iter().all(|&b| b <= 0.51 * 8.0 * 9_033_010.0),
            "{held:?}"
        );
        assert_eq!(
            relative_error(&checkpoint_tensors(&out), &dp),
            0.0,
            "2 stages × 2 replicas, ZeRO-{zero}, resumed at step 2, vs 2-rank all-reduce"
        );
    }
}

#[test]
fn a_dead_stage_is_named_by_every_other_stage_within_the_deadline() {
    let dir = tmp();
    let cfg = config_file(
        dir.path(),
        "pipe.yaml",
        &format!("{COMMON}strategy: pipeline\nstages: 3\ntimeout_s: 5\n")
            .replace("max_steps: 50", "max_steps: 200"),
    );
    let out = dir.path().join("dead-stage-job");
    let ranks = train_by_hand_watched(
        &cfg,
        3,
        &out,
        "rank=1,step=5,action=exit",
        Duration::from_secs(120),
    );
    assert_eq!(ranks[1].status.code(), Some(3), "{}", ranks[1].text());
    // Every wait has `timeout_s` (5 s); a lost connection is noticed at once.
    assert_survivors_name(&ranks, 1, Duration::from_secs(5 + 4), |_| {
        "connection to rank 1 lost".to_string()
    });
    assert_none_left(out.to_str().expect("utf8"), Duration::from_secs(5));
}

#[test]
fn a_cut_that_does_not_fit_is_refused_before_any_rank_starts() {
    let dir = tmp();
    let cfg = config_file(
        dir.path(),
        "small.yaml",
        &format!(
            "{COMMON}strategy: pipeline\nstages: 2\npipeline: {{hosts: [{{memory_mb: 0.2}}, {{memory_mb: 0.2}}]}}\n"
        ),
    );
    let out = dir.path().join("refused");
    let mut c = flotilla();
    c.args(["launch", &cfg, "--output", out.to_str().expect("utf8")]);
    let o = run_with_deadline(c, Duration::from_secs(60));
    assert!(!o.status.success(), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("does not fit") && err.contains("MiB"),
        "the refusal gives the numbers:\n{}",
        text(&o)
    );
    assert!(
        !out.join("rank-0").exists(),
        "no rank may start:\n{}",
        text(&o)
    );
    // An explicit cut is checked too, naming the stage.
    let cfg = config_file(
        dir.path(),
        "small-explicit.yaml",
        &format!(
            "{COMMON}strategy: pipeline\nsplit_points: [8]\npipeline: {{hosts: [{{memory_mb: 0.2}}, {{memory_mb: 64}}]}}\n"
        ),
    );
    let mut c = flotilla();
    c.args(["config", &cfg]);
    let o = run_with_deadline(c, Duration::from_secs(60));
    assert!(!o.status.success(), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("stage 0 (layers 0..8) does not fit"),
        "{}",
        text(&o)
    );
    // A cut that fits is printed by `flotilla config`.
    let cfg = config_file(
        dir.path(),
        "fits.yaml",
        &format!("{COMMON}strategy: pipeline\nsplit_points: [8]\n"),
    );
    let mut c = flotilla();
    c.args(["config", &cfg]);
    let o = run_with_deadline(c, Duration::from_secs(60));
    assert!(o.status.success(), "{}", text(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        stdout.contains("# 0      0-7") && stdout.contains("# 1      8-23"),
        "{stdout}"
    );
}

#[test]
fn the_timeline_has_each_micro_batch_and_the_summary_each_stages_peak() {
    let dir = tmp();
    let cfg = config_file(
        dir.path(),
        "timeline.yaml",
        &format!(
            "{COMMON}strategy: pipeline\nsplit_points: [8]\nmicro_batches: 4\nschedule: 1f1b\n"
        )
        .replace("max_steps: 50", "max_steps: 10"),
    );
    let out = dir.path().join("timeline-job");
    let (_, events) = launch_traced(&cfg, &out, LIMIT);
    for pid in [0u64, 1] {
        let spans: Vec<&serde_json::Value> = events
            .iter()
            .filter(|e| e["ph"] == "X" && e["pid"] == pid)
            .collect();
        for name in ["forward", "backward"] {
            for mb in 0..4u64 {
                assert!(
                    spans
                        .iter()
                        .any(|e| e["name"] == name && e["args"]["mb"].as_u64() == Some(mb)),
                    "rank {pid} has no `{name}` span of micro-batch {mb}"
                );
            }
        }
        for name in ["send", "recv", "step", "eval"] {
            assert!(
                spans.iter().any(|e| e["name"] == name),
                "rank {pid} has no `{name}` span"
            );
        }
        assert_eq!(process_name(&events, pid), format!("rank {pid} (stage)"));
    }
    // 1F1B on 2 stages: at most 2 micro-batches of activations alive on stage 0, 1 on stage 1.
    let summary: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("summary.json")).expect("summary.json"))
            .expect("summary");
    let peaks: Vec<f64> = (0..2)
        .map(|r| {
            summary["ranks"][r]["figures"]["peak_in_flight"]
                .as_f64()
                .expect("peak")
        })
        .collect();
    assert_eq!(peaks, vec![2.0, 1.0]);
    for r in 0..2 {
        let idle = summary["ranks"][r]["figures"]["idle_fraction"]
            .as_f64()
            .expect("idle");
        assert!((0.0..1.0).contains(&idle), "rank {r} idle fraction {idle}");
    }
}
