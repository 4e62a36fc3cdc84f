//! GELU (the exact one, `x·Φ(x)` with `erf`) as a burn backend extension: on Flex one
//! vectorized pass forward and one backward (`erf` and `exp` by [`super::math`] instead of
//! libm's scalar `erff` and `expf`, which were 10 % of the byte-level GPT's step; AVX2 + FMA
//! where the CPU has them, which took them from 10.6 % of its step to 5.4 %), burn's own
//! `gelu` / `gelu_backward` on the other backends, and on `Autodiff` a backward that keeps
//! the input (as burn's does) and calls the backend's fused backward.

// burn 0.22 deprecates NdArray and LibTorch but still ships them: the extension names them.
#![cfg_attr(any(feature = "ndarray", feature = "libtorch"), allow(deprecated))]

use std::f32::consts::{FRAC_1_SQRT_2, PI};

use burn::backend::ops::ActivationOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, Flex, TensorMetadata};
use burn::prelude::*;
use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, unary};
use multiversion::multiversion;

use super::autodiff::record;
use super::backends::{engine_extension, impl_on_burn_backends};
use super::host::{contiguous_f32, contiguous_f32_all, slice, tensor};
use super::math::{erf, exp_neg};

engine_extension! {
    /// The backend side of [`gelu`].
    pub trait GeluOps: Backend {
        /// `x·Φ(x)` of every element (burn's `gelu` unless a backend has a faster one).
        fn gelu_erf(x: FloatTensor<Self>) -> FloatTensor<Self> {
            Self::gelu(x)
        }

        /// `grad · d gelu(x)/dx`, element-wise (burn's `gelu_backward` unless a backend has a
        /// faster one).
        fn gelu_erf_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
            Self::gelu_backward(x, grad)
        }
    }
}

/// GELU of one value.
#[inline(always)]
fn gelu_f32(x: f32) -> f32 {
    0.5 * x * (1.0 + erf(x * FRAC_1_SQRT_2))
}

/// The derivative of GELU at `x`: `Φ(x) + x·φ(x)`.
#[inline(always)]
fn gelu_slope_f32(x: f32) -> f32 {
    let inv_sqrt_2pi = 1.0 / (2.0 * PI).sqrt();
    0.5 * (1.0 + erf(x * FRAC_1_SQRT_2)) + x * inv_sqrt_2pi * exp_neg(-0.5 * x * x)
}

/// GELU of every value (compiled for AVX2 + FMA too, picked at run time; the same values).
#[multiversion(targets("x86_64+avx2+fma"))]
fn gelu_values(x: &[f32]) -> Vec<f32> {
    // Loops, not closures: a closure is not compiled with its function's target features,
    // and is not inlined into it. The output is written once, not zeroed first.
    let mut out = Vec::with_capacity(x.len());
    for (o, &v) in out.spare_capacity_mut().iter_mut().zip(x) {
        o.write(gelu_f32(v));
    }
    // SAFETY: the loop wrote each of the `x.len()` values the capacity holds.
    unsafe { out.set_len(x.len()) };
    out
}

/// `g · gelu'(x)` of every pair (compiled as [`gelu_values`]).
#[multiversion(targets("x86_64+avx2+fma"))]
fn gelu_backward_values(x: &[f32], g: &[f32]) -> Vec<f32> {
    let len = x.len().min(g.len());
    let mut out = Vec::with_capacity(len);
    for ((o, &v), &g) in out.spare_capacity_mut().iter_mut().zip(x).zip(g) {
        o.write(g * gelu_slope_f32(v));
    }
    // SAFETY: the loop wrote each of the `len` values (the shorter input's length).
    unsafe { out.set_len(len) };
    out
}

impl GeluOps for Flex {
    fn gelu_erf(x: FloatTensor<Self>) -> FloatTensor<Self> {
        let Some(x) = contiguous_f32(&x) else {
            return Self::gelu(x);
        };
        tensor(gelu_values(slice(&x)), x.shape())
    }

    fn gelu_erf_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
        let Some([x, grad]) = contiguous_f32_all([&x, &grad]) else {
            return Self::gelu_backward(x, grad);
        };
        tensor(gelu_backward_values(slice(&x), slice(&grad)), x.shape())
    }
}

// NdArray, LibTorch and wgpu's `Cube`: burn's `gelu` and `gelu_backward`.
impl_on_burn_backends!(GeluOps);

/// GELU's backward: the backend's fused backward at the kept input.
#[derive(Debug)]
struct GeluBackward;

impl<B: Backend + GeluOps> Backward<B, 1> for GeluBackward {
    type State = FloatTensor<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let x = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            B::gelu_erf_backward(x, grad)
        });
    }
}

impl<B: Backend + GeluOps, C: CheckpointStrategy> GeluOps for Autodiff<B, C> {
    fn gelu_erf(x: FloatTensor<Self>) -> FloatTensor<Self> {
        let (x, node) = x.into_parts();
        record(
            GeluBackward.prepare::<C>([node]),
            x,
            |x| (B::gelu_erf(x.clone()), x),
            B::gelu_erf,
        )
    }
}

/// GELU (`x·Φ(x)`, the exact form, as burn's `Gelu` and PyTorch's default), differentiable;
/// fused on Flex.
pub(crate) fn gelu<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as GeluOps>::gelu_erf(x.into_dispatch()))
}
