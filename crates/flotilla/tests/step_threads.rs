//! The thread a rank steps on is worker 0 of a rayon pool of its own (`flotilla-rank`'s
//! `Session::start`): the kernels' and burn's splits over rayon then run on that thread, not
//! handed to the global pool and waited for. Measured from the process: its voluntary
//! context switches per step, as the kernel counts them (`wait4`'s resource usage of the
//! rank's process alone).
#![cfg(unix)]

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// Training steps of the run below: 4096 samples at batch 64.
const STEPS: i64 = 64;

/// A 1-rank LeNet-5 epoch on one thread (`RAYON_NUM_THREADS=1`), as `flotilla train`.
#[test]
fn a_ranks_step_does_not_hand_its_work_to_another_thread() {
    let dir = tmp();
    let cfg = config_file(
        dir.path(),
        "lenet.yaml",
        "model: lenet5\ndata: data/mnist\ntrain_limit: 4096\nepochs: 1\nbatch_size: 64\n\
         optimizer: {name: sgd, lr: 0.01, momentum: 0.9}\nseed: 3\nworld_size: 1\n",
    );
    let mut cmd = Command::new(BIN);
    cmd.current_dir(repo())
        .args(["train", &cfg, "--output"])
        .arg(dir.path().join("out"))
        .env("RAYON_NUM_THREADS", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let (status, usage) = run_counting(cmd, Duration::from_secs(300));
    assert!(
        status == 0,
        "flotilla train exited with wait status {status}"
    );
    let per_step = usage.ru_nvcsw as f64 / STEPS as f64;
    // Each step's ~10 splits (convolutions, pooling, burn's reductions) handed to the global
    // pool cost two switches each: ~25 per step (evaluation included). In the thread's own
    // pool: ~4 (the prefetcher's batches, the evaluation, the start).
    assert!(
        per_step < 8.0,
        "{} voluntary context switches in {STEPS} steps: {per_step:.1} per step",
        usage.ru_nvcsw
    );
}

/// Runs `cmd` to its end (killed after `limit`): its wait status and its own resource usage.
#[expect(
    clippy::zombie_processes,
    reason = "the child is reaped by wait4, which the lint does not know"
)]
fn run_counting(mut cmd: Command, limit: Duration) -> (i32, libc::rusage) {
    let mut child = cmd.spawn().expect("spawn flotilla");
    let pid = child.id() as libc::pid_t;
    let started = Instant::now();
    loop {
        let mut status = 0;
        // SAFETY: all-zero bytes are a valid `rusage` (integers and timevals).
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: `status` and `usage` are valid for writes; `pid` is our unreaped child.
        let got = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut usage) };
        assert!(got >= 0, "wait4: {}", std::io::Error::last_os_error());
        if got == pid {
            return (status, usage);
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("flotilla train still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
