//! The MPI backend end to end: the release binary under `mpirun --oversubscribe`, on the
//! vendored MNIST, against the TCP backend with the same config. Needs the `mpi` feature
//! (`cargo test --release -p flotilla --features mpi --test mpi`) and Open MPI's `mpirun`.
//!
//! - sync all-reduce on 2 ranks ends with the TCP run's parameters, bit for bit;
//! - a flat parameter server (1 root, 3 workers) and a 2-stage pipeline end exactly like
//!   their TCP runs (the root's / last stage's test accuracy and loss);
//! - async all-reduce on 4 ranks trains past 80% (staleness 1), and with staleness 0 equals
//!   sync all-reduce bit for bit through its background cycle on its own MPI communicator.
//!
//! Without the feature, `backend: mpi` is refused with the rebuild hint and the `mpirun`
//! tests are reported skipped.

mod common;

/// LeNet-5 on `limit` samples for `epochs`, SGD at `lr` (constant after 8 warm-up steps).
fn small(limit: usize, epochs: u32, lr: f64) -> String {
    format!(
        "model: lenet5\ndata: data/mnist\ntrain_limit: {limit}\nepochs: {epochs}\nbatch_size: 64\nwarmup_steps: 8\nlr_schedule: constant\noptimizer: {{name: sgd, lr: {lr}, momentum: 0.9}}\nseed: 7\n"
    )
}

#[cfg(feature = "mpi")]
mod with_mpi {
    use std::path::Path;
    use std::process::{Command, Output};
    use std::time::Duration;

    use super::common::*;
    use super::small;

    const LIMIT: Duration = Duration::from_secs(300);

