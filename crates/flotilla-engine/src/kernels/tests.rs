//! The fused kernels against burn's own ops on Flex under autodiff: outputs and the gradients
//! of a weighted sum, to 1e-5.

use burn::nn::attention::{MhaInput, MultiHeadAttentionConfig, generate_autoregressive_mask};
use burn::nn::transformer::{TransformerEncoderConfig, TransformerEncoderLayer};
use burn::prelude::*;
use burn::tensor::activation;

use crate::spec::sequence::{block, causal_attention};

use burn::backend::Flex;
use burn::backend::tensor::FloatTensor;

use super::attention::CausalAttentionOps;
use super::gelu::gelu;
use super::reference;

fn device() -> Device {
    Device::flex().autodiff()
}

/// Deterministic values in about `[-scale, scale]`.
fn values(n: usize, seed: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7919 + seed * 104_729) % 2003) as f32 / 1001.5 - 1.0)
        .map(|v| v * scale)
        .collect()
}

fn tensor<const D: usize>(shape: [usize; D], seed: usize, scale: f32) -> Tensor<D> {
    let n = shape.iter().product();
    Tensor::from_data(TensorData::new(values(n, seed, scale), shape), &device())
}

fn flat<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().try_into_vec_as::<f32>().unwrap_or_default()
}

fn assert_close(what: &str, ours: &[f32], theirs: &[f32], tolerance: f32) {
    assert_eq!(ours.len(), theirs.len(), "{what}: lengths");
    let (i, worst) = ours
        .iter()
        .zip(theirs)
        .map(|(a, b)| (a - b).abs() / b.abs().max(1.0))
        .enumerate()
        .fold((0, 0.0f32), |w, (i, d)| if d > w.1 { (i, d) } else { w });
    assert!(
        worst <= tolerance,
        "{what}: element {i}: {} against burn's {} (difference {worst})",
        ours[i],
        theirs[i]
    );
}

/// The output of `f` on `x` and the gradient of `Σ w·f(x)` with respect to `x`.
fn output_and_grad<const D: usize>(
    x: &Tensor<D>,
    w: &Tensor<D>,
    f: impl Fn(Tensor<D>) -> Tensor<D>,
) -> (Vec<f32>, Vec<f32>) {
    let x = x.clone().require_grad();
    let y = f(x.clone());
    let grads = (y.clone() * w.clone()).sum().backward();
    let grad = x.grad(&grads).map(flat).unwrap_or_default();
    (flat(y), grad)
}

#[test]
fn gelu_matches_burns_gelu_and_its_gradient() {
    // Values over [-12, 12]: both tails, where erf saturates and exp underflows.
    let x = tensor([64, 257], 1, 12.0);
    let w = tensor([64, 257], 2, 1.0);
    let (ours, our_grad) = output_and_grad(&x, &w, gelu);
    let (theirs, their_grad) = output_and_grad(&x, &w, activation::gelu);
    assert_close("gelu", &ours, &theirs, 1e-5);
    assert_close("gelu gradient", &our_grad, &their_grad, 1e-5);
}

#[test]
fn gelu_and_its_gradient_are_the_exact_formulas_bit_for_bit() {
    // The forward keeps the slope for the backward: the gradient must still be `w · (Φ(x) +
    // x·φ(x))` evaluated as the scalar formula does, to the last bit, on both tails too.
    use super::math::{erf, exp_neg};
    use std::f32::consts::{FRAC_1_SQRT_2, PI};
    let x = tensor([64, 257], 1, 12.0);
    let w = tensor([64, 257], 2, 1.0);
    let (ours, our_grad) = output_and_grad(&x, &w, gelu);
    let inv_sqrt_2pi = 1.0 / (2.0 * PI).sqrt();
    let (xs, ws) = (flat(x), flat(w));
    for (i, (&v, &g)) in xs.iter().zip(&ws).enumerate() {
        let value = 0.5 * v * (1.0 + erf(v * FRAC_1_SQRT_2));
        let slope = 0.5 * (1.0 + erf(v * FRAC_1_SQRT_2)) + v * inv_sqrt_2pi * exp_neg(-0.5 * v * v);
        assert_eq!(ours[i].to_bits(), value.to_bits(), "gelu({v})");
        assert_eq!(
            our_grad[i].to_bits(),
            (g * slope).to_bits(),
            "gradient at {v}"
        );
    }
}

