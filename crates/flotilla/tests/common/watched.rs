//! Ranks started by hand (as mpirun or Slurm would, so that no launcher stops the others
//! before they report what they saw) and watched: every line with the instant it arrived,
//! and the instant each rank exited. A test then bounds how long after a fault each
//! survivor took to fail, instead of timing the whole job.
#![allow(dead_code)]

use std::path::Path;
use std::process::ExitStatus;
use std::time::{Duration, Instant};

use crate::common::{flotilla_rank, free_port};
use crate::running::{Line, Running};

/// What one rank did.
pub struct Watched {
    /// Its exit status.
    pub status: ExitStatus,
    /// When the test saw it exit (polled every 10 ms).
    pub exited: Instant,
    /// Every line of its stdout and stderr.
    pub lines: Vec<Line>,
}

impl Watched {
    /// All its output, one string.
    pub fn text(&self) -> String {
        let lines: Vec<&str> = self.lines.iter().map(|l| l.text.as_str()).collect();
        lines.join("\n")
    }
}

/// Starts `n` ranks of `flotilla train CONFIG` by hand with `FLOTILLA_FAULT=fault`, writing to
/// `out`, and waits for every rank, each within `limit` (past it the rank is killed and the
/// test fails).
pub fn train_by_hand_watched(
    cfg: &str,
    n: usize,
    out: &Path,
    fault: &str,
    limit: Duration,
) -> Vec<Watched> {
    let port = free_port();
    let threads: Vec<_> = (0..n)
        .map(|rank| {
            let mut c = flotilla_rank();
            c.args(["train", cfg, "--rank", &rank.to_string()])
                .args(["--master-port", &port, "--output"])
                .arg(out)
                .env("FLOTILLA_FAULT", fault);
            std::thread::spawn(move || {
                let mut p = Running::start(c);
                let status = p.wait_exit(limit);
                let exited = Instant::now();
                let status = status.unwrap_or_else(|| {
                    panic!("rank {rank} still ran after {limit:?}:\n{}", p.text())
                });
                Watched {
                    status,
                    exited,
                    lines: p.lines(),
                }
            })
        })
        .collect();
    threads
        .into_iter()
        .map(|t| t.join().expect("a rank's watcher panicked"))
        .collect()
}

/// When rank `faulty` announced its injected fault (`FLOTILLA_FAULT: ...` on stderr).
pub fn fault_instant(ranks: &[Watched], faulty: usize) -> Instant {
    ranks[faulty]
        .lines
        .iter()
        .find(|l| l.text.starts_with("FLOTILLA_FAULT: "))
        .map(|l| l.at)
        .unwrap_or_else(|| {
            panic!(
                "rank {faulty} never announced its fault:\n{}",
                ranks[faulty].text()
            )
        })
}

/// Asserts that every rank but `faulty` failed within `bound` of the fault and that its output
/// contains `phrase(rank)`, the whole phrase that names the faulty rank.
pub fn assert_survivors_name(
    ranks: &[Watched],
    faulty: usize,
    bound: Duration,
    phrase: impl Fn(usize) -> String,
) {
    let t0 = fault_instant(ranks, faulty);
    for (rank, w) in ranks.iter().enumerate().filter(|(r, _)| *r != faulty) {
        assert!(!w.status.success(), "rank {rank} must fail:\n{}", w.text());
        let took = w.exited.saturating_duration_since(t0);
        assert!(
            took <= bound,
            "rank {rank} failed {took:?} after the fault, later than {bound:?}:\n{}",
            w.text()
        );
        let want = phrase(rank);
        assert!(
            w.text().contains(&want),
            "rank {rank} must say {want:?}:\n{}",
            w.text()
        );
    }
}

/// Runs `cmd` (a `flotilla launch`) to its exit, within `limit`; the process with its lines.
pub fn run_watched(cmd: std::process::Command, limit: Duration) -> (ExitStatus, Running) {
    let mut job = Running::start(cmd);
    let status = job
        .wait_exit(limit)
        .unwrap_or_else(|| panic!("still running after {limit:?}:\n{}", job.text()));
    (status, job)
}

/// The time from the first line containing `from` to the first containing `to`; asserts both
/// exist and that it is at most `bound`.
pub fn assert_within(job: &Running, from: &str, to: &str, bound: Duration) {
    let at = |what: &str| {
        job.find(|l| l.contains(what))
            .unwrap_or_else(|| panic!("no line with {what:?}:\n{}", job.text()))
            .at
    };
    let took = at(to).saturating_duration_since(at(from));
    assert!(
        took <= bound,
        "{to:?} came {took:?} after {from:?}, later than {bound:?}:\n{}",
        job.text()
    );
}
