//! ZeRO stage 3 of a model with batch norm against the unsharded sync all-reduce (zero 0),
//! in-memory ranks running the production [`SyncAllReduce`]: the running statistics are
//! never released, updated once a step (the recomputed forward's update undone), averaged
//! over the ranks before an evaluation, a checkpoint and the check that the ranks agree,
//! as zero 0 averages them; so losses, parameters and statistics are zero 0's bit for bit.
//! The checkpoint written a share per rank holds the statistics (loaded by burn's own
//! reader), and a run resumed from it ends bitwise as the uninterrupted one.

use std::path::{Path, PathBuf};
use std::thread;

use flotilla_engine::{BurnEngine, ModelSpec, ModelState};

use super::SyncAllReduce;
use super::zero_tests::{optimizers, rank, ring};
use crate::strategy::{Resume, Strategy};
use crate::testkit::{SEED, assert_bitwise, batches, checkpoint_at, params};

/// Two batch norms (1-d) on the 2×2 input: between linear layers, and on the logits.
const BN_SPEC: &str = "name: mlp-bn\ninput: [1, 2, 2]\nlayers:\n  - flatten\n  \
                       - linear: {out: 4}\n  - batch_norm\n  - tanh\n  - linear: {out: 3}\n  \
                       - batch_norm\n";
const STEPS: u64 = 12;
/// The step after which every rank evaluates (and so averages the statistics).
const EVALUATED: u64 = 4;

fn spec() -> ModelSpec {
    ModelSpec::from_yaml(BN_SPEC, "mlp-bn").expect("spec")
}

/// What a rank ends with: parameters, running statistics, losses, and on rank 0 the
/// checkpoint of the last step.
struct Ended {
    params: Vec<f32>,
    buffers: Vec<f32>,
    losses: Vec<f32>,
    checkpoint: Option<PathBuf>,
}

fn buffers(model: &dyn ModelState) -> Vec<f32> {
    let mut b = vec![0.0; model.buffer_layout().total];
    model.read_buffers(&mut b).expect("buffers");
    b
}

/// Buckets (backward groups under ZeRO-3) of at most 64 bytes: the model's last group holds
/// a batch norm, whose forward runs once, in backward.
const SMALL: f64 = 64.0 / (1 << 20) as f64;
/// One bucket: the whole model one group.
const ONE: f64 = 1.0;

/// Steps `from..to` of `zero` on `n` ranks in buckets of `bucket_mb` (resumed from
/// `output`'s checkpoint of step `from` when `from > 0`), evaluated after step
/// [`EVALUATED`] when in the span, a checkpoint of step `to` written into `output` (none
/// when no step ran).
fn run(
    n: usize,
    (zero, bucket_mb): (u8, f64),
    (from, to): (u64, u64),
    output: &Path,
) -> Vec<Ended> {
    run_seeing(n, (zero, bucket_mb), (from, to), output, true)
}

