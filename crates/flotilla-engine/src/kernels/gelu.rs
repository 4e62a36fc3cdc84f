//! GELU (the exact one, `x·Φ(x)` with `erf`) as a burn backend extension: on Flex one
//! vectorized pass forward and one backward (`erf` and `exp` by [`super::math`] instead of
//! libm's scalar `erff` and `expf`, which were 10 % of the byte-level GPT's step; AVX2 + FMA
//! where the CPU has them, which took them from 10.6 % of its step to 5.4 %), burn's own
//! `gelu` / `gelu_backward` on the other backends, and on `Autodiff` a backward that keeps
//! what the backend's forward kept (on Flex the slope, computed in the forward's pass, so the
//! backward is one product: 5.4 % to 3.6 %; elsewhere the input, as burn's does) and calls
//! the backend's fused backward.

// burn 0.22 deprecates NdArray and LibTorch but still ships them: the extension names them.
#![cfg_attr(any(feature = "ndarray", feature = "libtorch"), allow(deprecated))]

use std::f32::consts::{FRAC_1_SQRT_2, PI};

use burn::backend::ops::{ActivationOps, FloatTensorOps};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, Flex, TensorMetadata};
use burn::prelude::*;
use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind, unary};
use multiversion::multiversion;

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

        /// `x·Φ(x)` of every element, and what its backward keeps
        /// ([`GeluOps::gelu_erf_backward`]): `x` itself unless a backend keeps something
        /// cheaper to use.
        fn gelu_erf_kept(x: FloatTensor<Self>) -> (FloatTensor<Self>, FloatTensor<Self>) {
            (Self::gelu(x.clone()), x)
        }

        /// `grad · d gelu(x)/dx`, element-wise, from what [`GeluOps::gelu_erf_kept`] kept
        /// (burn's `gelu_backward` at `x` unless a backend has a faster one).
        fn gelu_erf_backward(kept: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
            Self::gelu_backward(kept, grad)
        }
    }
}

/// GELU of one value.
#[inline(always)]
fn gelu_f32(x: f32) -> f32 {
    0.5 * x * (1.0 + erf(x * FRAC_1_SQRT_2))
}

/// GELU at `x` and its derivative there, `Φ(x) + x·φ(x)`, sharing one `erf`.
#[inline(always)]
fn gelu_and_slope_f32(x: f32) -> (f32, f32) {
    let inv_sqrt_2pi = 1.0 / (2.0 * PI).sqrt();
    let phi2 = 1.0 + erf(x * FRAC_1_SQRT_2);
    (
        0.5 * x * phi2,
        0.5 * phi2 + x * inv_sqrt_2pi * exp_neg(-0.5 * x * x),
    )
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

/// GELU of every value and its slope there, `gelu'(x)`, in one pass (compiled as
/// [`gelu_values`]; its values are [`gelu_f32`]'s bit for bit): the slope is what the
/// backward keeps, so that it multiplies the gradient by it instead of evaluating `erf` and
/// `exp` again.
#[multiversion(targets("x86_64+avx2+fma"))]
fn gelu_values_and_slopes(x: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let mut out = Vec::with_capacity(x.len());
    let mut slopes = Vec::with_capacity(x.len());
    let outs = out.spare_capacity_mut().iter_mut();
    for ((o, s), &v) in outs.zip(slopes.spare_capacity_mut()).zip(x) {
        let (value, slope) = gelu_and_slope_f32(v);
        o.write(value);
        s.write(slope);
    }
    // SAFETY: the loop wrote each of the `x.len()` values both capacities hold.
    unsafe {
        out.set_len(x.len());
        slopes.set_len(x.len());
    }
    (out, slopes)
}

/// `g · s` of every pair (compiled as [`gelu_values`]).
#[multiversion(targets("x86_64+avx2+fma"))]
fn products(s: &[f32], g: &[f32]) -> Vec<f32> {
    let len = s.len().min(g.len());
    let mut out = Vec::with_capacity(len);
    for ((o, &s), &g) in out.spare_capacity_mut().iter_mut().zip(s).zip(g) {
        o.write(g * s);
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

    /// Keeps the slope `gelu'(x)` (computed with the output, sharing its `erf`), not `x`.
    fn gelu_erf_kept(x: FloatTensor<Self>) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let Some(x) = contiguous_f32(&x) else {
            let ones = Self::float_ones(x.shape(), &x.device(), x.dtype().into());
            return (Self::gelu(x.clone()), Self::gelu_backward(x, ones));
        };
        let (out, slopes) = gelu_values_and_slopes(slice(&x));
        (tensor(out, x.shape()), tensor(slopes, x.shape()))
    }

    fn gelu_erf_backward(slope: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
        let Some([slope, grad]) = contiguous_f32_all([&slope, &grad]) else {
            return Self::float_mul(grad, slope);
        };
        tensor(products(slice(&slope), slice(&grad)), slope.shape())
    }
}

// NdArray, LibTorch and wgpu's `Cube`: burn's `gelu` and `gelu_backward`.
impl_on_burn_backends!(GeluOps);

/// GELU's backward: the backend's fused backward from what its forward kept (on Flex the
/// slope, else the input).
#[derive(Debug)]
struct GeluBackward;

impl<B: Backend + GeluOps> Backward<B, 1> for GeluBackward {
    /// What [`GeluOps::gelu_erf_kept`] kept.
    type State = FloatTensor<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let kept = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            B::gelu_erf_backward(kept, grad)
        });
    }
}

impl<B: Backend + GeluOps, C: CheckpointStrategy> GeluOps for Autodiff<B, C> {
    /// Not [`super::autodiff::record`]: off the tape GELU's output is the taped one's bit for bit (on Flex the
    /// same loop without the slope), so a forward that a taped recomputation must match
    /// ([`super::autodiff::as_tracked`], ZeRO-3's) need not compute the slope too.
    fn gelu_erf(x: FloatTensor<Self>) -> FloatTensor<Self> {
        let (x, node) = x.into_parts();
        match GeluBackward.prepare::<C>([node]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (output, kept) = B::gelu_erf_kept(x);
                prep.finish(kept, output)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::gelu_erf(x)),
        }
    }
}

/// GELU (`x·Φ(x)`, the exact form, as burn's `Gelu` and PyTorch's default), differentiable;
/// fused on Flex.
pub(crate) fn gelu<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as GeluOps>::gelu_erf(x.into_dispatch()))
}
