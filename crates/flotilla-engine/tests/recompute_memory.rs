//! Activation recomputation's memory, measured by the process's allocator: with the same
//! width, context and batch, the peak a training pass adds over what the engine held before
//! it is the pass's activation memory and its gradients (a conservative measure here: the
//! gradients grow with the blocks too). Recomputing, a 16-block GPT's is within 2x a 4-block
//! one's (one block on the tape at a time, beside each block's kept input); without
//! recomputation it grows with the blocks (4x the tape), which shows the measurement sees the
//! activations.

mod counting;

use std::sync::atomic::Ordering;

use counting::{LIVE, PEAK};
use flotilla_engine::{BatchRef, BurnEngine, DecayParams, Engine, ModelSpec, OptimizerSpec};

/// A GPT of `blocks` pre-LN blocks of width 64 (4 heads, an MLP of 4x), context 64: its
/// activations, not its parameters, are most of a pass's memory.
fn gpt(blocks: usize) -> ModelSpec {
    let block = "  - transformer_block: {heads: 4, mlp: 4}\n".repeat(blocks);
    let yaml = format!(
        "name: gpt-{blocks}\ninput: [64]\nlayers:\n  - embedding: {{vocab: 256, dim: 64}}\n  \
         - pos_embedding: {{max_len: 64}}\n{block}  - layer_norm\n  - linear: {{out: 256}}\n"
    );
    ModelSpec::from_yaml(&yaml, "gpt").expect("spec")
}

/// Samples a pass.
const BATCH: usize = 32;

/// The memory one training pass of `spec` adds (the second pass: the first allocates what
/// stays), recomputing or not: the allocator's peak during the pass over its live bytes
/// before (activations and the gradients).
fn activation_peak(spec: &ModelSpec, recompute: bool) -> usize {
    let sgd = OptimizerSpec::Sgd {
        lr: 0.01,
        momentum: 0.0,
        dampening: 0.0,
        nesterov: false,
        weight_decay: 0.0,
        decay_params: DecayParams::All,
    };
    let mut e = BurnEngine::new(spec, &sgd, "flex", 5).expect("engine");
    e.set_recompute(recompute).expect("recompute");
    let per = 64;
    let images: Vec<f32> = (0..BATCH * per).map(|i| ((i * 7) % 256) as f32).collect();
    let labels: Vec<i64> = (0..BATCH * per).map(|i| ((i * 11) % 256) as i64).collect();
    let b = BatchRef {
        images: &images,
        labels: &labels,
    };
    let mut peak = 0;
    for _ in 0..2 {
        e.drop_grads();
        let before = LIVE.load(Ordering::Relaxed);
        PEAK.store(before, Ordering::Relaxed);
        e.forward_backward(b).expect("pass");
        peak = PEAK.load(Ordering::Relaxed) - before;
    }
    peak
}

#[test]
fn recomputing_a_16_block_gpt_takes_under_twice_the_activations_of_a_4_block_one() {
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    let (four, sixteen) = (gpt(4), gpt(16));
    let (r4, r16) = (
        activation_peak(&four, true),
        activation_peak(&sixteen, true),
    );
    let (p4, p16) = (
        activation_peak(&four, false),
        activation_peak(&sixteen, false),
    );
    println!(
        "activation peak (MiB): recomputing 4 blocks {:.1}, 16 blocks {:.1} ({:.2}x); \
         without: {:.1}, {:.1} ({:.2}x)",
        mib(r4),
        mib(r16),
        r16 as f64 / r4 as f64,
        mib(p4),
        mib(p16),
        p16 as f64 / p4 as f64
    );
    assert!(
        p16 as f64 > 3.0 * p4 as f64,
        "without recomputation 16 blocks hold 4x the tape of 4: {} vs {} bytes",
        p16,
        p4
    );
    assert!(
        (r16 as f64) < 2.0 * r4 as f64,
        "recomputing, 16 blocks took {} bytes, 4 blocks {}: not within 2x",
        r16,
        r4
    );
    assert!(
        r16 < p16 / 3,
        "recomputation saves most of the 16 blocks' tape"
    );
}