#[test]
fn gelu_of_a_strided_tensor_is_gelu_of_its_values() {
    let x = tensor([48, 32], 3, 4.0);
    let ours = flat(gelu(x.clone().swap_dims(0, 1)));
    let theirs = flat(activation::gelu(x.swap_dims(0, 1)));
    assert_close("gelu of a transposed tensor", &ours, &theirs, 1e-5);
}

fn burn_block() -> TransformerEncoderLayer {
    let config = TransformerEncoderConfig::new(64, 256, 4, 1)
        .with_dropout(0.0)
        .with_norm_first(true);
    TransformerEncoderLayer::new(&config, &device())
}

#[test]
fn block_matches_burns_transformer_layer_and_its_gradients() {
    // Draws from the backend RNG: see `rng::rng_lock`.
    let _rng = crate::rng::rng_lock();
    let layer = burn_block();
    let x = tensor([3, 20, 64], 4, 2.0);
    let w = tensor([3, 20, 64], 5, 1.0);
    let (ours, our_grad) = output_and_grad(&x, &w, |x| block(&layer, x));
    let (theirs, their_grad) = output_and_grad(&x, &w, |x| {
        let mask = causal_mask(&x);
        layer.forward(x, None, Some(mask))
    });
    assert_close("block", &ours, &theirs, 1e-5);
    assert_close("block input gradient", &our_grad, &their_grad, 1e-5);
}

/// burn's causal mask for `x` `[n, t, d]`.
fn causal_mask(x: &Tensor<3>) -> Tensor<3, Bool> {
    let [n, t, _] = x.dims();
    generate_autoregressive_mask(n, t, &x.device())
}

#[test]
fn attention_matches_burns_multi_head_attention_and_its_gradients() {
    // Draws from the backend RNG: see `rng::rng_lock`.
    let _rng = crate::rng::rng_lock();
    let mha = MultiHeadAttentionConfig::new(64, 4)
        .with_dropout(0.0)
        .init(&device());
    let x = tensor([5, 33, 64], 6, 3.0);
    let w = tensor([5, 33, 64], 7, 1.0);
    let (ours, our_grad) = output_and_grad(&x, &w, |x| causal_attention(&mha, x));
    let (theirs, their_grad) = output_and_grad(&x, &w, |x| {
        let mask = causal_mask(&x);
        mha.forward(MhaInput::self_attn(x).mask_attn(mask)).context
    });
    assert_close("attention", &ours, &theirs, 1e-5);
    assert_close("attention input gradient", &our_grad, &their_grad, 1e-5);
}

/// A Flex primitive `[n, t, d]` of deterministic values, and its values back.
fn flex(shape: [usize; 3], seed: usize, scale: f32) -> FloatTensor<Flex> {
    super::host::tensor(values(shape.iter().product(), seed, scale), shape)
}

fn flex_values(t: &FloatTensor<Flex>) -> Vec<f32> {
    super::host::contiguous_f32(t).map_or_else(Vec::new, |t| super::host::slice(&t).to_vec())
}

