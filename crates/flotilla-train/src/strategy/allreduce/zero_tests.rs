//! ZeRO stages 1, 2 and 3 against the unsharded sync all-reduce (zero 0), in-memory ranks
//! running the production [`SyncAllReduce`] with two buckets: after a dozen steps every
//! rank's parameters and reported losses equal zero 0's bit for bit, on 2 and 3 ranks, for
//! SGD with momentum and weight decay, Adam and AdamW decaying matrices only. The world's
//! all-reduces take the ring (`small_all_reduce_bytes` and `mid_all_reduce_bytes` 0): stage
//! 2's reduce-scatter sums in the ring's order, the doubling and Rabenseifner in others. Also: each rank's
//! `optimizer_state_bytes` is its shard's share, and a run checkpointed at step k and
//! resumed on new ranks ends bitwise as the uninterrupted one. The gradient a rank keeps
//! (`gradient_bytes`) is its shard's with ZeRO, and stage 2 holds one bucket-sized wire
//! buffer (`bucket_buffer_bytes`); on one rank ZeRO is zero 0, bits and figures.

use std::collections::BTreeMap;
use std::path::Path;
use std::thread;

use flotilla_engine::{DecayParams, OptimizerSpec};
use flotilla_tcp::{CommConfig, ProcessGroup};

use super::SyncAllReduce;
use super::zero::owned_ranges;
use crate::strategy::{Resume, Strategy};
use crate::testkit::{
    Rank, adam, assert_bitwise, batches, checkpoint_at, config, params, world_with,
};

pub(super) const STEPS: u64 = 12;
const SAMPLES: usize = 96;

pub(super) fn optimizers() -> Vec<OptimizerSpec> {
    vec![
        OptimizerSpec::Sgd {
            lr: 0.2,
            momentum: 0.9,
            dampening: 0.0,
            nesterov: false,
            weight_decay: 0.01,
            decay_params: DecayParams::All,
        },
        adam(0.02),
        OptimizerSpec::Adamw {
            lr: 0.02,
            beta1: 0.9,
            beta2: 0.99,
            epsilon: 1e-8,
            weight_decay: 0.1,
            decay_params: DecayParams::Matrices,
        },
    ]
}

/// Rank `r`'s context for a run of `zero` with `optimizer` on `n` ranks, checkpoints in
/// `output` (resuming from there when `resume`).
pub(super) fn rank(
    comm: std::sync::Arc<dyn ProcessGroup>,
    optimizer: &OptimizerSpec,
    zero: u8,
) -> Rank {
    let mut c = config(optimizer.clone());
    c.topology.world_size = comm.size();
    // The last layer (60 bytes) and the first (80 bytes): two buckets.
    c.comm.bucket_mb = 64.0 / f64::from(1 << 20);
    c.allreduce.zero = zero;
    Rank::new(comm, c, SAMPLES)
}

pub(super) fn ring(n: usize) -> Vec<std::sync::Arc<dyn ProcessGroup>> {
    world_with(n, ring_config(n))
}

/// A world of `n` whose all-reduces all take the ring.
pub(super) fn ring_config(n: usize) -> CommConfig {
    CommConfig::new(Some(0), n)
        .with_small_all_reduce_bytes(0)
        .with_mid_all_reduce_bytes(0)
}

