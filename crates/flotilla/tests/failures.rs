//! Failures: a dead, stuck or diverged rank is named, and nothing is left running.

mod common;
#[path = "common/running.rs"]
mod running;
#[path = "common/watched.rs"]
mod watched;

use common::*;
use watched::{assert_survivors_name, assert_within, run_watched, train_by_hand_watched};

/// Slack on top of `timeout_s` for a rank to notice, report and exit on a loaded 2-core machine
/// (the launcher adds its 1.5 s grace period for the other ranks' reports).
const SLACK: Duration = Duration::from_secs(4);

use std::time::Duration;

#[test]
fn a_dead_rank_stops_the_job_is_named_and_leaves_no_process() {
    let dir = tmp();
    let out = dir.path().join("dead-rank-job");
    let mut c = flotilla();
    c.args([
        "launch",
        "-n",
        "3",
        "--batch-size",
        "16",
        "--max-steps",
        "200",
    ])
    .args(["--output", out.to_str().expect("utf8")])
    .env("FLOTILLA_FAULT", "rank=2,step=5,action=exit");
    let (status, job) = run_watched(c, Duration::from_secs(120));
    assert!(!status.success(), "{}", job.text());
    // A lost connection is seen at once; the launcher then waits its grace period (1.5 s)
    // for the other ranks' reports.
    assert_within(
        &job,
        "FLOTILLA_FAULT: rank exits after step 5",
        "rank 2 failed (exit code 3)",
        SLACK,
    );
    assert_none_left(out.to_str().expect("utf8"), Duration::from_secs(5));
}

#[test]
fn a_stuck_rank_is_named_by_the_others_and_leaves_no_process() {
    let dir = tmp();
    let out = dir.path().join("stuck-rank-job");
    let mut c = flotilla();
    c.args([
        "launch",
        "-n",
        "2",
        "--batch-size",
        "16",
        "--max-steps",
        "200",
    ])
    .args(["--timeout-s", "3", "--output", out.to_str().expect("utf8")])
    .env("FLOTILLA_FAULT", "rank=1,step=5,action=hang");
    let (status, job) = run_watched(c, Duration::from_secs(120));
    assert!(!status.success(), "{}", job.text());
    assert_within(
        &job,
        "FLOTILLA_FAULT: rank stops responding after step 5",
        "rank 1 stopped responding",
        Duration::from_secs(3) + SLACK,
    );
    assert!(
        job.text()
            .contains("timed out after 3s waiting for rank 1 during"),
        "rank 0's report must name rank 1 with its deadline:\n{}",
        job.text()
    );
    // The stuck rank sleeps for an hour unless the launcher kills it.
    assert_none_left(out.to_str().expect("utf8"), Duration::from_secs(5));
}

#[test]
fn workers_name_a_dead_parameter_server_root_within_the_deadline() {
    let dir = tmp();
    let cfg = config_file(
        dir.path(),
        "ps.yaml",
        "arch: flat\nparameter_server: {aggr_type: sync, num_workers: 2}\nnum_server_rounds: 200\ntimeout_s: 5\n",
    );
    let out = dir.path().join("dead-root-job");
    let ranks = train_by_hand_watched(
        &cfg,
        3,
        &out,
        "rank=0,step=10,action=exit",
        Duration::from_secs(90),
    );
    assert_eq!(ranks[0].status.code(), Some(3), "{}", ranks[0].text());
    assert_survivors_name(&ranks, 0, Duration::from_secs(5) + SLACK, |_| {
        "connection to rank 0 lost".to_string()
    });
    assert_none_left(out.to_str().expect("utf8"), Duration::from_secs(5));
}

#[test]
fn a_parameter_changed_on_one_rank_is_named_by_the_end_of_run_check() {
    let dir = tmp();
    let out = dir.path().join("perturbed-job");
    let mut c = flotilla();
    c.args([
        "launch",
        "-n",
        "3",
        "--batch-size",
        "16",
        "--max-steps",
        "20",
    ])
    .args(["--output", out.to_str().expect("utf8")])
    .env("FLOTILLA_FAULT", "rank=1,step=10,action=perturb");
    let o = run_with_deadline(c, Duration::from_secs(120));
    assert!(
        !o.status.success(),
        "diverged ranks must fail the job\n{}",
        text(&o)
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("rank 1 has") && !err.contains("rank 2 has"),
        "the check must name rank 1, and only rank 1:\n{}",
        text(&o)
    );
    assert_none_left(out.to_str().expect("utf8"), Duration::from_secs(5));
}