#[test]
fn flex_kernels_match_the_reference_in_burns_ops_forward_and_backward() {
    // The reference is what backends without a fused kernel run: checked here on Flex, on Q,
    // K and V packed `[n, t, 3d]` and on the three apart (what burn's attention takes).
    let (qkv, g) = (flex([2, 9, 96], 8, 2.0), flex([2, 9, 32], 11, 1.0));
    let (ours, our_probs) = Flex::causal_attention_probs(qkv.clone(), 2);
    let (their_context, their_probs) = reference::forward_packed::<Flex>(qkv.clone(), 2);
    assert_close(
        "context",
        &flex_values(&ours),
        &flex_values(&their_context),
        1e-5,
    );
    assert_close(
        "probabilities",
        &flex_values(&our_probs),
        &flex_values(&their_probs),
        1e-6,
    );
    let ours = Flex::causal_attention_backward(qkv.clone(), our_probs.clone(), g.clone(), 2);
    let theirs = reference::backward_packed::<Flex>(qkv.clone(), our_probs.clone(), g.clone(), 2);
    assert_close("dqkv", &flex_values(&ours), &flex_values(&theirs), 1e-5);
    // The packed reference is the one on Q, K, V apart (columns 0..d, d..2d, 2d..3d).
    let all = flex_values(&qkv);
    let part = |i: usize| {
        let rows = all
            .chunks_exact(96)
            .flat_map(|r| r[i * 32..(i + 1) * 32].to_vec());
        super::host::tensor(rows.collect(), [2, 9, 32])
    };
    let (q, k, v) = (part(0), part(1), part(2));
    let (apart, _) = reference::forward::<Flex>(q.clone(), k.clone(), v.clone(), 2);
    assert_eq!(
        flex_values(&apart),
        flex_values(&their_context),
        "context apart"
    );
    let (dq, dk, dv) = reference::backward::<Flex>(q, k, v, our_probs, g, 2);
    let packed = flex_values(&ours);
    for (i, d) in [dq, dk, dv].iter().enumerate() {
        let cols: Vec<f32> = packed
            .chunks_exact(96)
            .flat_map(|r| r[i * 32..(i + 1) * 32].to_vec())
            .collect();
        assert_close("dq, dk, dv apart", &cols, &flex_values(d), 1e-5);
    }
}

/// The panic message of `f`, if it panics.
fn panic_message(f: impl FnOnce()) -> Option<String> {
    let payload = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).err()?;
    let text = payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()));
    Some(text.unwrap_or_default())
}

/// A packed Q, K, V (and backward's probabilities and gradient) of another shape than the
/// kernels expect is refused with a message naming the tensor before they read it through
/// unchecked strided views (which would read past its buffer).
#[test]
fn flex_kernels_refuse_qkv_probs_or_grad_of_the_wrong_shape() {
    let qkv = flex([2, 9, 96], 1, 1.0);
    let good = flex([2, 9, 32], 2, 1.0);
    let short = flex([2, 3, 32], 3, 1.0);
    let (_, probs) = Flex::causal_attention_probs(qkv.clone(), 2);
    let small_probs = super::host::tensor(vec![0.0; 2 * 2 * 3 * 3], [2, 2, 3, 3]);
    for (name, probs, g) in [
        ("probs", small_probs, good.clone()),
        ("grad", probs, short.clone()),
    ] {
        let qkv = qkv.clone();
        let message = panic_message(|| {
            let _ = Flex::causal_attention_backward(qkv, probs, g, 2);
        });
        let message = message.unwrap_or_else(|| panic!("a wrong {name} was taken"));
        assert!(
            message.contains(&format!("causal attention: {name} must be")),
            "{message}"
        );
    }
    for (heads, qkv) in [(3, qkv.clone()), (2, flex([2, 9, 100], 5, 1.0))] {
        let message = panic_message(|| {
            let _ = Flex::causal_attention_probs(qkv, heads);
        });
        assert!(
            message.is_some_and(|m| m.contains(&format!("a multiple of the {heads} heads"))),
            "[2, 9, {}] cannot be cut into Q, K, V of {heads} heads",
            3 * 32
        );
    }
}

#[test]
fn a_flex_gradient_is_read_in_place_not_copied() {
    let x = tensor([4, 3], 1, 1.0).require_grad();
    let grads = (x.clone() * x.clone()).sum().backward();
    let grad = x.grad(&grads).expect("a gradient");
    let want = flat(grad.clone());
    let first = super::host::flex_f32(&grad.clone().into_dispatch()).expect("Flex f32");
    let again = super::host::flex_f32(&grad.into_dispatch()).expect("Flex f32");
    let (a, b) = (super::host::values(&first), super::host::values(&again));
    assert_eq!(a, Some(&want[..]));
    // Both reads borrow the gradient's one buffer.
    assert_eq!(a.map(<[f32]>::as_ptr), b.map(<[f32]>::as_ptr));
    let int = Tensor::<2, Int>::zeros([2, 2], &device()).into_dispatch();
    assert!(
        super::host::flex_f32(&int).is_none(),
        "an int tensor is not read as f32"
    );
}
