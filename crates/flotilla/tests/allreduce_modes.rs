//! Asynchronous all-reduce and backward/communication overlap, end to end: real `flotilla`
//! processes over 127.0.0.1 on the vendored MNIST.
//!
//! - async (staleness 1, weight prediction) trains LeNet-5 to >= 98.5% on 2 and on 4 ranks;
//! - `staleness: 0` through the background cycle equals sync all-reduce bitwise;
//! - sync with backward overlapped equals sync without, bitwise, on 4 ranks and 5 buckets;
//!   the timelines show every step's 5 bucket all-reduces, and those of the overlapped run
//!   (not of the other) starting while backward still runs;
//! - a rank that stops submitting one tensor (async), or stops entering collectives (sync),
//!   is named by the stall inspector on every rank, and the job aborts within
//!   `stall_shutdown_s`.

mod common;
#[path = "common/running.rs"]
mod running;
#[path = "common/watched.rs"]
mod watched;

use common::*;
use watched::{assert_within, run_watched};

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

type Tensors = BTreeMap<String, Vec<f32>>;

const LIMIT: Duration = Duration::from_secs(300);

/// 50 steps past a 20-step warm-up.
const SCHEDULE: &str = "max_steps: 50\nwarmup_steps: 20\nlr_schedule: cosine\n";

fn run(dir: &Path, name: &str, yaml: &str) -> (Tensors, String) {
    let cfg = config_file(dir, &format!("{name}.yaml"), yaml);
    let out = dir.join(name);
    let o = launch(&[&cfg, "--output", out.to_str().expect("utf8")], LIMIT);
    assert_eq!(final_fields(&o)["steps"], 50.0, "{name}\n{}", text(&o));
    (checkpoint_tensors(&out), run_log(&out, 0))
}

/// [`run`] with the job's timeline recorded; its final tensors and its trace events.
fn run_traced(dir: &Path, name: &str, yaml: &str) -> (Tensors, Vec<serde_json::Value>) {
    let cfg = config_file(dir, &format!("{name}.yaml"), yaml);
    let out = dir.join(name);
    let (o, events) = launch_traced(&cfg, &out, LIMIT);
    assert_eq!(final_fields(&o)["steps"], 50.0, "{name}\n{}", text(&o));
    (checkpoint_tensors(&out), events)
}

/// Per training step of rank `pid`: the buckets whose all-reduce ran in the step (their
/// `bucket` numbers, in order of start) and how many of them started before the step's
/// backward ended (its last backward span: one per group when overlapped).
fn bucket_starts(events: &[serde_json::Value], pid: u64) -> Vec<(Vec<u64>, usize)> {
    let all = spans(events, pid);
    let within = |s: &Span<'_>, step: &Span<'_>| s.start >= step.start && s.start <= step.end;
    all.iter()
        .filter(|s| s.name == "step")
        .map(|step| {
            let backward_end = all
                .iter()
                .filter(|s| s.name == "backward" && within(s, step))
                .map(|s| s.end)
                .fold(f64::NEG_INFINITY, f64::max);
            let mut reduces: Vec<&Span<'_>> = all
                .iter()
                .filter(|s| s.name == "all_reduce" && within(s, step))
                .filter(|s| s.args.get("bucket").is_some())
                .collect();
            reduces.sort_by(|a, b| a.start.total_cmp(&b.start));
            let early = reduces.iter().filter(|s| s.start < backward_end).count();
            let buckets = reduces.iter().filter_map(|s| s.args["bucket"].as_u64());
            (buckets.collect(), early)
        })
        .collect()
}

#[test]
fn async_allreduce_trains_lenet5_past_98_5_percent_on_2_and_4_ranks() {
    let dir = tmp();
    // The example's optimizer and schedule; 4 ranks x 32 keep the global batch of 128. Two
    // epochs (98.84 % and 98.89 % on 2026-12-05; three until then, for CI's time).
    for (n, batch) in [(2, 64), (4, 32)] {
        let out = dir.path().join(format!("n{n}"));
        let o = launch(
            &[
                "examples/mnist-async-allreduce.yaml",
                "-n",
                &n.to_string(),
                "--batch-size",
                &batch.to_string(),
                "--epochs",
                "2",
                "--output",
                out.to_str().expect("utf8"),
            ],
            LIMIT,
        );
        let acc = final_fields(&o)["test_acc"];
        assert!(acc >= 0.985, "{n} ranks: test accuracy {acc}\n{}", text(&o));
        let log = run_log(&out, 0);
        assert!(
            log.contains("strategy async-allreduce") && log.contains("staleness 1"),
            "{log}"
        );
        assert!(
            log.contains("async all-reduce: staleness 1, 936 steps applied"),
            "{log}"
        );
    }
}

#[test]
fn staleness_zero_through_the_cycle_equals_sync_allreduce_bitwise() {
    let dir = tmp();
    let base = format!("{SCHEDULE}world_size: 2\nbatch_size: 32\n");
    let (sync, _) = run(dir.path(), "sync", &base);
    let (async0, log) = run(
        dir.path(),
        "async0",
        &format!("{base}strategy: async_allreduce\nstaleness: 0\n"),
    );
    assert!(log.contains("staleness 0"), "{log}");
    assert_bitwise("async staleness 0 vs sync", &async0, &sync);
    let (async1, _) = run(
        dir.path(),
        "async1",
        &format!("{base}strategy: async_allreduce\n"),
    );
    // Staleness 1 is another trajectory (so the equality above is not vacuous).
    assert!(relative_error(&async1, &sync) > 1e-4);
}

