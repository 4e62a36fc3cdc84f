//! A user's own burn module trained on N in-memory ranks equals the same module trained on
//! one rank with the same global batch; the parameter-list check names a differing rank.
//! The model, its data and the in-memory world are shared with the tests of the other modes.

use std::sync::Arc;
use std::time::Duration;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, GradientsParams, ModuleOptimizer, SgdConfig};
use burn::prelude::*;
use burn::tensor::TensorData;
use flotilla_engine::ParamLayout;
use flotilla_engine::any_module::read_params;
use flotilla_group::ProcessGroup;
use flotilla_tcp::{CommConfig, TcpGroup};

use crate::{DataParallel, DistError};

/// A user's model, written in plain burn.
#[derive(Module, Debug)]
pub(crate) struct Net {
    hidden: Linear,
    act: Relu,
    out: Linear,
}

impl Net {
    fn new(width: usize, device: &Device) -> Self {
        Net {
            hidden: LinearConfig::new(3, width).init(device),
            act: Relu::new(),
            out: LinearConfig::new(width, 2).init(device),
        }
    }

    pub(crate) fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.out.forward(self.act.forward(self.hidden.forward(x)))
    }
}

const GLOBAL_BATCH: usize = 12;
pub(crate) const STEPS: usize = 50;

pub(crate) fn device() -> Device {
    Device::flex().autodiff()
}

/// Rank `rank`'s model, initialised from its own seed (so only a broadcast makes them agree).
/// Its parameters are drawn now (burn initialises them lazily, on first use).
pub(crate) fn net(rank: u64, width: usize) -> Net {
    let _guard = crate::SEED_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let device = device();
    device.seed(1000 + rank);
    let net = Net::new(width, &device);
    params(&net);
    net
}

pub(crate) fn world(n: usize) -> Vec<Arc<dyn ProcessGroup>> {
    TcpGroup::in_memory(
        n,
        CommConfig::new(Some(0), n).with_timeout(Duration::from_secs(10)),
    )
    .expect("world")
    .into_iter()
    .map(|c| Arc::new(c) as Arc<dyn ProcessGroup>)
    .collect()
}

/// Sample `i` of step `step`'s global batch: 3 inputs, 2 targets.
fn sample(step: usize, i: usize) -> ([f32; 3], [f32; 2]) {
    let t = (step * GLOBAL_BATCH + i) as f32;
    let x = [(t * 0.37).sin(), (t * 0.11).cos(), (t * 0.05).sin() * 2.0];
    ([x[0], x[1], x[2]], [x[0] * x[1] - x[2], x[2].tanh()])
}

/// This rank's interleaved shard of step `step`'s global batch.
pub(crate) fn batch(step: usize, rank: usize, n: usize) -> (Tensor<2>, Tensor<2>) {
    let (mut xs, mut ys) = (Vec::new(), Vec::new());
    for i in (rank..GLOBAL_BATCH).step_by(n) {
        let (x, y) = sample(step, i);
        xs.extend(x);
        ys.extend(y);
    }
    let rows = xs.len() / 3;
    let device = device();
    (
        Tensor::from_data(TensorData::new(xs, [rows, 3]), &device),
        Tensor::from_data(TensorData::new(ys, [rows, 2]), &device),
    )
}

pub(crate) fn params(model: &Net) -> Vec<f32> {
    let layout = ParamLayout::of(model);
    let mut flat = vec![0.0; layout.total];
    read_params(model, &layout, &mut flat).expect("read");
    flat
}

/// The optimizers of the equality test: SGD with momentum sees a wrongly scaled average (Adam
/// would hide it: it divides the scale out).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Optim {
    Sgd,
    Adam,
}

impl Optim {
    pub(crate) fn init(self) -> ModuleOptimizer {
        match self {
            Optim::Sgd => SgdConfig::new()
                .with_momentum(Some(MomentumConfig::new().with_momentum(0.9)))
                .init(),
            Optim::Adam => AdamConfig::new().init(),
        }
    }
}

/// Trains rank `rank`'s model for [`STEPS`] steps; returns its final parameters.
fn train(group: Arc<dyn ProcessGroup>, model: Net, bucket_bytes: usize, how: Optim) -> Vec<f32> {
    let (rank, n) = (group.rank(), group.size());
    let mut dp = DataParallel::with_bucket_bytes(group, &model, bucket_bytes).expect("dp");
    let mut model = dp.broadcast_model(model).expect("broadcast model");
    let mut optim = dp
        .broadcast_optimizer(how.init())
        .expect("broadcast optimizer");
    for step in 0..STEPS {
        let (x, y) = batch(step, rank, n);
        let loss = (model.forward(x) - y).powf_scalar(2.0).mean();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let grads = dp.average(grads, &model).expect("average");
        model = optim.step(0.01, model, grads);
    }
    params(&model)
}

