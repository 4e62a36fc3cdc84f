//! The asynchronous all-reduce against its serial formula, below the process level: two
//! in-memory ranks run the production [`AsyncAllReduce`] on known batches of a tiny model,
//! and their parameters after every step and the final drain are compared bit for bit with
//! the update rule written out here (gradients from [`Oracle`] at the parameters the formula
//! says they are computed at).
//!
//! With staleness `s`, step `j` submits its gradient, computed at
//! `ŵ = w_u + k·((1 + β)·(w_u − w_{u−1}) − β·(w_{u−1} − w_{u−2}))` (`u` updates so far, `k`
//! steps in flight, `β` the momentum once two updates are known, else 0; no prediction
//! while nothing is in flight or nothing moved), then applies the oldest reduced steps until
//! at most `s` are in flight (the first step keeps none) at the learning rate of step `j`;
//! stopping applies the rest at the last step's rate.

use std::collections::VecDeque;
use std::thread;

use super::{AsyncAllReduce, SyncAllReduce};
use crate::config::{LrSchedule, StaleCorrection};
use crate::strategy::Strategy;
use crate::testkit::{
    Oracle, Rank, SgdRef, assert_bitwise, batches, config, dataset, mean2, params, sgd, world,
};

const RANKS: usize = 2;
/// Steps of a run: crosses an epoch (6 batches per rank and epoch).
const STEPS: u64 = 9;
const SAMPLES: usize = 48;
const LR: f64 = 0.3;
const MOMENTUM: f64 = 0.9;

/// The learning rate of step `j`: cosine over the run, so that using another step's rate
/// shows.
fn lr(j: u64) -> f64 {
    LrSchedule::Cosine.lr_at(LR, j, STEPS, 0)
}

/// Which strategy each rank runs.
#[derive(Clone, Copy)]
enum Peer {
    Async(u64, StaleCorrection),
    Sync { overlap: bool },
}