#[test]
fn overlapped_backward_equals_the_one_pass_backward_bitwise() {
    let dir = tmp();
    // 5 buckets, one per LeNet-5 layer with parameters; 4 ranks so that the ring's
    // segmentation (and so the order of additions) depends on the buckets.
    let base = format!("{SCHEDULE}world_size: 4\nbatch_size: 16\nbucket_mb: 0.001\n");
    let (over, over_events) = run_traced(dir.path(), "overlap", &format!("{base}overlap: true\n"));
    let (flat, flat_events) =
        run_traced(dir.path(), "one-pass", &format!("{base}overlap: false\n"));
    assert_bitwise("overlapped vs one-pass backward", &over, &flat);
    for pid in 0..4 {
        let (over, flat) = (
            bucket_starts(&over_events, pid),
            bucket_starts(&flat_events, pid),
        );
        assert_eq!((over.len(), flat.len()), (50, 50), "rank {pid}: steps");
        // Every step all-reduces each of the 5 buckets once, bucket 4 (the first layer's,
        // with the loss) last. Overlapped, the others go as backward produces them, the last
        // layer's (bucket 0) first; in one pass, as the gradients are read out afterwards,
        // in the order of the parameters (the first layer's first).
        for (name, steps, order) in [
            ("overlapped", &over, [0, 1, 2, 3, 4]),
            ("one pass", &flat, [3, 2, 1, 0, 4]),
        ] {
            for (step, (buckets, _)) in steps.iter().enumerate() {
                assert_eq!(buckets, &order, "rank {pid}, {name}, step {step}");
            }
        }
        // One pass: every bucket starts after backward has ended.
        let flat_early: Vec<usize> = flat.iter().map(|s| s.1).collect();
        assert_eq!(flat_early, vec![0; 50], "rank {pid}, one pass");
        // Overlapped: buckets 0-3 can start while backward runs on the earlier layers
        // (bucket 4 waits for the loss, known when backward ends). On 2 shared cores a
        // bucket's all-reduce may still start late in some steps; most steps overlap.
        let overlapped = over.iter().filter(|s| s.1 > 0).count();
        let early: usize = over.iter().map(|s| s.1).sum();
        assert!(
            over.iter().all(|s| s.1 <= 4) && overlapped >= 25,
            "rank {pid}: {overlapped} of 50 steps started a bucket before backward ended ({early} buckets): {:?}",
            over.iter().map(|s| s.1).collect::<Vec<_>>()
        );
    }
}

/// Launches 3 ranks of 200 steps with a 1 s stall warning and a 4 s stall abort, plus
/// `extra` config lines and test fault `fault`; asserts that the job failed, that the abort
/// ("stalled for 4") came within 4 s + slack of the fault's line `fault_line`, and that it
/// left no process; returns everything it printed.
fn stalled_job(extra: &str, fault: &str, fault_line: &str) -> String {
    let dir = tmp();
    let cfg = config_file(
        dir.path(),
        "stall.yaml",
        &format!(
            "world_size: 3\nbatch_size: 32\nmax_steps: 200\nstall_warning_s: 1\nstall_shutdown_s: 4\n{extra}"
        ),
    );
    let out = dir.path().join("out");
    let mut c = flotilla();
    c.args(["launch", &cfg, "--output", out.to_str().expect("utf8")])
        .env("FLOTILLA_FAULT", fault);
    let (status, job) = run_watched(c, LIMIT);
    assert!(!status.success(), "the job must fail\n{}", job.text());
    assert_within(
        &job,
        fault_line,
        "stalled for 4",
        Duration::from_secs(4 + 4),
    );
    assert_none_left(out.to_str().expect("utf8"), Duration::from_secs(10));
    job.text()
}

#[test]
fn a_withheld_tensor_is_named_by_the_stall_inspector_then_the_job_aborts() {
    let all = stalled_job(
        "strategy: async_allreduce\n",
        "rank=1,step=10,action=withhold",
        "withholding tensor \"layers.11.bias\" from step 10",
    );
    assert!(
        all.contains("withholding tensor \"layers.11.bias\" from step 10"),
        "{all}"
    );
    // Warned (at 1 s, 2 s, 3 s) before giving up at 4 s, naming the tensor and the rank.
    let warning = "WARN flotilla::stall: stall: tensor \"layers.11.bias\" submitted by rank(s) 0, 2 waits for rank(s) 1";
    assert!(all.contains(warning), "{all}");
    assert!(all.contains("stalled for 4"), "{all}");
}

#[test]
fn a_rank_that_stops_entering_collectives_is_named_then_sync_training_aborts() {
    // Rank 1 hangs after step 10 and never issues the next step's all-reduce, which ranks 0
    // and 2 wait in: named at 1 s, 2 s, 3 s, then every rank aborts at 4 s (long before the
    // 60 s collective deadline).
    let all = stalled_job(
        "",
        "rank=1,step=10,action=hang",
        "FLOTILLA_FAULT: rank stops responding after step 10",
    );
    assert!(
        all.contains("WARN flotilla::stall: stall: collective #")
            && all.contains("entered by rank(s) 0, 2 waits for rank(s) 1"),
        "{all}"
    );
    assert!(
        all.contains("aborted by rank") && all.contains("stalled for 4"),
        "{all}"
    );
}