/// The user's loop without Flotilla: rank 0's model on the whole global batch.
pub(crate) fn train_alone(how: Optim) -> Vec<f32> {
    let mut model = net(0, 16);
    let mut optim = how.init();
    for step in 0..STEPS {
        let (x, y) = batch(step, 0, 1);
        let loss = (model.forward(x) - y).powf_scalar(2.0).mean();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(0.01, model, grads);
    }
    params(&model)
}

/// Trains on `n` in-memory ranks; returns every rank's final parameters.
fn run(n: usize, bucket_bytes: usize, how: Optim) -> Vec<Vec<f32>> {
    // Models are built here, one after another, because the backend's seed is process-wide.
    let models: Vec<Net> = (0..n as u64).map(|r| net(r, 16)).collect();
    let handles: Vec<_> = world(n)
        .into_iter()
        .zip(models)
        .map(|(g, m)| std::thread::spawn(move || train(g, m, bucket_bytes, how)))
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank"))
        .collect()
}

pub(crate) fn max_relative_difference(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "parameter counts differ");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / x.abs().max(y.abs()).max(1e-3))
        .fold(0.0, f32::max)
}

#[test]
fn n_ranks_train_a_user_module_as_the_plain_loop_does_on_the_same_global_batch() {
    let initial = params(&net(0, 16));
    // Buckets of 64 bytes: several buckets per step, each its own all-reduce.
    let runs = [
        (Optim::Sgd, 1, 64),
        (Optim::Sgd, 2, 64),
        (Optim::Sgd, 3, 1 << 20),
        (Optim::Sgd, 4, 64),
        (Optim::Adam, 2, 64),
    ];
    for (how, n, bucket_bytes) in runs {
        let reference = train_alone(how);
        assert!(
            max_relative_difference(&reference, &initial) > 1e-2,
            "the {how:?} reference did not train"
        );
        let ranks = run(n, bucket_bytes, how);
        for (rank, p) in ranks.iter().enumerate() {
            assert_eq!(
                p, &ranks[0],
                "{n} ranks: rank {rank}'s replica differs from rank 0's"
            );
        }
        let d = max_relative_difference(&ranks[0], &reference);
        assert!(
            d <= 1e-5,
            "{how:?}, {n} ranks vs the plain loop: relative difference {d} > 1e-5"
        );
    }
}

/// Ranks whose shares of the global batch differ (12 samples on 5 ranks: 3, 3, 2, 2, 2)
/// train as the plain loop on the whole batch when each gradient is weighted by its samples
/// (`average_over_samples`), on every rank alike.
#[test]
fn ranks_with_unequal_batches_weighted_by_their_samples_train_as_the_plain_loop() {
    let reference = train_alone(Optim::Sgd);
    let n = 5;
    let models: Vec<Net> = (0..n as u64).map(|r| net(r, 16)).collect();
    let handles: Vec<_> = world(n)
        .into_iter()
        .zip(models)
        .map(|(group, model)| {
            std::thread::spawn(move || {
                let (rank, n) = (group.rank(), group.size());
                let mut dp = DataParallel::new(group, &model).expect("dp");
                let mut model = dp.broadcast_model(model).expect("broadcast model");
                let mut optim = Optim::Sgd.init();
                for step in 0..STEPS {
                    let (x, y) = batch(step, rank, n);
                    let samples = x.dims()[0];
                    let loss = (model.forward(x) - y).powf_scalar(2.0).mean();
                    let grads = GradientsParams::from_grads(loss.backward(), &model);
                    let grads = dp.average_over_samples(grads, &model, samples);
                    model = optim.step(0.01, model, grads.expect("average"));
                }
                params(&model)
            })
        })
        .collect();
    let ranks: Vec<Vec<f32>> = handles
        .into_iter()
        .map(|h| h.join().expect("rank"))
        .collect();
    for p in &ranks {
        assert_eq!(p, &ranks[0], "the replicas differ");
    }
    let d = max_relative_difference(&ranks[0], &reference);
    assert!(d <= 1e-5, "5 unequal ranks vs the plain loop: {d} > 1e-5");
}

/// One Adam step on `model` with the gradient of step `step`'s whole global batch.
fn adam_step(optim: &mut ModuleOptimizer, model: Net, step: usize) -> Net {
    let (x, y) = batch(step, 0, 1);
    let loss = (model.forward(x) - y).powf_scalar(2.0).mean();
    let grads = GradientsParams::from_grads(loss.backward(), &model);
    optim.step(0.01, model, grads)
}

#[test]
fn rank_0s_optimizer_state_reaches_every_rank() {
    let models: Vec<Net> = (0..2).map(|r| net(r, 4)).collect();
    let handles: Vec<_> = world(2)
        .into_iter()
        .zip(models)
        .map(|(g, m)| {
            std::thread::spawn(move || {
                let rank = g.rank();
                let dp = DataParallel::new(g, &m).expect("dp");
                let model = dp.broadcast_model(m).expect("model");
                let mut optim: ModuleOptimizer = AdamConfig::new().init();
                if rank == 0 {
                    // Only rank 0's optimizer has moments (from a step on a copy of the model).
                    adam_step(&mut optim, model.clone(), 0);
                }
                let mut optim = dp.broadcast_optimizer(optim).expect("optimizer");
                // The same step from the same parameters: equal only if the moments are.
                params(&adam_step(&mut optim, model, 1))
            })
        })
        .collect();
    let after: Vec<Vec<f32>> = handles
        .into_iter()
        .map(|h| h.join().expect("rank"))
        .collect();
    assert_eq!(
        after[0], after[1],
        "rank 1 stepped without rank 0's optimizer state"
    );
}

