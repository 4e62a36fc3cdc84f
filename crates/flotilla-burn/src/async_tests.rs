//! [`AsyncAllReduce`] against its serial formula: two in-memory ranks train a user's module
//! through the background cycle, and their parameters after every step (and after a drain and
//! the final one) equal, bit for bit, the update rule written out here with the same burn
//! model and optimizer in one process (gradients of each rank's shard at the point the formula
//! says, averaged as `(g0 + g1) · ½`).

use std::collections::VecDeque;
use std::time::Duration;

use burn::optim::momentum::MomentumConfig;
use burn::optim::{GradientsParams, ModuleOptimizer, SgdConfig};
use flotilla_engine::ParamLayout;
use flotilla_engine::any_module::{put_grads, take_grads, write_params};

use crate::data_parallel_tests::{Net, batch, net, params, world};
use crate::{AsyncAllReduce, AsyncConfig, Correction, CycleConfig, DataParallel};

const RANKS: usize = 2;
const STEPS: usize = 9;
const MOMENTUM: f32 = 0.9;

/// The learning rate of step `j`: changes every step, so that applying with another step's
/// rate shows.
fn lr(j: usize) -> f64 {
    0.02 + 0.03 * (j as f64 * 0.7).cos().abs()
}

fn sgd() -> ModuleOptimizer {
    SgdConfig::new()
        .with_momentum(Some(
            MomentumConfig::new().with_momentum(f64::from(MOMENTUM)),
        ))
        .init()
}

fn config(staleness: usize, predict: bool) -> AsyncConfig {
    AsyncConfig {
        staleness,
        correction: if predict {
            Correction::Predict { momentum: MOMENTUM }
        } else {
            Correction::None
        },
        cycle: CycleConfig {
            cycle: Duration::from_millis(1),
            ..CycleConfig::default()
        },
    }
}

/// One rank's run: its parameters after each step (after a drain when `drain_after` is that
/// step), then after `finish`.
fn rank(
    group: std::sync::Arc<dyn crate::ProcessGroup>,
    model: Net,
    c: AsyncConfig,
    drain_after: Option<usize>,
) -> Vec<Vec<f32>> {
    let r = group.rank();
    let dp = DataParallel::new(group, &model).expect("dp");
    let mut model = dp.broadcast_model(model).expect("model");
    let mut optim = dp.broadcast_optimizer(sgd()).expect("optimizer");
    let mut ar = AsyncAllReduce::start(dp, &model, c).expect("start");
    let mut after = Vec::new();
    for j in 0..STEPS {
        let at = ar.gradient_point(&model).expect("gradient point");
        let (x, y) = batch(j, r, RANKS);
        let loss = (at.forward(x) - y).powf_scalar(2.0).mean();
        let grads = GradientsParams::from_grads(loss.backward(), &at);
        model = ar.step(model, grads, &mut optim, lr(j)).expect("step");
        if drain_after == Some(j) {
            model = ar.drain(model, &mut optim, lr(j)).expect("drain");
        }
        after.push(params(&model));
    }
    let (model, _, stats) = ar.finish(model, &mut optim, lr(STEPS - 1)).expect("finish");
    assert!(stats.tensors > 0, "the cycle reduced nothing");
    after.push(params(&model));
    after
}

fn run(c: AsyncConfig, drain_after: Option<usize>) -> Vec<Vec<Vec<f32>>> {
    let models: Vec<Net> = (0..RANKS as u64).map(|r| net(r, 8)).collect();
    let handles: Vec<_> = world(RANKS)
        .into_iter()
        .zip(models)
        .map(|(g, m)| std::thread::spawn(move || rank(g, m, c, drain_after)))
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank"))
        .collect()
}

