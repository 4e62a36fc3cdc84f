//! Sync all-reduce of three in-memory ranks against serial SGD with the mean gradient of the
//! three ranks' batches: the production [`SyncAllReduce`] with backward cut into two groups
//! (two buckets, the loss riding in the last), overlapped and not. A three-rank ring sums each
//! segment in its own order, so the reference agrees within f32 rounding (1e-6 relative),
//! and the ranks agree with each other bit for bit. (Two ranks against the formula bit for
//! bit: `async_tests`.)

use std::thread;

use super::SyncAllReduce;
use crate::strategy::Strategy;
use crate::testkit::{
    Oracle, Rank, SgdRef, assert_bitwise, batches, config, dataset, params, relative_error, sgd,
    world,
};

const RANKS: usize = 3;
const STEPS: u64 = 8;
/// 4 batches per rank and epoch: the run crosses an epoch.
const SAMPLES: usize = 48;
const LR: f64 = 0.3;
const MOMENTUM: f64 = 0.9;

/// Every rank's parameters and reported global losses after `STEPS` steps.
fn run(overlap: bool) -> Vec<(Vec<f32>, Vec<f32>)> {
    let handles: Vec<_> = world(RANKS)
        .into_iter()
        .map(|comm| {
            thread::spawn(move || {
                let mut c = config(sgd(LR, MOMENTUM));
                c.topology.world_size = RANKS;
                // The last layer (60 bytes) and the first (80 bytes): two groups.
                c.comm.bucket_mb = 64.0 / f64::from(1 << 20);
                c.allreduce.overlap = overlap;
                let topology = c.topology().expect("topology");
                let mut rank = Rank::new(comm.clone(), c, SAMPLES);
                let mut peer = rank.build(&topology, SyncAllReduce::build);
                assert_eq!(peer.plan().buckets.len(), 2, "two buckets");
                let data = dataset(SAMPLES);
                let mut shard = batches(&data, RANKS, comm.rank());
                peer.start(&mut rank.cx()).expect("start");
                let losses = (0..STEPS)
                    .map(|done| {
                        let step = peer.step(&mut rank.cx(), &mut shard, done).expect("step");
                        step.loss.expect("a sync step has a loss")
                    })
                    .collect();
                (params(&mut peer), losses)
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread"))
        .collect()
}

/// Serial SGD with the mean gradient over the ranks' batches; the parameters and each
/// step's mean loss.
fn reference() -> (Vec<f32>, Vec<f32>) {
    let data = dataset(SAMPLES);
    let mut shards: Vec<_> = (0..RANKS).map(|r| batches(&data, RANKS, r)).collect();
    let (mut oracle, mut w) = Oracle::new();
    let mut opt = SgdRef::new(MOMENTUM);
    let mut losses = Vec::new();
    for _ in 0..STEPS {
        let mut mean = vec![0.0f32; w.len()];
        let mut loss = 0.0f32;
        for s in &mut shards {
            let (g, l) = oracle.grad(&w, s.next_batch().expect("batch").1);
            mean.iter_mut()
                .zip(&g)
                .for_each(|(m, g)| *m += g / RANKS as f32);
            loss += l / RANKS as f32;
        }
        opt.step(&mut w, &mean, LR);
        losses.push(loss);
    }
    (w, losses)
}

#[test]
fn three_ranks_equal_serial_sgd_on_the_mean_gradient() {
    let (want, want_losses) = reference();
    let (_, initial) = Oracle::new();
    assert!(
        relative_error(&initial, &want) > 1e-2,
        "the parameters moved"
    );
    for overlap in [true, false] {
        let ranks = run(overlap);
        for (r, (params, losses)) in ranks.iter().enumerate() {
            let what = format!("overlap {overlap}, rank {r}");
            let err = relative_error(params, &want);
            assert!(err <= 1e-6, "{what}: relative error {err:e}");
            assert_bitwise(params, &ranks[0].0, &format!("{what} against rank 0"));
            let err = relative_error(losses, &want_losses);
            assert!(err <= 1e-6, "{what}: global losses off by {err:e}");
        }
    }
}

/// A model with batch norm: its running statistics are buffers each rank updates from its own
/// shard.
const BN_SPEC: &str = "name: bn\ninput: [1, 2, 2]\nlayers:\n  - flatten\n  - linear: {out: 3}\n  - batch_norm\n  - relu\n  - linear: {out: 3}\n";

#[test]
fn batch_norm_statistics_are_the_peers_mean_before_evaluation() {
    let spec = flotilla_engine::ModelSpec::from_yaml(BN_SPEC, "bn").expect("spec");
    let handles: Vec<_> = world(2)
        .into_iter()
        .map(|comm| {
            let spec = spec.clone();
            thread::spawn(move || {
                let mut c = config(sgd(LR, MOMENTUM));
                c.topology.world_size = 2;
                let topology = c.topology().expect("topology");
                let mut rank = Rank::new(comm.clone(), c, SAMPLES);
                let mut peer = rank.build_model(&spec, &topology, SyncAllReduce::build);
                let data = dataset(SAMPLES);
                let mut shard = batches(&data, 2, comm.rank());
                peer.start(&mut rank.cx()).expect("start");
                for done in 0..3 {
                    peer.step(&mut rank.cx(), &mut shard, done).expect("step");
                }
                let read = |peer: &mut SyncAllReduce| {
                    let model = peer.model().expect("model");
                    let mut b = vec![0.0; model.buffer_layout().total];
                    model.read_buffers(&mut b).expect("buffers");
                    b
                };
                let own = read(&mut peer);
                peer.evaluate(&mut rank.cx()).expect("evaluate");
                (own, read(&mut peer))
            })
        })
        .collect();
    let r: Vec<_> = handles
        .into_iter()
        .map(|h| h.join().expect("rank"))
        .collect();
    assert_eq!(r[0].0.len(), 6, "running mean and variance of 3 features");
    assert_ne!(r[0].0, r[1].0, "the ranks' statistics did not drift apart");
    for (i, got) in r[0].1.iter().enumerate() {
        let mean = (r[0].0[i] + r[1].0[i]) / 2.0;
        assert!(
            (got - mean).abs() <= 1e-6,
            "buffer {i}: {got}, not the mean {mean}"
        );
    }
    assert_bitwise(&r[1].1, &r[0].1, "rank 1's statistics against rank 0's");
}

/// An elastic job's members that do not divide the global batch: 3 ranks share batches of
/// 16 samples (6, 5 and 5), each rank's gradient weighted by its samples, and train as
/// serial SGD on the whole global batch does (1e-6 relative: the ring's order of sums).
/// Without the weights the update is the mean of the ranks' means: off by 3.7e-2. The same
/// for async all-reduce at staleness 0 (each step applies its own gradient, through the
/// cycle); and with 2 micro-batches a step (gradient accumulation), where the shares are
/// whole micro-batches: 6, 6 and 4.
#[test]
fn members_that_do_not_divide_the_global_batch_train_as_one_rank_on_it() {
    for micro in [1, 2] {
        for zero in [0, 1, 2] {
            unequal_shares_train_as_one_rank(false, zero, micro);
        }
        unequal_shares_train_as_one_rank(true, 0, micro);
    }
}

/// `RANKS` peers (async or sync at `zero`, `micro` micro-batches a step) on shares of a
/// global batch of 16 (6, 5, 5; or 6, 6, 4 in micro-batches of 2) against one rank on all
/// of it.
fn unequal_shares_train_as_one_rank(asynchronous: bool, zero: u8, micro: usize) {
    const GLOBAL: usize = 16;
    let data = dataset(SAMPLES);
    let sliced = |workers: usize, rank: usize| {
        let train = std::sync::Arc::new(data.clone());
        let at = crate::batches::Position::default();
        crate::batches::Batches::sliced(
            train,
            (workers, rank),
            crate::testkit::DATA_SEED,
            (GLOBAL, micro),
            at,
        )
        .expect("batches")
    };
    let (mut oracle, mut want) = Oracle::new();
    let mut opt = SgdRef::new(MOMENTUM);
    let mut whole = sliced(1, 0);
    assert_eq!(whole.batch_size(), GLOBAL);
    for _ in 0..STEPS {
        let (g, _) = oracle.grad(&want, whole.next_batch().expect("batch").1);
        opt.step(&mut want, &g, LR);
    }
    let shares: Vec<_> = (0..RANKS).map(|r| sliced(RANKS, r)).collect();
    let sizes: Vec<usize> = shares.iter().map(|b| b.batch_size()).collect();
    assert_eq!(sizes, if micro == 1 { [6, 5, 5] } else { [6, 6, 4] });
    let handles: Vec<_> = world(RANKS)
        .into_iter()
        .zip(shares)
        .map(|(comm, mut shard)| {
            thread::spawn(move || {
                let mut c = config(sgd(LR, MOMENTUM));
                c.topology.world_size = RANKS;
                c.allreduce.staleness = 0;
                c.allreduce.zero = zero;
                c.allreduce.accumulation_steps = micro as u32;
                let topology = c.topology().expect("topology");
                let mut rank = Rank::new(comm.clone(), c, SAMPLES);
                let mut peer: Box<dyn Strategy> = if asynchronous {
                    Box::new(rank.build(&topology, super::AsyncAllReduce::build))
                } else {
                    Box::new(rank.build(&topology, SyncAllReduce::build))
                };
                peer.start(&mut rank.cx()).expect("start");
                for done in 0..STEPS {
                    peer.step(&mut rank.cx(), &mut shard, done).expect("step");
                }
                params(&mut *peer)
            })
        })
        .collect();
    for (r, h) in handles.into_iter().enumerate() {
        let got = h.join().expect("rank");
        let err = relative_error(&got, &want);
        assert!(
            err <= 1e-6,
            "async {asynchronous}, zero {zero}, micro {micro}, rank {r}: relative error {err:e}"
        );
    }
}
