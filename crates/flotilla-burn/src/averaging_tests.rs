//! [`ModelAveraging`] against its serial formula: every rank's model steps alone on its own
//! shard with its own optimizer, and every `every` steps all of them become the mean. Two
//! in-memory ranks equal the formula run in one process bit for bit (`(a + b) · ½`); three
//! within f32 rounding (the ring sums in another order).

use burn::optim::momentum::MomentumConfig;
use burn::optim::{GradientsParams, ModuleOptimizer, SgdConfig};
use flotilla_engine::ParamLayout;
use flotilla_engine::any_module::write_params;

use crate::data_parallel_tests::{Net, batch, max_relative_difference, net, params, world};
use crate::{DataParallel, DistError, ModelAveraging};

const STEPS: usize = 10;
const EVERY: u64 = 3;

fn sgd() -> ModuleOptimizer {
    SgdConfig::new()
        .with_momentum(Some(MomentumConfig::new().with_momentum(0.9)))
        .init()
}

/// One local step of `model` on rank `r`'s shard of step `j` (of `n` ranks).
fn local_step(optim: &mut ModuleOptimizer, model: Net, j: usize, r: usize, n: usize) -> Net {
    let (x, y) = batch(j, r, n);
    let loss = (model.forward(x) - y).powf_scalar(2.0).mean();
    let grads = GradientsParams::from_grads(loss.backward(), &model);
    optim.step(0.05, model, grads)
}

/// Every rank's parameters after each step.
fn run(n: usize) -> Vec<Vec<Vec<f32>>> {
    let models: Vec<Net> = (0..n as u64).map(|r| net(r, 8)).collect();
    let handles: Vec<_> = world(n)
        .into_iter()
        .zip(models)
        .map(|(g, m)| {
            std::thread::spawn(move || {
                let r = g.rank();
                let dp = DataParallel::new(g, &m).expect("dp");
                let mut model = dp.broadcast_model(m).expect("model");
                let mut avg = ModelAveraging::new(dp, EVERY).expect("averaging");
                let mut optim = sgd();
                let mut after = Vec::new();
                for j in 0..STEPS {
                    model = local_step(&mut optim, model, j, r, n);
                    model = avg.step(model).expect("average");
                    after.push(params(&model));
                }
                after
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank"))
        .collect()
}

/// `n` replicas of rank 0's model, each with its own optimizer, averaged every [`EVERY`]
/// steps; the parameters of replica 0 after each step (all equal after an averaging).
fn reference(n: usize) -> Vec<Vec<Vec<f32>>> {
    let start = net(0, 8);
    let layout = ParamLayout::of(&start);
    let mut models: Vec<Net> = (0..n).map(|_| start.clone()).collect();
    let mut optims: Vec<ModuleOptimizer> = (0..n).map(|_| sgd()).collect();
    let mut after = vec![Vec::new(); n];
    for j in 0..STEPS {
        models = models
            .into_iter()
            .enumerate()
            .map(|(r, m)| local_step(&mut optims[r], m, j, r, n))
            .collect();
        if (j as u64 + 1).is_multiple_of(EVERY) {
            let flats: Vec<Vec<f32>> = models.iter().map(params).collect();
            let mean: Vec<f32> = (0..layout.total)
                .map(|i| flats.iter().map(|f| f[i]).sum::<f32>() * (1.0 / n as f32))
                .collect();
            models = models
                .into_iter()
                .map(|m| write_params(m, &layout, &mean).expect("write"))
                .collect();
        }
        for (r, m) in models.iter().enumerate() {
            after[r].push(params(m));
        }
    }
    after
}

#[test]
fn model_averaging_follows_local_sgd_averaged_every_k_steps() {
    for n in [2, 3] {
        let expected = reference(n);
        let ranks = run(n);
        assert_ne!(
            expected[0][EVERY as usize - 2],
            expected[1][EVERY as usize - 2],
            "the replicas did not drift apart between averagings"
        );
        for (r, got) in ranks.iter().enumerate() {
            for (j, (g, e)) in got.iter().zip(&expected[r]).enumerate() {
                let d = max_relative_difference(g, e);
                let ok = if n == 2 { g == e } else { d <= 1e-6 };
                assert!(
                    ok,
                    "{n} ranks: rank {r} after step {j}: relative difference {d}"
                );
            }
            assert_eq!(
                got[STEPS - 2],
                ranks[0][STEPS - 2],
                "rank {r} differs from rank 0 right after an averaging"
            );
        }
    }
}

#[test]
fn averaging_every_zero_steps_is_refused() {
    let g = world(1).remove(0);
    let m = net(0, 4);
    let dp = DataParallel::new(g, &m).expect("dp");
    match ModelAveraging::new(dp, 0) {
        Err(DistError::Config(why)) => assert!(why.contains("every 0 steps"), "{why}"),
        other => panic!("expected a config error, got {other:?}"),
    }
}