/// Where the formula computes a step's gradient: `w_u` predicted over `k` steps in flight
/// from the updates `ws` so far (or `w_u` itself).
fn gradient_point(ws: &[Vec<f32>], k: usize, predict: bool) -> Vec<f32> {
    let u = ws.len() - 1;
    if !predict || k == 0 || u == 0 {
        return ws[u].clone();
    }
    let beta = if u >= 2 { MOMENTUM } else { 0.0 };
    let (c, q, q2) = (&ws[u], &ws[u - 1], &ws[u.saturating_sub(2)]);
    let k = k as f32;
    (0..c.len())
        .map(|i| c[i] + k * ((1.0 + beta) * (c[i] - q[i]) - beta * (q[i] - q2[i])))
        .collect()
}

/// Rank `r`'s gradient of step `j` at parameters `at`.
fn grad(model: &Net, layout: &ParamLayout, at: &[f32], j: usize, r: usize) -> Vec<f32> {
    let m = write_params(model.clone(), layout, at).expect("write");
    let (x, y) = batch(j, r, RANKS);
    let loss = (m.forward(x) - y).powf_scalar(2.0).mean();
    let mut grads = GradientsParams::from_grads(loss.backward(), &m);
    let mut g = vec![0.0; layout.total];
    take_grads(&m, &mut grads, layout, 0..layout.params.len(), &mut g).expect("grads");
    g
}

/// The serial formula of the module documentation of [`AsyncAllReduce`].
fn reference(staleness: usize, predict: bool, drain_after: Option<usize>) -> Vec<Vec<f32>> {
    let mut model = net(0, 8);
    let layout = ParamLayout::of(&model);
    let mut optim = sgd();
    let mut ws = vec![params(&model)];
    let mut in_flight: VecDeque<Vec<f32>> = VecDeque::new();
    let mut after = Vec::new();
    let mut apply = |model: Net, ws: &mut Vec<Vec<f32>>, g: &[f32], lr: f64| {
        let mut grads = GradientsParams::new();
        put_grads(&model, &mut grads, &layout, 0..layout.params.len(), g).expect("put");
        let model = optim.step(lr, model, grads);
        ws.push(params(&model));
        model
    };
    for j in 0..STEPS {
        let at = gradient_point(&ws, in_flight.len(), predict);
        let (g0, g1) = (
            grad(&model, &layout, &at, j, 0),
            grad(&model, &layout, &at, j, 1),
        );
        in_flight.push_back(g0.iter().zip(&g1).map(|(a, b)| (a + b) * 0.5).collect());
        let keep = if j == 0 { 0 } else { staleness };
        while in_flight.len() > keep {
            let g = in_flight.pop_front().expect("in flight");
            model = apply(model, &mut ws, &g, lr(j));
        }
        if drain_after == Some(j) {
            while let Some(g) = in_flight.pop_front() {
                model = apply(model, &mut ws, &g, lr(j));
            }
            ws = vec![ws[ws.len() - 1].clone()];
        }
        after.push(ws[ws.len() - 1].clone());
    }
    while let Some(g) = in_flight.pop_front() {
        model = apply(model, &mut ws, &g, lr(STEPS - 1));
    }
    after.push(params(&model));
    after
}

#[test]
fn async_all_reduce_of_a_user_module_follows_the_serial_formula_bitwise() {
    let cases = [
        (1, true, None),
        (2, true, Some(4)),
        (1, false, None),
        (0, true, None),
    ];
    for (staleness, predict, drain_after) in cases {
        let expected = reference(staleness, predict, drain_after);
        assert_ne!(
            expected[0],
            expected[STEPS - 1],
            "the reference did not train"
        );
        let ranks = run(config(staleness, predict), drain_after);
        for (r, got) in ranks.iter().enumerate() {
            for (j, (g, e)) in got.iter().zip(&expected).enumerate() {
                assert!(
                    g == e,
                    "staleness {staleness}, predict {predict}, drain after {drain_after:?}: \
                     rank {r} differs from the formula after step {j}"
                );
            }
        }
    }
}
