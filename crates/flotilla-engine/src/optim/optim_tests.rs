//! Tests of the optimizer settings: AdamW's weight decay on matrices only, compared number by
//! number with PyTorch's AdamW formula computed by hand, and the checks of the settings.

use crate::{BurnEngine, DecayParams, ModelSpec, ModelState, OptimizerSpec};

/// Every kind of parameter a language model has: token and positional embeddings, a layer
/// norm's weight and bias, a linear weight and bias.
const TINY_LM: &str = "name: tiny-lm
input: [4]
layers:
  - embedding: {vocab: 5, dim: 3}
  - pos_embedding: {max_len: 4}
  - layer_norm
  - linear: {out: 5}
";

/// The parameters that decay with `decay_params: matrices`: every one of two or more
/// dimensions, embeddings included.
const MATRICES: [&str; 3] = ["layers.0.weight", "layers.1.weight", "layers.3.weight"];

const LR: f64 = 0.01;
const BETA1: f64 = 0.9;
const BETA2: f64 = 0.99;
const EPS: f64 = 1e-8;
const DECAY: f64 = 0.5;

fn adamw(decay_params: DecayParams) -> OptimizerSpec {
    OptimizerSpec::Adamw {
        lr: LR,
        beta1: BETA1 as f32,
        beta2: BETA2 as f32,
        epsilon: EPS as f32,
        weight_decay: DECAY as f32,
        decay_params,
    }
}

fn params(e: &BurnEngine) -> Vec<f32> {
    let mut p = vec![0.0; e.num_params()];
    e.read_params(&mut p).expect("read");
    p
}

/// A gradient with values of both signs and several magnitudes, different at each step.
fn gradient(n: usize, step: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7 + step * 13) % 11) as f32 / 10.0 - 0.45)
        .collect()
}

/// PyTorch's AdamW (`torch.optim.AdamW`, amsgrad off) over `grads`, one step each, in f64:
/// `θ ← θ(1 − γλ)` where the parameter decays, then `θ ← θ − γ m̂ / (√v̂ + ε)`.
fn reference(start: &[f32], grads: &[Vec<f32>], decays: &[bool]) -> Vec<f64> {
    let mut theta: Vec<f64> = start.iter().map(|&x| f64::from(x)).collect();
    let (mut m, mut v) = (vec![0.0; theta.len()], vec![0.0; theta.len()]);
    for (t, g) in grads.iter().enumerate() {
        let t = t as i32 + 1;
        for i in 0..theta.len() {
            let g = f64::from(g[i]);
            if decays[i] {
                theta[i] *= 1.0 - LR * DECAY;
            }
            m[i] = BETA1 * m[i] + (1.0 - BETA1) * g;
            v[i] = BETA2 * v[i] + (1.0 - BETA2) * g * g;
            let m_hat = m[i] / (1.0 - BETA1.powi(t));
            let v_hat = v[i] / (1.0 - BETA2.powi(t));
            theta[i] -= LR * m_hat / (v_hat.sqrt() + EPS);
        }
    }
    theta
}

/// Three AdamW steps of the engine against [`reference`]; returns the largest difference.
fn worst_difference(decay_params: DecayParams, decays_by_name: impl Fn(&str) -> bool) -> f64 {
    let spec = ModelSpec::from_yaml(TINY_LM, "tiny-lm").expect("spec");
    let mut e = BurnEngine::new(&spec, &adamw(decay_params), "flex", 3).expect("engine");
    let mut decays = vec![false; e.num_params()];
    for p in &e.layout().params {
        decays[p.offset..p.offset + p.len].fill(decays_by_name(&p.name));
    }
    let start = params(&e);
    let grads: Vec<Vec<f32>> = (0..3).map(|s| gradient(start.len(), s)).collect();
    for g in &grads {
        crate::Engine::apply_grads(&mut e, g, LR).expect("step");
    }
    let want = reference(&start, &grads, &decays);
    params(&e)
        .iter()
        .zip(&want)
        .map(|(&got, want)| (f64::from(got) - want).abs())
        .fold(0.0, f64::max)
}

#[test]
fn adamw_decays_matrices_only_as_pytorch_computes_it() {
    let layout_names: Vec<String> = {
        let spec = ModelSpec::from_yaml(TINY_LM, "tiny-lm").expect("spec");
        let e = BurnEngine::new(&spec, &adamw(DecayParams::Matrices), "flex", 3).expect("e");
        e.layout().params.iter().map(|p| p.name.clone()).collect()
    };
    assert_eq!(
        layout_names,
        [
            "layers.0.weight",
            "layers.1.weight",
            "layers.2.weight",
            "layers.2.bias",
            "layers.3.weight",
            "layers.3.bias"
        ]
    );
    let matrices = |name: &str| MATRICES.contains(&name);
    // f32 against f64 over three steps of size ~lr: well under one decay term (lr·λ·θ ~ 1e-3).
    let tolerance = 1e-6;
    let worst = worst_difference(DecayParams::Matrices, matrices);
    assert!(worst < tolerance, "matrices only: off by {worst}");
    let worst = worst_difference(DecayParams::All, |_| true);
    assert!(worst < tolerance, "every parameter: off by {worst}");
    // The two rules give different numbers: the reference tells them apart.
    let wrong = worst_difference(DecayParams::Matrices, |_| true);
    assert!(
        wrong > 100.0 * tolerance,
        "decay everywhere is only {wrong} off"
    );
}

#[test]
fn decay_params_is_read_and_checked() {
    let spec: OptimizerSpec = serde_norway::from_str(
        "{name: adamw, lr: 0.001, weight_decay: 0.1, decay_params: matrices}",
    )
    .expect("parse");
    assert_eq!(spec.weight_decay(), (0.1, DecayParams::Matrices));
    let default: OptimizerSpec = serde_norway::from_str("{name: sgd, lr: 0.1}").expect("parse");
    assert_eq!(default.weight_decay(), (0.0, DecayParams::All));
    let unknown =
        serde_norway::from_str::<OptimizerSpec>("{name: adam, lr: 0.1, decay_params: vectors}");
    assert!(unknown.is_err());
    let e =
        serde_norway::from_str::<OptimizerSpec>("{name: adam, lr: 0.1, decay_params: matrices}")
            .expect("parse")
            .validate()
            .expect_err("matrices without a decay");
    assert!(e.to_string().contains("weight_decay is 0"), "{e}");
    let e = serde_norway::from_str::<OptimizerSpec>("{name: sgd, lr: 0.1, weight_decay: -1}")
        .expect("parse")
        .validate()
        .expect_err("a negative decay");
    assert!(e.to_string().contains("weight_decay must be"), "{e}");
}