#[test]
fn a_rank_with_another_model_is_named_on_every_rank() {
    let models: Vec<Net> = vec![net(0, 16), net(1, 16), net(2, 8)];
    let handles: Vec<_> = world(3)
        .into_iter()
        .zip(models)
        .map(|(g, m)| std::thread::spawn(move || DataParallel::new(g, &m).map(|_| ())))
        .collect();
    for (rank, h) in handles.into_iter().enumerate() {
        match h.join().expect("rank") {
            Err(DistError::ModelsDiffer(why)) => assert_eq!(
                why,
                "rank 2 has `hidden.weight [3, 8]` where rank 0 has `hidden.weight [3, 16]` \
                 (parameter tensor 0)",
                "rank {rank}"
            ),
            other => panic!("rank {rank}: expected ModelsDiffer, got {other:?}"),
        }
    }
}

/// A user's model with batch norm: its running statistics are buffers, not parameters.
#[derive(Module, Debug)]
struct NormNet {
    norm: burn::nn::BatchNorm,
    out: Linear,
}

#[test]
fn batch_norm_statistics_are_synced_from_rank_0_or_averaged_and_never_summed_as_gradients() {
    use crate::BufferSync;
    use flotilla_engine::any_module::{buffer_layout, read_buffers};
    let buffers = |m: &NormNet| {
        let layout = buffer_layout(m);
        let mut flat = vec![0.0; layout.total];
        read_buffers(m, &layout, &mut flat).expect("buffers");
        flat
    };
    let models: Vec<NormNet> = (0..2)
        .map(|r| {
            let _guard = crate::SEED_LOCK.lock().unwrap_or_else(|p| p.into_inner());
            device().seed(r);
            NormNet {
                norm: burn::nn::BatchNormConfig::new(3).init(&device()),
                out: LinearConfig::new(3, 2).init(&device()),
            }
        })
        .collect();
    let handles: Vec<_> = world(2)
        .into_iter()
        .zip(models)
        .map(|(g, m)| {
            std::thread::spawn(move || {
                let rank = g.rank();
                let mut dp = DataParallel::new(g, &m).expect("dp");
                assert_eq!(
                    dp.layout().params.len(),
                    4,
                    "running statistics are not parameters"
                );
                let model = dp.broadcast_model(m).expect("model");
                let mut optim = Optim::Sgd.init();
                let mut step = |dp: &mut DataParallel, model: NormNet, step: usize| {
                    // Each rank's own batch: its running statistics drift apart.
                    let (x, y) = batch(step, rank, 2);
                    let loss = (model.out.forward(model.norm.forward(x)) - y)
                        .powf_scalar(2.0)
                        .mean();
                    let grads = GradientsParams::from_grads(loss.backward(), &model);
                    let grads = dp.average(grads, &model).expect("average");
                    optim.step(0.01, model, grads)
                };
                // burn's copies of a model share its running statistics: each check works on
                // the model itself, after steps that made the ranks' statistics differ.
                let model = step(&mut dp, model, 0);
                let model = step(&mut dp, model, 1);
                let own = buffers(&model.valid());
                let model = dp.sync_buffers(model, BufferSync::Average).expect("sync");
                let mean = buffers(&model.valid());
                let model = step(&mut dp, model, 2);
                let own2 = buffers(&model.valid());
                let model = dp.sync_buffers(model, BufferSync::FromRank0).expect("sync");
                (own, mean, own2, buffers(&model.valid()))
            })
        })
        .collect();
    let r: Vec<_> = handles
        .into_iter()
        .map(|h| h.join().expect("rank"))
        .collect();
    assert_eq!(r[0].0.len(), 6, "running mean and variance of 3 features");
    assert_ne!(r[0].0, r[1].0, "the ranks' statistics did not drift apart");
    for (i, m) in r[0].1.iter().enumerate() {
        let expected = (r[0].0[i] + r[1].0[i]) / 2.0;
        assert!(
            (m - expected).abs() <= 1e-6,
            "buffer {i}: {m} is not the mean {expected}"
        );
    }
    assert_eq!(
        r[0].1, r[1].1,
        "the averaged statistics differ between ranks"
    );
    assert_ne!(r[0].2, r[1].2, "the statistics did not drift apart again");
    assert_eq!(r[1].3, r[0].2, "rank 1 did not take rank 0's statistics");
    assert_eq!(r[0].3, r[0].2, "rank 0's statistics changed");
}