/// Every rank's parameters after each step (after the step's own updates, and after the
/// drain of an evaluation after step `drain_after`), then after the stop (which drains what
/// is in flight).
fn run(peer: Peer, drain_after: Option<u64>) -> Vec<Vec<Vec<f32>>> {
    let handles: Vec<_> = world(RANKS)
        .into_iter()
        .map(|comm| {
            thread::spawn(move || {
                let mut c = config(sgd(LR, MOMENTUM));
                c.topology.world_size = RANKS;
                c.schedule.lr_schedule = LrSchedule::Cosine;
                if let Peer::Async(staleness, correction) = peer {
                    c.allreduce.staleness = staleness;
                    c.allreduce.correction = correction;
                }
                if let Peer::Sync { overlap } = peer {
                    c.allreduce.overlap = overlap;
                }
                let topology = c.topology().expect("topology");
                let mut rank = Rank::new(comm.clone(), c, SAMPLES);
                rank.rounds = STEPS;
                let data = dataset(SAMPLES);
                let mut shard = batches(&data, RANKS, comm.rank());
                let mut role: Box<dyn Strategy> = match peer {
                    Peer::Async(..) => Box::new(rank.build(&topology, AsyncAllReduce::build)),
                    Peer::Sync { .. } => Box::new(rank.build(&topology, SyncAllReduce::build)),
                };
                role.start(&mut rank.cx()).expect("start");
                let mut after = Vec::new();
                for done in 0..STEPS {
                    role.step(&mut rank.cx(), &mut shard, done).expect("step");
                    if drain_after == Some(done + 1) {
                        // What the run loop does before evaluating or checkpointing.
                        role.prepare_model(&mut rank.cx()).expect("drain");
                    }
                    after.push(params(&mut *role));
                }
                role.stop(&mut rank.cx(), "done").expect("stop");
                after.push(params(&mut *role));
                after
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread"))
        .collect()
}

/// Where the formula computes a step's gradient: `w_u` predicted over `k` steps in flight
/// from the updates `ws` so far (or `w_u` itself).
fn gradient_point(ws: &[Vec<f32>], k: usize, predict: bool, momentum: f32) -> Vec<f32> {
    let u = ws.len() - 1;
    if !predict || k == 0 || u == 0 {
        return ws[u].clone();
    }
    let beta = if u >= 2 { momentum } else { 0.0 };
    let (c, q, q2) = (&ws[u], &ws[u - 1], &ws[u.saturating_sub(2)]);
    let k = k as f32;
    (0..c.len())
        .map(|i| c[i] + k * ((1.0 + beta) * (c[i] - q[i]) - beta * (q[i] - q2[i])))
        .collect()
}

/// The serial formula of the module documentation: the parameters after each step, then
/// after the final drain. A drain after step `drain_after` applies what is in flight at that
/// step's rate and forgets the updates before it (nothing to predict from).
fn reference(staleness: usize, predict: bool, drain_after: Option<u64>) -> Vec<Vec<f32>> {
    let data = dataset(SAMPLES);
    let mut shards: Vec<_> = (0..RANKS).map(|r| batches(&data, RANKS, r)).collect();
    let (mut oracle, w0) = Oracle::new();
    let mut opt = SgdRef::new(MOMENTUM);
    let mut ws = vec![w0];
    let mut in_flight: VecDeque<Vec<f32>> = VecDeque::new();
    let mut after = Vec::new();
    let mut apply = |ws: &mut Vec<Vec<f32>>, g: &[f32], lr: f64| {
        let mut w = ws[ws.len() - 1].clone();
        opt.step(&mut w, g, lr);
        ws.push(w);
    };
    for j in 0..STEPS {
        let at = gradient_point(&ws, in_flight.len(), predict, MOMENTUM as f32);
        let grads: Vec<Vec<f32>> = shards
            .iter_mut()
            .map(|s| oracle.grad(&at, s.next_batch().expect("batch").1).0)
            .collect();
        in_flight.push_back(mean2(&grads[0], &grads[1]));
        let keep = if j == 0 { 0 } else { staleness };
        while in_flight.len() > keep {
            let g = in_flight.pop_front().expect("in flight");
            apply(&mut ws, &g, lr(j));
        }
        if drain_after == Some(j + 1) {
            while let Some(g) = in_flight.pop_front() {
                apply(&mut ws, &g, lr(j));
            }
            ws = vec![ws[ws.len() - 1].clone()];
        }
        after.push(ws[ws.len() - 1].clone());
    }
    while let Some(g) = in_flight.pop_front() {
        apply(&mut ws, &g, lr(STEPS - 1));
    }
    after.push(ws[ws.len() - 1].clone());
    after
}

/// Every rank holds the reference's parameters after every step, bit for bit.
fn assert_follows(ranks: &[Vec<Vec<f32>>], want: &[Vec<f32>], what: &str) {
    for (r, steps) in ranks.iter().enumerate() {
        assert_eq!(steps.len(), want.len(), "{what}: rank {r} steps");
        for (j, (got, want)) in steps.iter().zip(want).enumerate() {
            let when = if j < STEPS as usize {
                format!("after step {}", j + 1)
            } else {
                "after the final drain".into()
            };
            assert_bitwise(got, want, &format!("{what}: rank {r} {when}"));
        }
    }
}

#[test]
fn staleness_one_with_weight_prediction_follows_the_serial_formula() {
    let want = reference(1, true, None);
    // The formula is not degenerate: prediction and staleness both change the result.
    let last = STEPS as usize;
    assert_ne!(
        want[last],
        reference(1, false, None)[last],
        "prediction matters"
    );
    assert_ne!(
        want[last],
        reference(0, false, None)[last],
        "staleness matters"
    );
    // Step 2 applied nothing (one step stays in flight).
    assert_eq!(want[0], want[1]);
    let ranks = run(Peer::Async(1, StaleCorrection::Predict), None);
    assert_follows(&ranks, &want, "staleness 1, predict");
}

#[test]
fn staleness_one_without_correction_applies_the_previous_gradient_as_it_is() {
    let ranks = run(Peer::Async(1, StaleCorrection::None), None);
    assert_follows(
        &ranks,
        &reference(1, false, None),
        "staleness 1, no correction",
    );
}

#[test]
fn staleness_zero_equals_sync_allreduce_and_serial_mean_gradient_sgd() {
    let want = reference(0, false, None);
    let asynchronous = run(Peer::Async(0, StaleCorrection::Predict), None);
    assert_follows(&asynchronous, &want, "async staleness 0");
    for overlap in [true, false] {
        let sync = run(Peer::Sync { overlap }, None);
        assert_follows(&sync, &want, &format!("sync all-reduce, overlap {overlap}"));
    }
}

#[test]
fn staleness_two_predicts_over_the_two_steps_in_flight() {
    let want = reference(2, true, None);
    assert_ne!(
        want[STEPS as usize],
        reference(2, false, None)[STEPS as usize]
    );
    let ranks = run(Peer::Async(2, StaleCorrection::Predict), None);
    assert_follows(&ranks, &want, "staleness 2, predict");
}

#[test]
fn a_drain_mid_run_applies_what_is_in_flight_and_forgets_the_updates() {
    // An evaluation after step 5 drains; the prediction starts afresh, as after a resume.
    let want = reference(1, true, Some(5));
    assert_ne!(
        want[4],
        reference(1, true, None)[4],
        "the drain applied a step"
    );
    let ranks = run(Peer::Async(1, StaleCorrection::Predict), Some(5));
    assert_follows(&ranks, &want, "staleness 1, predict, drained after step 5");
}