    /// `final test_acc=...` of the rank that evaluates, as (accuracy, loss).
    fn final_acc(o: &Output) -> (f64, f64) {
        let stdout = String::from_utf8_lossy(&o.stdout);
        let line = stdout
            .lines()
            .find(|l| l.starts_with("final test_acc="))
            .unwrap_or_else(|| panic!("no final test_acc line\n{}", text(o)));
        let field = |k: &str| -> f64 {
            line.split_whitespace()
                .find_map(|kv| kv.strip_prefix(k))
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("no {k} in {line}"))
        };
        (field("test_acc="), field("loss="))
    }

    /// `flotilla train cfg --backend mpi` as `np` ranks of `mpirun`.
    fn mpirun(np: usize, cfg: &str, out: &Path) -> Output {
        // Open MPI's session directory is named by host and user only: concurrent jobs
        // raced to create the same one under /tmp. One each.
        let session = tmp();
        let mut c = Command::new("mpirun");
        c.current_dir(repo())
            .args(["--oversubscribe", "-np", &np.to_string(), BIN, "train", cfg])
            .args(["--backend", "mpi", "--output"])
            .arg(out)
            .env("RAYON_NUM_THREADS", "1")
            // Lets mpirun start as root (CI containers); no effect for other users.
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            .env("TMPDIR", session.path())
            .env_remove("RANK")
            .env_remove("WORLD_SIZE")
            .env_remove("MASTER_ADDR")
            .env_remove("MASTER_PORT")
            .env_remove("FLOTILLA_FAULT");
        let o = run_with_deadline(c, LIMIT);
        assert!(
            o.status.success(),
            "mpirun -np {np} {cfg} failed\n{}",
            text(&o)
        );
        o
    }

    /// The same config over TCP (`flotilla launch`).
    fn tcp(cfg: &str, out: &Path) -> Output {
        launch(&[cfg, "--output", out.to_str().expect("utf8")], LIMIT)
    }

    #[test]
    fn sync_allreduce_on_mpi_ends_with_the_tcp_parameters_bitwise() {
        let dir = tmp();
        let text_cfg = format!("{}world_size: 2\n", small(4096, 1, 0.05));
        let cfg = config_file(dir.path(), "sync.yaml", &text_cfg);
        let (a, b) = (dir.path().join("tcp"), dir.path().join("mpi"));
        let on_tcp = tcp(&cfg, &a);
        let on_mpi = mpirun(2, &cfg, &b);
        assert_bitwise(
            "mpi vs tcp",
            &checkpoint_tensors(&b),
            &checkpoint_tensors(&a),
        );
        assert_eq!(final_acc(&on_mpi), final_acc(&on_tcp));
        assert!(final_acc(&on_mpi).0 > 0.5, "{}", text(&on_mpi));
        assert!(run_log(&b, 1).contains("strategy sync-allreduce"));
    }

    #[test]
    fn a_flat_parameter_server_on_mpi_ends_like_on_tcp() {
        let dir = tmp();
        let text_cfg = "arch: flat\nparameter_server: {aggr_type: sync, num_workers: 3}\nmodel: lenet5\ndata: data/mnist\nbatch_size: 32\nnum_server_rounds: 100\neval_every: 100\nwarmup_steps: 0\noptimizer: {name: sgd, lr: 0.05, momentum: 0.9}\nseed: 7\n";
        let cfg = config_file(dir.path(), "ps.yaml", text_cfg);
        let (a, b) = (dir.path().join("tcp"), dir.path().join("mpi"));
        let on_tcp = tcp(&cfg, &a);
        let on_mpi = mpirun(4, &cfg, &b);
        let (acc, loss) = final_acc(&on_mpi);
        assert_eq!((acc, loss), final_acc(&on_tcp), "{}", text(&on_mpi));
        assert!(acc > 0.8, "{}", text(&on_mpi));
        let workers = String::from_utf8_lossy(&on_mpi.stdout)
            .lines()
            .filter(|l| l.starts_with("final role=worker") && l.contains("rounds=100"))
            .count();
        assert_eq!(workers, 3, "{}", text(&on_mpi));
    }

    #[test]
    fn a_pipeline_on_mpi_ends_like_on_tcp() {
        let dir = tmp();
        let text_cfg = format!(
            "{}strategy: pipeline\nstages: 2\nmicro_batches: 4\nschedule: 1f1b\n",
            small(4096, 1, 0.05)
        );
        let cfg = config_file(dir.path(), "pipe.yaml", &text_cfg);
        let (a, b) = (dir.path().join("tcp"), dir.path().join("mpi"));
        let on_tcp = tcp(&cfg, &a);
        let on_mpi = mpirun(2, &cfg, &b);
        let (acc, loss) = final_acc(&on_mpi);
        assert_eq!((acc, loss), final_acc(&on_tcp), "{}", text(&on_mpi));
        assert!(acc > 0.5, "{}", text(&on_mpi));
        assert!(run_log(&b, 0).contains("strategy pipeline"));
    }

    #[test]
    fn async_allreduce_trains_on_4_mpi_ranks_and_staleness_zero_equals_sync() {
        let dir = tmp();
        let four = format!(
            "{}world_size: 4\nstrategy: async_allreduce\n",
            small(16384, 2, 0.03)
        );
        let cfg = config_file(dir.path(), "async.yaml", &four);
        let out = dir.path().join("async");
        let (acc, _) = final_acc(&mpirun(4, &cfg, &out));
        assert!(acc > 0.8, "async all-reduce on MPI reached {acc}");
        assert!(run_log(&out, 3).contains("strategy async-allreduce"));
        // Staleness 0: each step applies its own gradient, through the cycle.
        let base = format!("{}world_size: 2\n", small(2048, 1, 0.05));
        let zero = format!("{base}strategy: async_allreduce\nstaleness: 0\n");
        let zero = config_file(dir.path(), "zero.yaml", &zero);
        let sync = config_file(dir.path(), "sync.yaml", &base);
        let (z, s) = (dir.path().join("zero"), dir.path().join("sync"));
        mpirun(2, &zero, &z);
        mpirun(2, &sync, &s);
        let (z, s) = (checkpoint_tensors(&z), checkpoint_tensors(&s));
        assert_bitwise("async staleness 0 vs sync, on MPI", &z, &s);
    }
}

/// Without the feature: the binary refuses `backend: mpi` with the rebuild hint.
#[cfg(not(feature = "mpi"))]
#[test]
fn without_the_feature_backend_mpi_is_refused_and_the_mpirun_tests_are_skipped() {
    use common::*;
    eprintln!(
        "skipped: built without feature mpi (the mpirun tests run with `cargo test --release -p flotilla --features mpi --test mpi`)"
    );
    let dir = tmp();
    let text_cfg = format!("{}backend: mpi\n", small(2048, 1, 0.05));
    let cfg = config_file(dir.path(), "mpi.yaml", &text_cfg);
    let mut c = flotilla();
    c.args(["train", &cfg, "--rank", "0"]);
    let o = run_with_deadline(c, std::time::Duration::from_secs(60));
    assert!(!o.status.success(), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("built without the `mpi` feature") && err.contains("--features mpi"),
        "{}",
        text(&o)
    );
}
