//! [`crate::ShardOptimizer`]: the shards of `n` ranks stepped with burn's optimizers equal,
//! bit for bit, the whole model stepped by the engine (SGD with momentum, weight decay and
//! Nesterov; Adam with L2 decay; AdamW decaying matrices only), shards cut across tensor
//! boundaries, stepped a chunk of pieces at a time or all at once; each shard's state holds
//! its own share of the values, and survives a save and load.

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

/// The shard's gradient as `s` takes it: its pieces' values of the whole `g`, in flat order.
pub(crate) fn shard_of(s: &ShardOptimizer, g: &[f32]) -> Vec<f32> {
    s.pieces()
        .iter()
        .flat_map(|p| g[p.range.clone()].iter().copied())
        .collect()
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
                    let mut s =
                        ShardOptimizer::new(&spec, whole.layout(), &owned(total, n, r), "flex")
                            .expect("shard");
                    // Burn steps a chunk of pieces at a time: one piece (chunks of 1), two,
                    // or the shard at once.
                    s.set_step_chunk([1, 8, usize::MAX][r]);
                    s
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
                    s.step(&mut mine, &shard_of(s, &g), 0.5 + step as f64 * 0.1)
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
        a.step(&mut pa, &shard_of(&a, &gradient(total, step)), 0.1)
            .expect("step");
    }
    let mut b = ShardOptimizer::new(spec, whole.layout(), &shard, "flex").expect("shard");
    b.load_state(a.state().expect("state")).expect("load");
    let mut pb = pa.clone();
    a.step(&mut pa, &shard_of(&a, &gradient(total, 3)), 0.1)
        .expect("step");
    b.step(&mut pb, &shard_of(&b, &gradient(total, 3)), 0.1)
        .expect("step");
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&pa), bits(&pb));
}

/// Adam state after two steps of the shard `owned(total, n, r)` of the tiny LM.
pub(crate) fn stepped_shard_state(n: usize, r: usize) -> Vec<u8> {
    let spec = &optimizers()[2];
    let whole = engine(spec);
    let total = whole.num_params();
    let mut params = vec![0.0; total];
    whole.read_params(&mut params).expect("read");
    let mut s = ShardOptimizer::new(spec, whole.layout(), &owned(total, n, r), "flex").expect("s");
    for step in 0..2 {
        s.step(&mut params, &shard_of(&s, &gradient(total, step)), 0.1)
            .expect("step");
    }
    s.state().expect("state")
}

#[test]
fn a_shard_state_of_another_cut_is_refused_naming_the_tensor_and_both_shapes() {
    let spec = &optimizers()[2];
    let whole = engine(spec);
    let total = whole.num_params();
    let mut three =
        ShardOptimizer::new(spec, whole.layout(), &owned(total, 3, 1), "flex").expect("shard");
    // The same shard's state loads; rank 1 of 2's does not fit rank 1 of 3's pieces.
    three
        .load_state(stepped_shard_state(3, 1))
        .expect("its own cut");
    let err = three
        .load_state(stepped_shard_state(2, 1))
        .expect_err("another cut");
    let crate::EngineError::StateShape {
        tensor,
        expected,
        got,
        ..
    } = &err
    else {
        panic!("not a shape error: {err}");
    };
    // burn names Adam's state `{id}.momentum.moment_1` (the first, alphabetically).
    assert_eq!(tensor, "0.momentum.moment_1", "{err}");
    assert_eq!(expected, &vec![three.pieces()[0].range.len()], "{err}");
    assert_ne!(got, expected);
    let text = err.to_string();
    assert!(
        text.contains(tensor.as_str()) && text.contains("piece 0"),
        "{text}"
    );
    // After the refusal the optimizer still steps (burn never saw the state).
    let mut params = vec![0.0; total];
    whole.read_params(&mut params).expect("read");
    let g = shard_of(&three, &gradient(total, 0));
    three
        .step(&mut params, &g, 0.1)
        .expect("step after a refusal");
}

#[test]
fn a_whole_model_state_of_another_model_is_refused_naming_the_parameter() {
    let spec = &optimizers()[2];
    let mut a = engine(spec);
    let other = TINY_LM.replace("vocab: 5", "vocab: 6");
    let model = ModelSpec::from_yaml(&other, "tiny-lm-6").expect("spec");
    let mut b = BurnEngine::new(&model, spec, "flex", 7).expect("engine");
    for e in [&mut a, &mut b] {
        let g = gradient(e.num_params(), 0);
        e.apply_grads(&g, 0.1).expect("step");
    }
    let err = a
        .load_optimizer_state(&b.optimizer_state().expect("state"))
        .expect_err("another model's state");
    let text = err.to_string();
    assert!(
        matches!(&err, crate::EngineError::StateShape { expected, got, .. }
            if expected == &vec![5, 3] && got == &vec![6, 3]),
        "{text}"
    );
    assert!(text.contains("layers.0.weight"), "{text}");
    a.load_optimizer_state(&a.optimizer_state().expect("state"))
        .expect("its own state");
}
