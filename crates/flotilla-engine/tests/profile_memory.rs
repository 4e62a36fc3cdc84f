//! A pipeline profile's memory, measured by the process's allocator: timing every prefix of
//! a model as a stage (`pipeline/profile.rs`), the prefixes share one model's parameter
//! values, and each makes its gradient for its pass and lets it go. On an MLP of 8 equal
//! linear layers the profile's peak over what the process held before was 23x the model's
//! values with every prefix built with its own values and gradient buffer (11x sharing the
//! values alone), 4.2x with the whole model in one window (the values once and the whole
//! model's pass: burn's gradients and the flat gradient), and with windows of a quarter of
//! the model (what a rank of a 4-rank job holds) about a window's share of that.

mod counting;

use std::sync::atomic::Ordering;

use counting::{LIVE, PEAK};
use flotilla_engine::{DecayParams, LayerCost, ModelSpec, OptimizerSpec, profile};

/// An MLP of `n` linear layers of `width` (each with a ReLU), and a head of 10.
fn mlp(width: usize, n: usize) -> ModelSpec {
    let layer = format!("  - linear: {{out: {width}}}\n  - relu\n").repeat(n);
    let yaml = format!("input: [{width}]\nlayers:\n{layer}  - linear: {{out: 10}}\n");
    ModelSpec::from_yaml(&yaml, "mlp").expect("spec")
}

/// The profile's peak over what the process held before it, in bytes, with windows of at most
/// `window_params` parameters, and its costs.
fn profile_peak(spec: &ModelSpec, window_params: u64) -> (usize, Vec<LayerCost>) {
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
    let costs = profile(spec, &sgd, "flex", (4, 1), window_params).expect("profile");
    (PEAK.load(Ordering::Relaxed) - before, costs)
}

// One test, so that the two profiles' peaks are measured one after the other (the counting
// allocator is the process's).
#[test]
fn profiling_holds_the_model_about_once_and_a_window_about_its_share() {
    let spec = mlp(1024, 8);
    let params = 8 * (1024 * 1024 + 1024) + 1024 * 10 + 10;
    let values = 4 * params;
    let (whole, costs) = profile_peak(&spec, u64::MAX);
    assert_eq!(costs.len(), spec.layers.len());
    let ratio = whole as f64 / values as f64;
    println!("one window: peak {whole} bytes, {ratio:.2}x the model's {values} bytes of values");
    assert!(
        ratio < 6.0,
        "the prefixes hold {ratio:.2}x the model's values"
    );
    // A quarter of the model a window: two of the eight linear layers (and their ReLUs).
    let (windowed, split) = profile_peak(&spec, (params as u64).div_ceil(4));
    let share = windowed as f64 / values as f64;
    println!("windows of a quarter: peak {windowed} bytes, {share:.2}x the model's values");
    assert!(
        share < 0.25 * ratio * 1.5,
        "windows of a quarter of the model hold {share:.2}x its values (one window {ratio:.2}x)"
    );
    // The same layers, parameters and memory estimates either way; only the times differ.
    let fixed = |c: &[LayerCost]| -> Vec<(u64, u64, u64)> {
        (c.iter()
            .map(|c| (c.params, c.fixed_bytes, c.activation_bytes)))
        .collect()
    };
    assert_eq!(fixed(&costs), fixed(&split));
    assert!(split.iter().all(|c| c.time_s >= 0.0));
}
