//! `flotilla launch --max-restarts`: a rank killed mid-run (twice) is survived by restarting
//! the job from its newest checkpoint, each start running on from exactly that step, and
//! the run ends exactly where an uninterrupted one does (sync all-reduce resumes bitwise).

mod common;
#[path = "common/starts.rs"]
mod starts;

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::*;
use starts::{assert_ran, numbers_after, steps_per_start, summary};

const STEPS: &str = "300";

fn args(out: &Path) -> Vec<String> {
    [
        "launch",
        "--max-steps",
        STEPS,
        "--checkpoint-every",
        "50",
        "--train-limit",
        "20000",
        "--output",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([out.display().to_string()])
    .collect()
}

/// Waits for checkpoint `step` of `out`, then SIGKILLs one rank of the job.
fn kill_a_rank_after(out: &Path, step: u64) {
    let ck = out.join(format!("checkpoints/step-{step:08}"));
    let needle = out.join("launch-config.yaml");
    let needle = needle.to_str().expect("utf8");
    let started = Instant::now();
    loop {
        let ranks = processes_mentioning(needle);
        if ck.is_dir() && !ranks.is_empty() {
            let (pid, _) = ranks[ranks.len() - 1];
            signal(pid, "-9");
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "{} never appeared",
            ck.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_rank_killed_twice_is_survived_and_the_run_ends_as_an_uninterrupted_one() {
    let dir = tmp();
    let (elastic, plain) = (dir.path().join("elastic"), dir.path().join("plain"));
    let mut c = flotilla();
    let trace = dir.path().join("elastic.trace.json");
    c.args(args(&elastic))
        .args(["--max-restarts", "2", "--timeline"]);
    c.arg(&trace);
    c.stdout(Stdio::piped()).stderr(Stdio::piped());
    let out_dir = elastic.clone();
    let killer = std::thread::spawn(move || {
        kill_a_rank_after(&out_dir, 50);
        kill_a_rank_after(&out_dir, 150);
    });
    let o = run_with_deadline(c, Duration::from_secs(300));
    killer.join().expect("killer");
    assert!(o.status.success(), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    for k in [1, 2] {
        assert!(
            err.contains(&format!("[launcher] restart {k}/2 after: rank")),
            "{}",
            text(&o)
        );
    }
    assert_each_start_ran_on_from_its_checkpoint(&elastic);

    let mut c = flotilla();
    c.args(args(&plain));
    let p = run_with_deadline(c, Duration::from_secs(300));
    assert!(p.status.success(), "{}", text(&p));
    let (a, b) = (final_fields(&o), final_fields(&p));
    assert_eq!(a["steps"], 300.0, "{}", text(&o));
    assert_eq!(a["test_acc"], b["test_acc"]);
    assert_eq!(a["loss"], b["loss"]);
    assert_bitwise(
        "elastic vs uninterrupted",
        &checkpoint_tensors(&elastic),
        &checkpoint_tensors(&plain),
    );
}

/// The steps of each of the three starts, from each rank's timeline: the first ran 1, 2, ...
/// until the kill; each restart resumed at the checkpoint rank 0 names (at or after the one
/// the kill waited for, and the newest the start before it could have completed) and ran
/// every step from the next one on exactly once, the last to step 300 (as its summary
/// counts too).
fn assert_each_start_ran_on_from_its_checkpoint(out: &Path) {
    let log = run_log(out, 0);
    let resumes: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("resuming from"))
        .collect();
    let resumed = numbers_after(&resumes.join("\n"), " (step ");
    assert_eq!(resumed.len(), 2, "two resumes\n{log}");
    let from = [0, resumed[0], resumed[1]];
    assert!(
        resumed[0] >= 50 && resumed[1] >= 150 && resumed.iter().all(|r| r % 50 == 0),
        "resumed at {resumed:?}\n{log}"
    );
    for rank in 0..2 {
        let starts = steps_per_start(out, rank);
        assert_eq!(starts.len(), 3, "rank {rank}: three starts");
        for (k, steps) in starts.iter().enumerate() {
            let what = format!("rank {rank}, start {}", k + 1);
            let last = if k == 2 {
                300
            } else {
                *steps.last().expect("steps")
            };
            assert_ran(&what, steps, from[k] + 1, last);
            if k < 2 {
                // It reached the checkpoint the next start resumed from, and that was its
                // newest (the kill came after one more at most, or while it was saved).
                // Rank 0 wrote it after its step; rank 1 may have been killed while still
                // applying that step's reduced gradient.
                let next = from[k + 1];
                let behind = u64::from(rank != 0);
                assert!(
                    next <= last + behind && last <= next + 51,
                    "{what}: ran to {last}, the next start resumed at {next}"
                );
            }
        }
    }
    let run = &summary(out)["run"];
    assert_eq!(
        (run["resumed_at"].as_u64(), run["steps_run"].as_u64()),
        (Some(resumed[1]), Some(300 - resumed[1])),
        "{run}"
    );
}

/// Without --max-restarts a killed rank still ends the job, named.
#[test]
fn without_restarts_a_killed_rank_ends_the_job() {
    let dir = tmp();
    let out = dir.path().join("once");
    let mut c = flotilla();
    c.args(args(&out));
    let out_dir = out.clone();
    let killer = std::thread::spawn(move || kill_a_rank_after(&out_dir, 50));
    let o = run_with_deadline(c, Duration::from_secs(300));
    killer.join().expect("killer");
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("killed by signal 9"),
        "{}",
        text(&o)
    );
}
