//! [`crate::ShardOptimizer`]: the shards of `n` ranks stepped with burn's optimizers equal,
//! bit for bit, the whole model stepped by the engine (SGD with momentum, weight decay and
//! Nesterov; Adam with L2 decay; AdamW decaying matrices only), shards cut across tensor
//! boundaries; each shard's state holds its own share of the values, and survives a save
//! and load.

use std::ops::Range;

use crate::{
    BurnEngine, DecayParams, Engine, ModelSpec, ModelState, OptimizerSpec, ShardOptimizer,
    optimizer_state_bytes,
};

const TINY_LM: &str = "name: tiny-lm
input: [4]
layers:
  - embedding: {vocab: 5, dim: 3}
  - pos_embedding: {max_len: 4}
  - layer_norm
  - linear: {out: 5}
";

pub(crate) fn optimizers() -> Vec<OptimizerSpec> {
    vec![
        OptimizerSpec::Sgd {
            lr: 0.05,
            momentum: 0.9,
            dampening: 0.1,
            nesterov: true,
            weight_decay: 0.01,
            decay_params: DecayParams::Matrices,
        },
        OptimizerSpec::Sgd {
            lr: 0.05,
            momentum: 0.9,
            dampening: 0.0,
            nesterov: false,
            weight_decay: 5e-4,
            decay_params: DecayParams::All,
        },
        OptimizerSpec::Adam {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.99,
            epsilon: 1e-8,
            weight_decay: 0.1,
            decay_params: DecayParams::All,
        },
        OptimizerSpec::Adamw {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.99,
            epsilon: 1e-8,
            weight_decay: 0.5,
            decay_params: DecayParams::Matrices,
        },
    ]
}

pub(crate) fn gradient(n: usize, step: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7 + step * 13) % 11) as f32 / 10.0 - 0.45 + i as f32 * 1e-3)
        .collect()
}

/// Rank `r`'s shard of `n`: two ranges (as from two buckets), cut mid-tensor.
pub(crate) fn owned(total: usize, n: usize, r: usize) -> Vec<Range<usize>> {
    let half = total / 2 + 1;
    let cut = |len: usize, i: usize| i * len / n;
    vec![
        cut(half, r)..cut(half, r + 1),
        half + cut(total - half, r)..half + cut(total - half, r + 1),
    ]
}

pub(crate) fn engine(spec: &OptimizerSpec) -> BurnEngine {
    let model = ModelSpec::from_yaml(TINY_LM, "tiny-lm").expect("spec");
    BurnEngine::new(&model, spec, "flex", 7).expect("engine")
}

#[test]
fn shards_step_bitwise_like_the_whole_model() {
    for spec in optimizers() {
        for n in 1..=3 {
            let mut whole = engine(&spec);
            let total = whole.num_params();
            let mut start = vec![0.0; total];
            whole.read_params(&mut start).expect("read");
            let mut shards: Vec<ShardOptimizer> = (0..n)
                .map(|r| {
                    ShardOptimizer::new(&spec, whole.layout(), &owned(total, n, r), "flex")
                        .expect("shard")
                })
                .collect();
            let mut params = start.clone();
            for step in 0..6 {
                let g = gradient(total, step);
                whole
                    .apply_grads(&g, 0.5 + step as f64 * 0.1)
                    .expect("whole step");
                let mut next = params.clone();
                for s in &mut shards {
                    let mut mine = params.clone();
                    s.step(&mut mine, &g, 0.5 + step as f64 * 0.1)
                        .expect("shard step");
                    for p in s.pieces() {
                        next[p.range.clone()].copy_from_slice(&mine[p.range.clone()]);
                    }
                }
                params = next;
            }
            let mut expected = vec![0.0; total];
            whole.read_params(&mut expected).expect("read");
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_ne!(bits(&expected), bits(&start), "{spec:?}: nothing moved");
            assert_eq!(bits(&params), bits(&expected), "{spec:?} on {n} shards");
            let whole_bytes =
                optimizer_state_bytes(&whole.optimizer_state().expect("state")).expect("bytes");
            assert_eq!(whole_bytes, spec.state_slots() * 4 * total as u64);
            for s in &shards {
                let bytes = optimizer_state_bytes(&s.state().expect("state")).expect("bytes");
                assert_eq!(bytes, spec.state_slots() * 4 * s.len() as u64, "{spec:?}");
            }
        }
    }
}

#[test]
fn a_shard_state_saved_and_loaded_continues_bitwise() {
    let spec = &optimizers()[3];
    let whole = engine(spec);
    let total = whole.num_params();
    let mut params = vec![0.0; total];
    whole.read_params(&mut params).expect("read");
    let shard = owned(total, 2, 1);
    let mut a = ShardOptimizer::new(spec, whole.layout(), &shard, "flex").expect("shard");
    let mut pa = params.clone();
    for step in 0..3 {
        a.step(&mut pa, &gradient(total, step), 0.1).expect("step");
    }
    let mut b = ShardOptimizer::new(spec, whole.layout(), &shard, "flex").expect("shard");
    b.load_state(&a.state().expect("state")).expect("load");
    let mut pb = pa.clone();
    a.step(&mut pa, &gradient(total, 3), 0.1).expect("step");
    b.step(&mut pb, &gradient(total, 3), 0.1).expect("step");
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&pa), bits(&pb));
}
