//! burn-train's own `Learner` on Flotilla (`flotilla_burn::LearnerStrategy`, through
//! `examples/mnist_learner.rs`, burn's guide MNIST model, started by `flotilla launch -n N --
//! PROGRAM`): it trains to the bits of the same model in the program's own loop, N ranks equal
//! one rank of the same global batch within rounding — parameters and the metrics rank 0
//! logs —, and the `Learner`'s resume from its epoch checkpoint ends on the bits of a run
//! without a stop; under ZeRO-1, async all-reduce, parameter servers and model averaging it
//! trains as the same model does in the program's own loop or under sync all-reduce. No
//! dropout (its masks differ by rank).

mod common;

use common::*;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

type Tensors = BTreeMap<String, Vec<f32>>;

const LIMIT: Duration = Duration::from_secs(300);

/// 1,600 training images (800 per rank at 2 ranks): 25 steps of a global batch of 64 per
/// epoch; validation on the first 1,000 test images.
const COMMON: &[(&str, &str)] = &[
    ("TRAIN_SAMPLES", "1600"),
    ("TEST_SAMPLES", "1000"),
    ("DROPOUT", "0"),
    ("LR", "0.002"),
];

/// `flotilla launch -n ranks -- mnist_learner` with `env` into `dir/name` (the `Learner`'s
/// artifacts there); rank 0's trained parameters.
fn train(dir: &Path, name: &str, ranks: usize, batch: usize, env: &[(&str, &str)]) -> Tensors {
    let batch = batch.to_string();
    launch(dir, name, ranks, &["--batch-size", &batch], env).0
}

/// [`train`] with `flags` for the launcher; also what the job printed.
fn launch(
    dir: &Path,
    name: &str,
    ranks: usize,
    flags: &[&str],
    env: &[(&str, &str)],
) -> (Tensors, String) {
    let out = dir.join(name);
    let save = dir.join(format!("{name}.safetensors"));
    let exe = example("mnist_learner");
    let mut c = flotilla();
    c.args(["launch", "-n", &ranks.to_string()])
        .args(flags)
        .arg("--")
        .arg(&exe)
        .env("DATA", repo().join("data/mnist"))
        .env("ARTIFACTS", &out)
        .env("SAVE", &save)
        .envs(COMMON.iter().copied())
        .envs(env.iter().copied());
    let o = run_with_deadline(c, LIMIT);
    assert!(o.status.success(), "{name} failed\n{}", text(&o));
    (safetensors_file(&save), text(&o))
}

/// The optimizer state sizes the own loop printed, by rank.
fn state_bytes(output: &str) -> BTreeMap<usize, usize> {
    output
        .lines()
        .filter_map(|l| l.split_once("] rank ").map(|(_, rest)| rest))
        .filter_map(|l| l.split_once(" optimizer state: "))
        .map(|(rank, bytes)| {
            let bytes = bytes.trim_end_matches(" bytes");
            (rank.parse().expect("a rank"), bytes.parse().expect("bytes"))
        })
        .collect()
}

/// The values of a metric's log (`ARTIFACTS/SPLIT/epoch-E/METRIC.log`: `value,items` per
/// line, the last line the epoch's `value,final`).
fn metric(dir: &Path, name: &str, split: &str, epoch: usize, metric: &str) -> Vec<(f64, String)> {
    let path: PathBuf = dir
        .join(name)
        .join(format!("{split}/epoch-{epoch}/{metric}.log"));
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    text.lines()
        .filter_map(|l| l.split_once(','))
        .map(|(v, n)| (v.parse().expect("a number"), n.to_string()))
        .collect()
}

#[test]
fn the_learner_trains_to_the_bits_of_the_programs_own_loop() {
    let dir = tmp();
    let env = [("EPOCHS", "2")];
    let learner = train(dir.path(), "learner", 2, 32, &env);
    let own = train(dir.path(), "own", 2, 32, &[env[0], ("LOOP", "own")]);
    let initial = train(dir.path(), "initial", 2, 32, &[("EPOCHS", "0")]);
    let moved = relative_error(&learner, &initial);
    assert!(moved > 1e-2, "the parameters barely moved ({moved})");
    assert_bitwise("the Learner vs the program's own loop", &learner, &own);
}