/// [`run`], the ranks but 0 blind to rank 0's directories unless `seeing` (as on other
/// hosts: what they resume from comes from rank 0).
fn run_seeing(
    n: usize,
    (zero, bucket_mb): (u8, f64),
    (from, to): (u64, u64),
    output: &Path,
    seeing: bool,
) -> Vec<Ended> {
    let handles: Vec<_> = ring(n)
        .into_iter()
        .map(|comm| {
            let output = output.to_path_buf();
            thread::spawn(move || {
                if !seeing && comm.rank() > 0 {
                    crate::checkpoint_offer::BLIND.with(|b| b.set(true));
                }
                let mut rank = rank(comm.clone(), &optimizers()[1], zero);
                rank.config.telemetry.output = output;
                rank.config.comm.bucket_mb = bucket_mb;
                rank.config.schedule.resume = from > 0;
                let topology = rank.config.topology().expect("topology");
                let mut peer = rank.build_model(&spec(), &topology, SyncAllReduce::build);
                let resume = Resume::find(&mut rank.cx(), 7, false).expect("find");
                let state = peer.restore(&mut rank.cx(), &resume).expect("restore");
                assert_eq!(state.map(|s| s.step), (from > 0).then_some(from));
                peer.start(&mut rank.cx()).expect("start");
                let data = crate::testkit::dataset(96);
                let mut shard = batches(&data, n, comm.rank());
                for _ in 0..from {
                    shard.next_batch().expect("skip a batch");
                }
                let mut losses = Vec::new();
                for done in from..to {
                    let step = peer.step(&mut rank.cx(), &mut shard, done).expect("step");
                    losses.push(step.loss.expect("a sync step has a loss"));
                    if done + 1 == EVALUATED {
                        peer.evaluate(&mut rank.cx()).expect("evaluate");
                    }
                }
                let state = checkpoint_at(to, "mlp-bn");
                let checkpoint = match from < to {
                    true => (peer.save_checkpoint(&mut rank.cx(), &state)).expect("checkpoint"),
                    false => None,
                };
                peer.prepare_model(&mut rank.cx()).expect("prepare");
                let model = peer.model().expect("model");
                Ended {
                    buffers: buffers(model),
                    params: params(&mut peer),
                    losses,
                    checkpoint,
                }
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread"))
        .collect()
}

/// The parameters and statistics burn's own reader loads from `dir`'s `model.safetensors`.
fn loaded(dir: &Path) -> (Vec<f32>, Vec<f32>) {
    let mut e = BurnEngine::new(&spec(), &optimizers()[1], "flex", SEED + 1).expect("engine");
    e.load_weights(&dir.join("model.safetensors"))
        .expect("load");
    let mut p = vec![0.0; e.num_params()];
    e.read_params(&mut p).expect("params");
    (p, buffers(&e))
}

#[test]
fn zero_3_trains_batch_norm_as_zero_0_and_checkpoints_its_statistics() {
    for bucket_mb in [SMALL, ONE] {
        zero_3_against_zero_0(bucket_mb);
    }
}

/// [`zero_3_trains_batch_norm_as_zero_0_and_checkpoints_its_statistics`] in buckets of
/// `bucket_mb`.
fn zero_3_against_zero_0(bucket_mb: f64) {
    let n = 2;
    let (plain, sharded) = (
        tempfile::tempdir().expect("tmp"),
        tempfile::tempdir().expect("tmp"),
    );
    let want = run(n, (0, bucket_mb), (0, STEPS), plain.path());
    let got = run(n, (3, bucket_mb), (0, STEPS), sharded.path());
    let initial =
        buffers(&BurnEngine::new(&spec(), &optimizers()[1], "flex", SEED).expect("engine"));
    for r in 0..n {
        let what = format!("{bucket_mb} MiB buckets, rank {r}");
        assert_bitwise(&got[r].losses, &want[r].losses, &format!("{what}: losses"));
        assert_bitwise(
            &got[r].params,
            &want[r].params,
            &format!("{what}: parameters"),
        );
        assert_bitwise(
            &got[r].buffers,
            &want[r].buffers,
            &format!("{what}: statistics"),
        );
    }
    assert_ne!(got[0].buffers, initial, "the statistics moved");
    let dirs = (got[0].checkpoint.as_ref(), want[0].checkpoint.as_ref());
    let (Some(sharded_dir), Some(plain_dir)) = dirs else {
        panic!("rank 0 wrote no checkpoint");
    };
    let (params, stats) = loaded(sharded_dir);
    assert_bitwise(&params, &want[0].params, "ZeRO-3's checkpoint: parameters");
    assert_bitwise(&stats, &want[0].buffers, "ZeRO-3's checkpoint: statistics");
    let (_, plain_stats) = loaded(plain_dir);
    assert_bitwise(&stats, &plain_stats, "the checkpoints' statistics");
}

#[test]
fn a_zero_3_run_with_batch_norm_resumes_to_the_uninterrupted_ones_bits() {
    let n = 2;
    let (whole_dir, tmp) = (
        tempfile::tempdir().expect("tmp"),
        tempfile::tempdir().expect("tmp"),
    );
    let whole = run(n, (3, SMALL), (0, STEPS), whole_dir.path());
    // Cut where the uninterrupted run averages the statistics too (its evaluation): the
    // checkpoint holds their mean, as every checkpoint does.
    run(n, (3, SMALL), (0, EVALUATED), tmp.path());
    let resumed = run(n, (3, SMALL), (EVALUATED, STEPS), tmp.path());
    for r in 0..n {
        let what = format!("rank {r}");
        assert_bitwise(
            &resumed[r].params,
            &whole[r].params,
            &format!("{what}: parameters"),
        );
        assert_bitwise(
            &resumed[r].buffers,
            &whole[r].buffers,
            &format!("{what}: statistics"),
        );
    }
}

/// A ZeRO-3 resume loads each rank's shard itself, or from rank 0 for a rank blind to its
/// checkpoint (`zero/shard_load.rs`): the run resumed so, rank 1 blind, ends on the
/// uninterrupted run's bits; and a checkpoint of 4 ranks resumed on 2 (shards of another
/// cut, the optimizer state cut out of the checkpoint's files) holds the checkpoint's parameters and
/// statistics, bit for bit. (Two ranks: the mean of two equal statistics is theirs exactly,
/// of three it may round.)
#[test]
fn a_zero_3_resume_loads_each_ranks_shard_at_this_and_another_world_size() {
    let dirs = [(); 3].map(|()| tempfile::tempdir().expect("tmp"));
    let whole = run(2, (3, SMALL), (0, STEPS), dirs[0].path());
    run(2, (3, SMALL), (0, EVALUATED), dirs[1].path());
    let resumed = run_seeing(2, (3, SMALL), (EVALUATED, STEPS), dirs[1].path(), false);
    for (r, (got, want)) in resumed.iter().zip(&whole).enumerate() {
        assert_bitwise(&got.params, &want.params, &format!("rank {r}: parameters"));
        assert_bitwise(
            &got.buffers,
            &want.buffers,
            &format!("rank {r}: statistics"),
        );
    }
    let four = run(4, (3, SMALL), (0, EVALUATED), dirs[2].path());
    let (params, stats) = loaded(four[0].checkpoint.as_deref().expect("rank 0's checkpoint"));
    for seeing in [true, false] {
        let two = run_seeing(
            2,
            (3, SMALL),
            (EVALUATED, EVALUATED),
            dirs[2].path(),
            seeing,
        );
        for (r, got) in two.iter().enumerate() {
            let what = format!("4 ranks' checkpoint on rank {r} of 2, seeing it {seeing}");
            assert_bitwise(&got.params, &params, &format!("{what}: parameters"));
            assert_bitwise(&got.buffers, &stats, &format!("{what}: statistics"));
        }
    }
}
