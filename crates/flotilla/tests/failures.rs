//! Failures: a dead, stuck or diverged rank is named, and nothing is left running.

mod common;

use common::*;

use std::time::{Duration, Instant};

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
    let o = run_with_deadline(c, Duration::from_secs(120));
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("rank 2 failed"),
        "the launcher must name rank 2:\n{}",
        text(&o)
    );
    assert!(err.contains("exit code 3"), "{}", text(&o));
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
    let started = Instant::now();
    let o = run_with_deadline(c, Duration::from_secs(120));
    assert!(!o.status.success());
    assert!(started.elapsed() < Duration::from_secs(60));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("rank 1 stopped responding"),
        "the launcher must name rank 1:\n{}",
        text(&o)
    );
    assert!(
        err.contains("timed out") && err.contains("rank 1"),
        "rank 0's report must name rank 1:\n{}",
        text(&o)
    );
    // The stuck rank sleeps for an hour unless the launcher kills it.
    assert_none_left(out.to_str().expect("utf8"), Duration::from_secs(5));
}

#[test]
fn workers_name_a_dead_parameter_server_root() {
    // Ranks started by hand (as mpirun or Slurm would), so that no launcher stops the
    // workers before they report what they saw.
    let dir = tmp();
    let cfg = config_file(
        dir.path(),
        "ps.yaml",
        "arch: flat\nparameter_server: {aggr_type: sync, num_workers: 2}\nnum_server_rounds: 200\ntimeout_s: 5\n",
    );
    let out = dir.path().join("dead-root-job");
    let started = Instant::now();
    let outs = train_by_hand(
        &cfg,
        3,
        &out,
        "rank=0,step=10,action=exit",
        Duration::from_secs(90),
    );
    assert!(started.elapsed() < Duration::from_secs(60));
    assert_eq!(outs[0].status.code(), Some(3), "{}", text(&outs[0]));
    for (rank, o) in outs.iter().enumerate().skip(1) {
        assert!(!o.status.success(), "worker {rank} must fail\n{}", text(o));
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            err.contains("rank 0"),
            "worker {rank} must name the server, rank 0:\n{}",
            text(o)
        );
    }
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