#[test]
fn two_ranks_are_one_rank_of_the_same_global_batch_parameters_and_metrics() {
    let dir = tmp();
    let one = train(dir.path(), "one", 1, 64, &[("EPOCHS", "1")]);
    let two = train(dir.path(), "two", 2, 32, &[("EPOCHS", "1")]);
    let initial = train(dir.path(), "initial", 1, 64, &[("EPOCHS", "0")]);
    let moved = relative_error(&one, &initial);
    let apart = relative_error(&two, &one);
    assert!(moved > 1e-2, "the parameters barely moved ({moved})");
    assert!(
        apart < 1e-4 * moved,
        "2 ranks of 32 end {apart} from 1 rank of 64 (they moved {moved})"
    );
    // What rank 0 logs is the global batch's: every step's loss and accuracy with its
    // sample count, as one rank logs them; and the epoch's validation loss and accuracy over
    // all 10,000 test images (the ranks evaluate 5,000 each).
    for (split, name, lines) in [
        ("train", "Loss", usize::MAX),
        ("train", "Accuracy", usize::MAX),
        ("valid", "Loss", 1),
        ("valid", "Accuracy", 1),
    ] {
        let last = |run: &str| {
            let m = metric(dir.path(), run, split, 1, name);
            m[m.len().saturating_sub(lines)..].to_vec()
        };
        let (a, b) = (last("one"), last("two"));
        assert_eq!(a.len(), b.len(), "{split} {name}: lines");
        for (i, ((va, na), (vb, nb))) in a.iter().zip(&b).enumerate() {
            assert_eq!(na, nb, "{split} {name} line {i}: items");
            assert!(
                (va - vb).abs() <= 1e-4 * va.abs().max(1.0),
                "{split} {name} line {i}: one rank logs {va}, two ranks {vb}"
            );
        }
    }
    let last = metric(dir.path(), "two", "valid", 1, "Accuracy");
    assert_eq!(last.last().map(|(_, n)| n.as_str()), Some("final"));
}

#[test]
fn the_learners_resume_from_its_epoch_checkpoint_ends_on_the_bits_of_an_unstopped_run() {
    let dir = tmp();
    let whole = train(dir.path(), "whole", 2, 32, &[("EPOCHS", "2")]);
    let _first = train(dir.path(), "stopped", 2, 32, &[("EPOCHS", "1")]);
    let resumed = train(
        dir.path(),
        "stopped",
        2,
        32,
        &[("EPOCHS", "2"), ("RESUME", "1")],
    );
    assert_bitwise("resumed at epoch 1 vs not stopped", &resumed, &whole);
}

#[test]
fn zero_1_keeps_one_copy_of_the_optimizer_state_and_trains_to_the_bits_of_sync() {
    let dir = tmp();
    let env = [("EPOCHS", "1"), ("BATCH", "32")];
    let own = |zero: &[&str], name: &str| {
        launch(
            dir.path(),
            name,
            2,
            zero,
            &[env[0], env[1], ("LOOP", "own")],
        )
    };
    let (sync, sync_out) = own(&[], "sync-own");
    let (zero, zero_out) = own(&["--zero", "1"], "zero-own");
    let (learner, _) = launch(dir.path(), "zero-learner", 2, &["--zero", "1"], &env);
    assert_bitwise("ZeRO-1 vs sync, the program's own loop", &zero, &sync);
    assert_bitwise(
        "ZeRO-1: the Learner vs the program's own loop",
        &learner,
        &zero,
    );
    // Adam's state of every parameter lives on one rank: the ranks' states add up to one
    // rank's whole state under sync (up to each record's own few bytes), each smaller.
    let (whole, parts) = (state_bytes(&sync_out), state_bytes(&zero_out));
    assert_eq!(whole.len(), 2, "{sync_out}");
    assert_eq!(parts.len(), 2, "{zero_out}");
    let one = whole[&0];
    let sum: usize = parts.values().sum();
    assert!(
        sum.abs_diff(one) < one / 100,
        "the ranks hold {parts:?} bytes of optimizer state, sync one rank {one}"
    );
    assert!(parts.values().all(|b| *b < one), "{parts:?} against {one}");
}

