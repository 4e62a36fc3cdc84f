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
