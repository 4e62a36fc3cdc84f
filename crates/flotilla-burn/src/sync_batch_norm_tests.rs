//! A user's model with [`SyncBatchNorm`] on 2 in-memory ranks, each with half of every batch,
//! trains as the same model with burn's `BatchNorm` on one rank with the whole batch.

use std::sync::Arc;
use std::time::Duration;

use burn::module::Module;
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig};
use burn::optim::{GradientsParams, SgdConfig};
use burn::prelude::*;
use burn::tensor::TensorData;
use flotilla_engine::ParamLayout;
use flotilla_engine::any_module::{buffer_layout, read_buffers, read_params};
use flotilla_group::ProcessGroup;
use flotilla_tcp::{CommConfig, TcpGroup};

use crate::{BatchNormSync, DataParallel, SyncBatchNorm, batch_norm_sync};

const GLOBAL: usize = 16;
const STEPS: usize = 20;

/// The user's model with a synchronized batch norm.
#[derive(Module, Debug)]
struct Synced {
    hidden: Linear,
    norm: SyncBatchNorm,
    out: Linear,
}

/// The same model with burn's own batch norm.
#[derive(Module, Debug)]
struct Plain {
    hidden: Linear,
    norm: BatchNorm,
    out: Linear,
}

fn device() -> Device {
    Device::flex().autodiff()
}

fn plain() -> Plain {
    let _guard = crate::SEED_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let d = device();
    d.seed(5);
    let m = Plain {
        hidden: LinearConfig::new(4, 6).init(&d),
        norm: BatchNormConfig::new(6).init(&d),
        out: LinearConfig::new(6, 2).init(&d),
    };
    let layout = ParamLayout::of(&m);
    let mut flat = vec![0.0; layout.total];
    read_params(&m, &layout, &mut flat).expect("draw the parameters");
    m
}

/// The synchronized model with the plain one's parameters.
fn synced(sync: &BatchNormSync) -> Synced {
    let p = plain();
    let d = device();
    let mut norm = SyncBatchNorm::new(&BatchNormConfig::new(6), &d, sync);
    norm.norm = p.norm;
    Synced {
        hidden: p.hidden,
        norm,
        out: p.out,
    }
}

/// Rows `rows` of step `step`'s global batch: 4 inputs, 2 targets, on different scales per
/// feature so that the normalization matters.
fn batch(step: usize, rows: std::ops::Range<usize>) -> (Tensor<2>, Tensor<2>) {
    let (mut x, mut y) = (Vec::new(), Vec::new());
    for i in rows.clone() {
        let t = (step * GLOBAL + i) as f32;
        let v = [
            (t * 0.37).sin() * 3.0 + 1.0,
            (t * 0.11).cos(),
            (t * 0.05).sin() * 0.2,
            (t * 0.7).cos() * 5.0,
        ];
        x.extend_from_slice(&v);
        y.extend_from_slice(&[v[0] * v[1] - v[2], (v[3] * 0.2).tanh()]);
    }
    let n = rows.len();
    (
        Tensor::from_data(TensorData::new(x, [n, 4]), &device()),
        Tensor::from_data(TensorData::new(y, [n, 2]), &device()),
    )
}

/// Parameters then running statistics.
fn state<M: Module>(m: &M) -> Vec<f32> {
    let (p, b) = (ParamLayout::of(m), buffer_layout(m));
    let mut flat = vec![0.0; p.total + b.total];
    read_params(m, &p, &mut flat[..p.total]).expect("params");
    read_buffers(m, &b, &mut flat[p.total..]).expect("buffers");
    flat
}

fn loss(pred: Tensor<2>, y: Tensor<2>) -> Tensor<1> {
    (pred - y).powf_scalar(2.0).mean()
}

fn alone() -> Vec<f32> {
    let mut m = plain();
    let mut optim = SgdConfig::new().init();
    for step in 0..STEPS {
        let (x, y) = batch(step, 0..GLOBAL);
        let l = loss(m.out.forward(m.norm.forward(m.hidden.forward(x))), y);
        let grads = GradientsParams::from_grads(l.backward(), &m);
        m = optim.step(0.05, m, grads);
    }
    state(&m.valid())
}

fn rank(group: Arc<dyn ProcessGroup>, sync: bool) -> Vec<f32> {
    let r = group.rank();
    let stats = batch_norm_sync(&group).expect("split");
    let mut m = synced(&stats);
    if !sync {
        // The control: the same loop with each rank's own statistics.
        let solo = TcpGroup::in_memory(1, CommConfig::new(Some(0), 1)).expect("solo");
        let solo: Arc<dyn ProcessGroup> = Arc::new(solo.into_iter().next().expect("one"));
        m.norm = SyncBatchNorm::new(
            &BatchNormConfig::new(6),
            &device(),
            &batch_norm_sync(&solo).expect("split"),
        );
        m.norm.norm = plain().norm;
    }
    let mut dp = DataParallel::new(group, &m).expect("dp");
    let mut optim = SgdConfig::new().init();
    let half = GLOBAL / 2;
    for step in 0..STEPS {
        let (x, y) = batch(step, r * half..(r + 1) * half);
        let l = loss(m.out.forward(m.norm.forward(m.hidden.forward(x))), y);
        let grads = GradientsParams::from_grads(l.backward(), &m);
        stats.check().expect("statistics");
        let grads = dp.average(grads, &m).expect("average");
        m = optim.step(0.05, m, grads);
    }
    state(&m.valid())
}

fn two_ranks(sync: bool) -> Vec<Vec<f32>> {
    let groups: Vec<Arc<dyn ProcessGroup>> = TcpGroup::in_memory(
        2,
        CommConfig::new(Some(0), 2).with_timeout(Duration::from_secs(10)),
    )
    .expect("world")
    .into_iter()
    .map(|c| Arc::new(c) as Arc<dyn ProcessGroup>)
    .collect();
    let handles: Vec<_> = groups
        .into_iter()
        .map(|g| std::thread::spawn(move || rank(g, sync)))
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank"))
        .collect()
}

fn max_relative(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

#[test]
fn synchronized_batch_norm_on_two_ranks_trains_as_one_rank_with_the_whole_batch() {
    let one = alone();
    for (r, s) in two_ranks(true).iter().enumerate() {
        let e = max_relative(s, &one);
        assert!(
            e <= 1e-5,
            "rank {r}: {e:e} from one rank after {STEPS} steps"
        );
    }
    // Each rank's own statistics: the same comparison sees the difference.
    let own = two_ranks(false);
    let e = max_relative(&own[0], &one);
    assert!(
        e > 1e-3,
        "unsynchronized ranks are only {e:e} from one rank"
    );
}