/// Async all-reduce (the one stack's, `--strategy async_allreduce`) drives the `Learner`: the
/// run draws the batches (sample indices) and the `Learner`'s model trains through its cycle.
/// With `staleness: 0` every step applies its own reduced gradient: the same bits as the
/// strategy's own sync loop (and so as the program's own loop); with the default staleness it
/// trains elsewhere and rank 0 logs the global batch's metrics, each epoch's steps in that
/// epoch's split.
#[test]
fn async_all_reduce_drives_the_learner_through_the_one_stacks_run() {
    let dir = tmp();
    let env = [("EPOCHS", "2")];
    let sync = train(dir.path(), "sync", 2, 32, &env);
    let flags = ["--batch-size", "32", "--strategy", "async_allreduce"];
    let fresh = [env[0], ("FLOTILLA_ALLREDUCE__STALENESS", "0")];
    let (stale0, _) = launch(dir.path(), "async-0", 2, &flags, &fresh);
    let (stale1, _) = launch(dir.path(), "async-1", 2, &flags, &env);
    let initial = train(dir.path(), "initial", 2, 32, &[("EPOCHS", "0")]);
    let moved = relative_error(&sync, &initial);
    assert!(moved > 1e-2, "the parameters barely moved ({moved})");
    assert_bitwise("async all-reduce at staleness 0 vs sync", &stale0, &sync);
    let stale = relative_error(&stale1, &sync);
    assert!(stale > 1e-3, "staleness 1 ends where sync does ({stale})");
    // Each epoch's 25 steps in its own split: the first ends after its last step, not
    // after the next epoch's first (the run's position rolls over when the epoch is done).
    for epoch in 1..=2 {
        let logged = metric(dir.path(), "async-1", "train", epoch, "Loss");
        assert_eq!(
            logged.len(),
            26,
            "epoch {epoch}: a line per step and the epoch's: {logged:?}"
        );
    }
}

/// Under a parameter server the `Learner`'s resume goes through the one stack's run: the
/// model and the server's optimizer from the `Learner`'s checkpoint, the run's batches and
/// its count of rounds from after the checkpoint's epoch. It ends on the bits of a run
/// without a stop.
#[test]
fn the_learners_resume_under_a_parameter_server_ends_on_the_bits_of_an_unstopped_run() {
    let dir = tmp();
    let flags = ["--batch-size", "32", "--strategy", "flat"];
    let (whole, _) = launch(dir.path(), "whole", 3, &flags, &[("EPOCHS", "2")]);
    let _first = launch(dir.path(), "stopped", 3, &flags, &[("EPOCHS", "1")]);
    let resumed = [("EPOCHS", "2"), ("RESUME", "1")];
    let (resumed, _) = launch(dir.path(), "stopped", 3, &flags, &resumed);
    assert_bitwise("resumed at epoch 1 vs not stopped", &resumed, &whole);
}

/// A job's config file for `flotilla launch FILE -- PROGRAM`.
fn config(dir: &Path, name: &str, yaml: &str) -> String {
    let path = dir.join(format!("{name}.yaml"));
    std::fs::write(&path, yaml).expect("writing the config");
    path.display().to_string()
}

/// Parameter-server workers drive the `Learner` (the one stack's servers, `--strategy flat`:
/// rank 0 the server, the other ranks workers; the server steps with its `Learner`'s Adam).
/// One sync server averaging 2 workers' gradients of 32 samples applies what sync all-reduce
/// over the same 2 shards applies: the same bits. Two shard servers end on the bits of one
/// (each starts from the root's initial parameters, although each rank of the program draws
/// its own). The root validates the whole model — the metrics of sync all-reduce — and the
/// first worker shows the training metrics of its own batches.
#[test]
fn parameter_server_workers_train_the_learner_to_the_bits_of_sync_all_reduce() {
    let dir = tmp();
    let env = [("EPOCHS", "1")];
    let sync = train(dir.path(), "sync", 2, 32, &env);
    let flags = ["--batch-size", "32", "--strategy", "flat"];
    let (ps, _) = launch(dir.path(), "ps", 3, &flags, &env);
    let sharded = config(
        dir.path(),
        "sharded",
        "arch: flat\nservers: 2\nbatch_size: 32\nparameter_server: {aggr_type: sync, num_workers: 2}\n",
    );
    let (shards, _) = launch(dir.path(), "shards", 4, &[&sharded], &env);
    let initial = train(dir.path(), "initial", 2, 32, &[("EPOCHS", "0")]);
    let moved = relative_error(&sync, &initial);
    assert!(moved > 1e-2, "the parameters barely moved ({moved})");
    assert_bitwise(
        "a flat sync parameter server vs sync all-reduce",
        &ps,
        &sync,
    );
    assert_bitwise("2 shard servers vs 1", &shards, &ps);
    // The same model over the same 10,000 images (sync all-reduce's ranks 5,000 each: the
    // loss summed in another order).
    for name in ["Loss", "Accuracy"] {
        let (a, b) = (
            metric(dir.path(), "ps", "valid", 1, name),
            metric(dir.path(), "sync", "valid", 1, name),
        );
        let (Some((a, _)), Some((b, _))) = (a.last(), b.last()) else {
            panic!("no validation {name}");
        };
        assert!(
            (a - b).abs() <= 1e-6 * b.abs(),
            "validation {name}: {a} vs {b}"
        );
    }
    // The first worker's 25 batches of 32 (800 of the 1,600 images) and the epoch's line.
    let logged = metric(dir.path(), "ps", "train", 1, "Loss");
    assert_eq!(logged.len(), 26, "{logged:?}");
}

