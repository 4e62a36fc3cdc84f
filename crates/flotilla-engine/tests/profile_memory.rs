//! A pipeline profile's memory, measured by the process's allocator: timing every prefix of
//! a model as a stage (`pipeline/profile.rs`), the prefixes share one model's parameter
//! values, and each makes its gradient for its pass and lets it go. On an MLP of 8 equal
//! linear layers the profile's peak over what the process held before was 23x the model's
//! values with every prefix built with its own values and gradient buffer (11x sharing the
//! values alone), 4.2x now: the values once and the whole model's pass (burn's gradients
//! and the flat gradient).

mod counting;

use std::sync::atomic::Ordering;

use counting::{LIVE, PEAK};
use flotilla_engine::{DecayParams, ModelSpec, OptimizerSpec, profile};

/// An MLP of `n` linear layers of `width` (each with a ReLU), and a head of 10.
fn mlp(width: usize, n: usize) -> ModelSpec {
    let layer = format!("  - linear: {{out: {width}}}\n  - relu\n").repeat(n);
    let yaml = format!("input: [{width}]\nlayers:\n{layer}  - linear: {{out: 10}}\n");
    ModelSpec::from_yaml(&yaml, "mlp").expect("spec")
}

#[test]
fn profiling_every_prefix_of_a_model_holds_its_values_about_once() {
    let spec = mlp(1024, 8);
    let values = 4 * 8 * (1024 * 1024 + 1024);
    let sgd = OptimizerSpec::Sgd {
        lr: 0.01,
        momentum: 0.0,
        dampening: 0.0,
        nesterov: false,
        weight_decay: 0.0,
        decay_params: DecayParams::All,
    };
    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    let costs = profile(&spec, &sgd, "flex", 4, 1).expect("profile");
    let peak = PEAK.load(Ordering::Relaxed) - before;
    assert_eq!(costs.len(), spec.layers.len());
    let ratio = peak as f64 / values as f64;
    println!("profile peak {peak} bytes, {ratio:.2}x the model's {values} bytes of values");
    assert!(
        ratio < 6.0,
        "the prefixes hold {ratio:.2}x the model's values"
    );
}
