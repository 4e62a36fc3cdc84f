//! The gradients of every layer that modern models need, against central finite differences,
//! each in a small model of its own, through the public flat [`Engine`] API: layer norm and
//! GELU, RMS norm and SiLU, batch norm (1-d and 2-d, in training: batch statistics), the
//! token and positional embeddings with causal attention, a pre-LN transformer block, and
//! dropout with a fixed seed. The checks (largest entries of each tensor, 1% agreement,
//! rejection of a doubled or transposed gradient) are those of `numeric_checks.rs`.

mod common;

use common::{batch, check_gradients, engine_of, token_batch};
use flotilla_engine::{BatchRef, Engine};

fn batch_ref<'a>(x: &'a [f32], y: &'a [i64]) -> BatchRef<'a> {
    BatchRef {
        images: x,
        labels: y,
    }
}

#[test]
fn layer_norm_and_gelu_gradients_match_central_differences() {
    let spec = "input: [6]
layers:
  - linear: {out: 5}
  - layer_norm
  - gelu
  - linear: {out: 3}
";
    let mut e = engine_of(spec, 31, 0.1);
    let (x, y) = batch(4, 6, 3, 1);
    check_gradients(
        &mut e,
        batch_ref(&x, &y),
        &[
            ("layers.0.weight", 1e-2),
            ("layers.0.bias", 1e-2),
            ("layers.1.weight", 1e-2),
            ("layers.1.bias", 1e-2),
            ("layers.3.weight", 1e-2),
        ],
    );
}

#[test]
fn rms_norm_and_silu_gradients_match_central_differences() {
    let spec = "input: [6]
layers:
  - linear: {out: 5}
  - rms_norm
  - silu
  - linear: {out: 3}
";
    let mut e = engine_of(spec, 32, 0.1);
    let (x, y) = batch(4, 6, 3, 2);
    check_gradients(
        &mut e,
        batch_ref(&x, &y),
        &[
            ("layers.0.weight", 1e-2),
            ("layers.1.weight", 1e-2),
            ("layers.3.weight", 1e-2),
        ],
    );
}

#[test]
fn batch_norm_1d_gradients_match_central_differences() {
    // In training a batch norm normalizes with the batch's own statistics, so every sample's
    // loss depends on every other sample: the gradient has those cross terms.
    let spec = "input: [5]
layers:
  - linear: {out: 8}
  - batch_norm
  - tanh
  - linear: {out: 3}
";
    let mut e = engine_of(spec, 33, 0.1);
    let (x, y) = batch(6, 5, 3, 3);
    check_gradients(
        &mut e,
        batch_ref(&x, &y),
        &[
            ("layers.0.weight", 1e-2),
            ("layers.1.weight", 1e-2),
            ("layers.1.bias", 1e-2),
            ("layers.3.weight", 1e-2),
        ],
    );
}

#[test]
fn batch_norm_2d_gradients_match_central_differences() {
    let spec = "input: [2, 5, 5]
layers:
  - conv2d: {out: 5, k: 3}
  - batch_norm
  - tanh
  - flatten
  - linear: {out: 3}
";
    let mut e = engine_of(spec, 34, 0.1);
    let (x, y) = batch(3, 2 * 5 * 5, 3, 4);
    check_gradients(
        &mut e,
        batch_ref(&x, &y),
        &[
            ("layers.0.weight", 1e-2),
            ("layers.1.weight", 1e-2),
            ("layers.1.bias", 1e-2),
            ("layers.4.weight", 1e-2),
        ],
    );
}

#[test]
fn embeddings_and_causal_attention_gradients_match_central_differences() {
    let spec = "input: [5]
layers:
  - embedding: {vocab: 7, dim: 8}
  - pos_embedding: {max_len: 6}
  - attention: {heads: 2}
  - linear: {out: 7}
";
    let mut e = engine_of(spec, 35, 0.1);
    assert_eq!(e.labels_per_sample(), 5);
    let (x, y) = token_batch(3, 5, 7, 5);
    check_gradients(
        &mut e,
        batch_ref(&x, &y),
        &[
            ("layers.0.weight", 1e-2),
            ("layers.1.weight", 1e-2),
            ("layers.2.query.weight", 1e-2),
            ("layers.2.key.weight", 1e-2),
            ("layers.2.value.weight", 1e-2),
            ("layers.2.output.weight", 1e-2),
            ("layers.2.query.bias", 1e-2),
            ("layers.3.weight", 1e-2),
        ],
    );
}

#[test]
fn transformer_block_gradients_match_central_differences() {
    let spec = "input: [4]
layers:
  - embedding: {vocab: 6, dim: 8}
  - transformer_block: {heads: 2, mlp: 2}
  - layer_norm
  - linear: {out: 6}
";
    let mut e = engine_of(spec, 36, 0.1);
    let (x, y) = token_batch(3, 4, 6, 6);
    check_gradients(
        &mut e,
        batch_ref(&x, &y),
        &[
            ("layers.0.weight", 1e-2),
            ("layers.1.norm_2.weight", 1e-2),
            ("layers.1.mha.query.weight", 1e-2),
            ("layers.1.mha.key.weight", 1e-2),
            ("layers.1.mha.value.weight", 1e-2),
            ("layers.1.mha.output.weight", 1e-2),
            ("layers.1.norm_1.weight", 1e-2),
            ("layers.1.pwff.linear_inner.weight", 1e-2),
            ("layers.1.pwff.linear_outer.weight", 1e-2),
            ("layers.3.weight", 1e-2),
        ],
    );
}

#[test]
fn seeded_dropout_draws_the_same_masks_and_its_gradients_match_central_differences() {
    let spec = "input: [6]
layers:
  - linear: {out: 8}
  - tanh
  - dropout: {p: 0.3}
  - linear: {out: 3}
";
    let mut e = engine_of(spec, 37, 0.1);
    let (x, y) = batch(4, 6, 3, 7);
    let b = batch_ref(&x, &y);
    e.set_dropout_seed(11);
    let first = e.forward_backward(b).expect("forward");
    assert_eq!(e.forward_backward(b).expect("again"), first, "same seed");
    e.set_dropout_seed(12);
    let other = e.forward_backward(b).expect("other seed");
    assert_ne!(other, first, "another seed draws other masks");
    e.set_dropout_seed(11);
    assert_eq!(e.forward_backward(b).expect("back"), first, "seed 11 again");
    // With the masks fixed, the loss is a smooth function of the parameters.
    check_gradients(
        &mut e,
        b,
        &[("layers.0.weight", 1e-2), ("layers.3.weight", 1e-2)],
    );
}