/// What each rank ends with: parameters, reported losses, figures by name.
pub(super) type Outcome = (Vec<f32>, Vec<f32>, BTreeMap<&'static str, f64>);

/// Runs steps `from..to` on `n` ranks (a checkpoint of step `from` in `output` when
/// `from > 0`; one of step `to` written there when `save`).
pub(super) fn run(
    n: usize,
    opt: &OptimizerSpec,
    zero: u8,
    span: (u64, u64),
    output: &Path,
    save: bool,
) -> Vec<Outcome> {
    run_overlapped(n, opt, (zero, true, true), span, output, save)
}

/// [`run`] at `(zero, overlap, prefetch)`: without overlap, one backward pass gives the
/// gradients in flat order (the buckets' reverse) and the loss before them; without
/// prefetch, stage 3 starts each group's all-gather when the group is about to run.
fn run_overlapped(
    n: usize,
    opt: &OptimizerSpec,
    (zero, overlap, prefetch): (u8, bool, bool),
    span: (u64, u64),
    output: &Path,
    save: bool,
) -> Vec<Outcome> {
    let handles: Vec<_> = ring(n)
        .into_iter()
        .map(|comm| {
            let (opt, output) = (opt.clone(), output.to_path_buf());
            thread::spawn(move || {
                let mut rank = rank(comm.clone(), &opt, zero);
                rank.config.allreduce.overlap = overlap;
                rank.config.allreduce.prefetch = prefetch;
                rank.config.telemetry.output = output;
                rank.config.schedule.resume = span.0 > 0;
                let topology = rank.config.topology().expect("topology");
                let mut peer = rank.build(&topology, SyncAllReduce::build);
                assert_eq!(peer.plan().buckets.len(), 2, "two buckets");
                let resume = Resume::find(&mut rank.cx(), 7, false).expect("find");
                let state = peer.restore(&mut rank.cx(), &resume).expect("restore");
                assert_eq!(state.map(|s| s.step), (span.0 > 0).then_some(span.0));
                peer.start(&mut rank.cx()).expect("start");
                let data = crate::testkit::dataset(SAMPLES);
                let mut shard = batches(&data, n, comm.rank());
                for _ in 0..span.0 {
                    shard.next_batch().expect("skip a batch");
                }
                let losses = (span.0..span.1)
                    .map(|done| {
                        let step = peer.step(&mut rank.cx(), &mut shard, done).expect("step");
                        step.loss.expect("a sync step has a loss")
                    })
                    .collect();
                if save {
                    let state = checkpoint_at(span.1, "mlp2");
                    peer.save_checkpoint(&mut rank.cx(), &state)
                        .expect("checkpoint");
                }
                let figures = peer.figures(&rank.cx()).into_iter().collect();
                // Stage 3 gathers the whole parameters for a whole-model read.
                peer.prepare_model(&mut rank.cx()).expect("prepare");
                (params(&mut peer), losses, figures)
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread"))
        .collect()
}

#[test]
fn zero_1_2_and_3_equal_zero_0_bitwise_with_and_without_prefetch() {
    let tmp = tempfile::tempdir().expect("tmp");
    for opt in optimizers() {
        for n in [2, 3] {
            let reference = run(n, &opt, 0, (0, STEPS), tmp.path(), false);
            let start = run(n, &opt, 0, (0, 0), tmp.path(), false).remove(0).0;
            assert_ne!(reference[0].0, start, "{opt:?}: the parameters moved");
            let modes = [
                (1, true, true),
                (2, true, true),
                (2, false, true),
                (3, true, true),
                (3, true, false),
            ];
            for mode in modes {
                let got = run_overlapped(n, &opt, mode, (0, STEPS), tmp.path(), false);
                for (r, (p, losses, _)) in got.iter().enumerate() {
                    let what =
                        format!("{opt:?}, {n} ranks, (zero, overlap, prefetch) {mode:?}, rank {r}");
                    assert_bitwise(p, &reference[r].0, &what);
                    assert_bitwise(losses, &reference[r].1, &format!("{what}: losses"));
                }
            }
        }
    }
}

#[test]
fn optimizer_state_bytes_are_each_ranks_share() {
    let tmp = tempfile::tempdir().expect("tmp");
    let adam = &optimizers()[1];
    let n = 3;
    let whole = run(n, adam, 0, (0, 2), tmp.path(), false);
    let total = whole[0].0.len();
    for (r, w) in whole.iter().enumerate() {
        assert_eq!(
            w.2["optimizer_state_bytes"],
            (2 * 4 * total) as f64,
            "zero 0, rank {r}: all the state"
        );
    }
    // The plan of the two buckets, as every peer cuts it.
    let plan = the_plan(adam);
    for zero in [1, 2] {
        let got = run(n, adam, zero, (0, 2), tmp.path(), false);
        let mut sum = 0.0;
        for (r, (_, _, figures)) in got.iter().enumerate() {
            let owned: usize = owned_ranges(&plan, n, r).iter().map(|x| x.len()).sum();
            let bytes = figures["optimizer_state_bytes"];
            assert_eq!(bytes, (2 * 4 * owned) as f64, "zero {zero}, rank {r}");
            sum += bytes;
        }
        assert_eq!(
            sum, whole[0].2["optimizer_state_bytes"],
            "zero {zero}: the shards add up to the whole state"
        );
    }
}

#[test]
fn a_resumed_zero_run_equals_the_uninterrupted_one() {
    let adamw = &optimizers()[2];
    for zero in [1, 2, 3] {
        let n = 3;
        let tmp = tempfile::tempdir().expect("tmp");
        let whole = run(n, adamw, zero, (0, STEPS), tmp.path(), false);
        run(n, adamw, zero, (0, 5), tmp.path(), true);
        let resumed = run(n, adamw, zero, (5, STEPS), tmp.path(), false);
        for r in 0..n {
            assert_bitwise(
                &resumed[r].0,
                &whole[r].0,
                &format!("zero {zero}, rank {r}"),
            );
        }
    }
}

/// Each bucket's wire length (values and, in the last, the loss slot), as every peer cuts
/// the plan.
fn wire_lens(opt: &OptimizerSpec) -> Vec<usize> {
    let plan = the_plan(opt);
    (0..plan.buckets.len())
        .map(|k| super::zero::wire_len(&plan, k))
        .collect()
}

#[test]
fn a_stage_2_or_3_rank_keeps_its_shard_of_the_gradient_and_one_bucket_buffer() {
    let tmp = tempfile::tempdir().expect("tmp");
    let adam = &optimizers()[1];
    let wires = wire_lens(adam);
    let (all, largest) = (wires.iter().sum::<usize>(), wires.iter().max().copied());
    let largest = largest.expect("buckets");
    for n in [2, 3] {
        let whole = run(n, adam, 0, (0, 2), tmp.path(), false);
        let total = whole[0].0.len();
        for (r, (_, _, f)) in whole.iter().enumerate() {
            let what = format!("zero 0, {n} ranks, rank {r}");
            assert_eq!(f["gradient_bytes"], (4 * total) as f64, "{what}");
            assert_eq!(f["bucket_buffer_bytes"], (4 * all) as f64, "{what}");
        }
        let plan = the_plan(adam);
        for zero in [1, 2, 3] {
            let got = run(n, adam, zero, (0, 2), tmp.path(), false);
            let mut sum = 0.0;
            for (r, (_, _, f)) in got.iter().enumerate() {
                let what = format!("zero {zero}, {n} ranks, rank {r}");
                let owned: usize = owned_ranges(&plan, n, r).iter().map(|x| x.len()).sum();
                assert!(
                    owned <= total.div_ceil(n) + 1,
                    "{what}: 1/N of {total}: {owned}"
                );
                assert_eq!(f["gradient_bytes"], (4 * owned) as f64, "{what}");
                sum += f["gradient_bytes"];
                // Stage 1 keeps every bucket (all-reduced in place) and the all-gather's
                // buffer; stage 2 one bucket-sized buffer for both; stage 3 one for the
                // reduce-scatters and one for the parameters' all-gathers (the one under
                // way, or the next one's prefetched: a gather waits for it first).
                let wire = match zero {
                    1 => all + largest,
                    2 => largest,
                    _ => 2 * largest,
                };
                assert_eq!(f["bucket_buffer_bytes"], (4 * wire) as f64, "{what}");
                let shard = f.get("param_shard_bytes").copied();
                let want = (zero == 3).then_some((4 * owned) as f64);
                assert_eq!(shard, want, "{what}: the parameters kept between steps");
            }
            assert_eq!(
                sum,
                (4 * total) as f64,
                "zero {zero}: the shards make the model"
            );
        }
    }
}

#[test]
fn zero_on_one_rank_is_the_unsharded_path() {
    let tmp = tempfile::tempdir().expect("tmp");
    let adam = &optimizers()[1];
    let reference = run(1, adam, 0, (0, STEPS), tmp.path(), false);
    for zero in [1, 2, 3] {
        let got = run(1, adam, zero, (0, STEPS), tmp.path(), false);
        assert_bitwise(
            &got[0].0,
            &reference[0].0,
            &format!("zero {zero}, one rank"),
        );
        assert_bitwise(&got[0].1, &reference[0].1, &format!("zero {zero}: losses"));
        // No second copy of anything: the figures are zero 0's.
        assert_eq!(
            got[0].2, reference[0].2,
            "zero {zero}, one rank: memory figures"
        );
    }
}

/// The bucket plan every peer cuts.
fn the_plan(opt: &OptimizerSpec) -> crate::bucket::BucketPlan {
    let mut one = rank(ring(1).remove(0), opt, 0);
    let topology = one.config.topology().expect("topology");
    one.build(&topology, SyncAllReduce::build).plan().clone()
}
