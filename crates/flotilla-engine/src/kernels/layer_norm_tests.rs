//! The fused layer norm against burn's `LayerNorm` under autodiff (output and the gradients of
//! the input, scale and shift, to 1e-5), the Flex kernel against the same formulas in burn's
//! ops, and 1 against 2 threads bit for bit.

use burn::backend::Flex;
use burn::backend::tensor::FloatTensor;
use burn::module::Param;
use burn::nn::{LayerNorm, LayerNormConfig};
use burn::prelude::*;

use super::host::{contiguous_f32, slice, tensor};
use super::layer_norm::{EPSILON, LayerNormOps, layer_norm, reference_backward, reference_forward};

/// Deterministic values in about `[offset − scale, offset + scale]`.
fn values(n: usize, seed: usize, scale: f32, offset: f32) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7919 + seed * 104_729) % 2003) as f32 / 1001.5 - 1.0)
        .map(|v| v * scale + offset)
        .collect()
}

fn device() -> Device {
    Device::flex().autodiff()
}

fn param(d: usize, seed: usize, offset: f32) -> Param<Tensor<1>> {
    let t = Tensor::from_data(
        TensorData::new(values(d, seed, 0.5, offset), [d]),
        &device(),
    );
    Param::from_tensor(t)
}

/// A layer norm of `d` features with a scale and shift other than burn's ones and zeros.
fn norm(d: usize) -> LayerNorm {
    let mut norm = LayerNormConfig::new(d)
        .with_epsilon(EPSILON)
        .init(&device());
    norm.gamma = param(d, 1, 1.0);
    norm.beta = Some(param(d, 2, 0.0));
    norm
}

fn flat<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().try_into_vec_as::<f32>().unwrap_or_default()
}

fn assert_close(what: &str, ours: &[f32], theirs: &[f32]) {
    assert_eq!(ours.len(), theirs.len(), "{what}: lengths");
    for (i, (a, b)) in ours.iter().zip(theirs).enumerate() {
        let diff = (a - b).abs() / b.abs().max(1.0);
        assert!(
            diff <= 1e-5,
            "{what}: element {i}: {a} against {b} ({diff})"
        );
    }
}

/// The output and the gradients of `Σ w·f(x)` for `x`, γ and β.
fn run(norm: &LayerNorm, shape: [usize; 3], fused: bool) -> [Vec<f32>; 4] {
    let n = shape.iter().product();
    let x = Tensor::<3>::from_data(TensorData::new(values(n, 3, 3.0, 0.7), shape), &device());
    let w = Tensor::<3>::from_data(TensorData::new(values(n, 4, 1.0, 0.0), shape), &device());
    let x = x.require_grad();
    let y = if fused {
        layer_norm(norm, x.clone())
    } else {
        norm.forward(x.clone())
    };
    let grads = (y.clone() * w).sum().backward();
    let grad = |t: Option<Tensor<1>>| t.map(flat).unwrap_or_default();
    let beta = norm.beta.as_ref().map(|b| b.val());
    [
        flat(y),
        x.grad(&grads).map(flat).unwrap_or_default(),
        grad(norm.gamma.val().grad(&grads)),
        grad(beta.and_then(|b| b.grad(&grads))),
    ]
}

#[test]
fn output_and_gradients_match_burns_layer_norm() {
    // 200 rows of 72 features: several row blocks, a row length that is not a multiple of 8.
    for (shape, d) in [([4, 50, 72], 72), ([2, 3, 128], 128)] {
        let norm = norm(d);
        let ours = run(&norm, shape, true);
        let theirs = run(&norm, shape, false);
        for (what, (a, b)) in ["output", "dx", "dgamma", "dbeta"]
            .iter()
            .zip(ours.iter().zip(&theirs))
        {
            assert!(!a.is_empty(), "{what} missing");
            assert_close(what, a, b);
        }
    }
}

fn flex_values(t: &FloatTensor<Flex>) -> Vec<f32> {
    contiguous_f32(t).map_or_else(Vec::new, |t| slice(&t).to_vec())
}

#[test]
fn flex_kernel_matches_the_formulas_in_burns_ops() {
    let (rows, d) = (130, 40);
    let x = tensor(values(rows * d, 5, 2.0, -0.3), [rows, d]);
    let g = tensor(values(rows * d, 6, 1.0, 0.0), [rows, d]);
    let gamma = tensor(values(d, 7, 0.5, 1.0), [d]);
    let beta = tensor(values(d, 8, 0.5, 0.0), [d]);
    let ours = Flex::fused_layer_norm_stats(x.clone(), gamma.clone(), beta.clone(), EPSILON);
    let theirs = reference_forward::<Flex>(x.clone(), gamma.clone(), beta, EPSILON);
    assert_close("output", &flex_values(&ours.0), &flex_values(&theirs.0));
    assert_close("mean", &flex_values(&ours.1), &flex_values(&theirs.1));
    assert_close("rstd", &flex_values(&ours.2), &flex_values(&theirs.2));
    let (m, r) = (ours.1, ours.2);
    let ours =
        Flex::fused_layer_norm_backward(x.clone(), gamma.clone(), m.clone(), r.clone(), g.clone());
    let theirs = reference_backward::<Flex>(x, gamma, m, r, g);
    assert_close("dx", &flex_values(&ours.0), &flex_values(&theirs.0));
    assert_close("dgamma", &flex_values(&ours.1), &flex_values(&theirs.1));
    assert_close("dbeta", &flex_values(&ours.2), &flex_values(&theirs.2));
}

#[test]
fn one_and_two_threads_give_the_same_bits() {
    let norm = norm(128);
    let on = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("pool");
        pool.install(|| run(&norm, [5, 64, 128], true))
    };
    let (one, two) = (on(1), on(2));
    for (a, b) in one.iter().zip(&two) {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(a), bits(b));
    }
}