/// Model averaging (`topology.local_steps: 2` under a flat sync server): each worker takes 2
/// steps of its own `Learner` (its Adam) from the server's parameters and pushes the change,
/// which the server averages. The program's own loop computes the same — 2 ranks, each its
/// own Adam on its own batches, the models averaged every 2 steps
/// (`DataParallel::average_model`) — and both end within rounding (the server adds the mean
/// change to its parameters, the own loop averages the parameters), far from sync.
#[test]
fn model_averaging_trains_the_learner_as_the_programs_own_averaging_loop_does() {
    let dir = tmp();
    // 768 images per rank: 24 batches of 32, 12 rounds of 2 local steps.
    let env = [("EPOCHS", "1"), ("TRAIN_SAMPLES", "1536")];
    let batch = ["--batch-size", "32"];
    let (own, _) = launch(
        dir.path(),
        "own",
        2,
        &batch,
        &[env[0], env[1], ("LOOP", "own"), ("AVERAGE_EVERY", "2")],
    );
    let flags = ["--batch-size", "32", "--strategy", "flat"];
    let local = ("FLOTILLA_TOPOLOGY__LOCAL_STEPS", "2");
    let (averaged, _) = launch(dir.path(), "averaged", 3, &flags, &[env[0], env[1], local]);
    let (sync, _) = launch(dir.path(), "sync", 2, &batch, &env);
    let apart = relative_error(&averaged, &own);
    let from_sync = relative_error(&averaged, &sync);
    assert!(
        from_sync > 1e-2,
        "averaging ends where sync does ({from_sync})"
    );
    assert!(
        apart < 1e-5,
        "model averaging ends {apart} from the program's own averaging loop"
    );
}

/// burn's `Learner` as the workers of an elastic flat sync server (`-n 2:3 --strategy flat
/// --max-restarts 1 -- mnist_learner`): a worker SIGKILLed mid-run is left out by the
/// server, and the program started again rejoins through the one stack's run: the server
/// takes it back at a version past 0 and accepts its pushes; the job ends at 0 within 0.02 of
/// an undisturbed run's test accuracy.
#[test]
fn a_learner_worker_of_an_elastic_server_killed_is_replaced_and_rejoins() {
    let dir = tmp();
    let start = |name: &str, size: &str| {
        let out = dir.path().join(name);
        let mut c = flotilla();
        c.args([
            "launch",
            "-n",
            size,
            "--strategy",
            "flat",
            "--max-restarts",
            "1",
        ])
        .args(["--batch-size", "32", "--epochs", "2", "--output"])
        .arg(&out)
        .arg("--")
        .arg(example("mnist_learner"))
        .env("DATA", repo().join("data/mnist"))
        .env("ARTIFACTS", out.join("artifacts"))
        .envs([
            ("TRAIN_SAMPLES", "6000"),
            ("TEST_SAMPLES", "2000"),
            ("EPOCHS", "2"),
            ("DROPOUT", "0"),
        ]);
        (c, out)
    };
    let (c, out) = start("elastic", "2:3");
    let killer = kill_rank_at_round(&out, 2, 100);
    let o = run_with_deadline(c, LIMIT);
    assert!(killer.join().expect("killer"), "round 100 never came");
    let all = text(&o);
    assert!(o.status.success(), "{all}");
    assert!(
        all.contains("restart 1/1 after: rank 2 failed (killed by signal 9); it rejoins"),
        "{all}"
    );
    assert_rejoined(&out, 2);
    let accuracy = learner_test_accuracy;
    let (c, _) = start("plain", "3");
    let plain = run_with_deadline(c, LIMIT);
    assert!(plain.status.success(), "{}", text(&plain));
    let (a, b) = (accuracy(&all), accuracy(&text(&plain)));
    assert!((a - b).abs() <= 0.02, "elastic {a}, undisturbed {b}");
}
