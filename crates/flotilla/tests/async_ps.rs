//! Async parameter servers train with their defaults, and a run that does not learn says so
//! (issue 10, item 3). Release only: these train.

mod common;

use std::time::Duration;

use common::{config_file, final_fields, flotilla, launch, run_log, run_with_deadline, text, tmp};

/// `examples/ps-flat-sync.yaml`'s optimizer with 4 async workers: before the
/// staleness-scaled learning rate it ended at chance (0.1135 after these 400 rounds).
#[test]
fn flat_async_with_the_sync_examples_optimizer_learns() {
    let dir = tmp();
    let cfg = config_file(
        dir.path(),
        "flat-async.yaml",
        "arch: flat\nparameter_server: {aggr_type: async, num_workers: 4}\nbatch_size: 32\nnum_server_rounds: 400\neval_every: 0\ntrain_limit: 10000\noptimizer: {name: sgd, lr: 0.04, momentum: 0.9, weight_decay: 0.0005}\n",
    );
    let out = dir.path().join("run");
    let o = launch(
        &[&cfg, "--output", out.to_str().expect("utf8")],
        Duration::from_secs(300),
    );
    let f = final_fields(&o);
    assert!(
        f["test_acc"] > 0.9,
        "accuracy {}\n{}",
        f["test_acc"],
        text(&o)
    );
    assert!(
        run_log(&out, 0).contains("async server: learning rate scaled by 1/(1+staleness)"),
        "the adjustment is logged at start"
    );
}

/// lr 10: by default a run that is not learning is warned about and a NaN or infinite loss
/// stops it (which comes first depends on the async timing: either is said, naming the
/// learning rate), and with `abort_on_divergence` the launch fails saying what to change.
#[test]
fn a_diverging_lr_is_reported_and_aborts_when_asked() {
    let dir = tmp();
    let base = "arch: flat\nparameter_server: {aggr_type: async, num_workers: 4}\nbatch_size: 32\nnum_server_rounds: 150\neval_every: 0\ntrain_limit: 10000\ndivergence_check_rounds: 100\noptimizer: {name: sgd, lr: 10, momentum: 0.9}\n";
    let warn = config_file(dir.path(), "warn.yaml", base);
    let out = dir.path().join("warn");
    let mut cmd = flotilla();
    cmd.args(["launch", &warn, "--output", out.to_str().expect("utf8")]);
    let o = run_with_deadline(cmd, Duration::from_secs(300));
    let all = text(&o);
    if o.status.success() {
        let log = run_log(&out, 0);
        assert!(
            log.contains("warning: training is not learning")
                && log.contains("optimizer.lr, now 10"),
            "{log}"
        );
    } else {
        assert!(
            all.contains("training diverged: loss is")
                && all.contains("lower the learning rate (optimizer.lr, now 10)"),
            "{all}"
        );
    }
    let abort = config_file(
        dir.path(),
        "abort.yaml",
        &format!("{base}abort_on_divergence: true\n"),
    );
    let out = dir.path().join("abort");
    let mut cmd = flotilla();
    cmd.args(["launch", &abort, "--output", out.to_str().expect("utf8")]);
    let o = run_with_deadline(cmd, Duration::from_secs(300));
    let all = text(&o);
    assert!(!o.status.success(), "{all}");
    // The root's "not learning" (or a worker's NaN, if one comes first), whichever rank the
    // launcher names first.
    assert!(
        (all.contains("training is not learning") || all.contains("training diverged"))
            && all.contains("lower the learning rate (optimizer.lr, now 10)")
            && all.contains("topology.async_momentum"),
        "{all}"
    );
}
