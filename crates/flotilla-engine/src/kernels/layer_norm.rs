//! Layer normalization over the last dimension as a burn backend extension: on Flex one pass
//! forward that keeps each row's mean and `1/σ`, and one pass backward giving the input, scale
//! and shift gradients together ([`super::norm_rows`]); burn's `Autodiff` would otherwise
//! record `LayerNorm::forward` as its chain of mean, subtract, square, mean, square root,
//! divide, multiply and add, each with its own buffer and backward. Other backends run the
//! same formulas in burn's ops behind the same extension.

// burn 0.22 deprecates NdArray and LibTorch but still ships them: the extension names them.
#![cfg_attr(any(feature = "ndarray", feature = "libtorch"), allow(deprecated))]

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, Flex, TensorMetadata};
use burn::nn::LayerNorm;
use burn::prelude::*;
use burn::tensor::Shape;
use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops};

use super::autodiff::{fused, record};
use super::backends::{engine_extension, impl_on_burn_backends};
use super::host::{contiguous_f32_all, slice, tensor};
use super::norm_rows;

/// The epsilon of every layer norm the engine builds (burn's and PyTorch's default): burn's
/// `LayerNorm` keeps its own private, so the engine builds its norms with this one.
pub(crate) const EPSILON: f64 = 1e-5;

/// `x`'s shape with its last dimension set to 1 (a row statistic's shape).
fn row_shape(x: &Shape) -> Shape {
    let mut dims = x.clone();
    let last = dims.num_dims() - 1;
    dims[last] = 1;
    dims
}

/// `v` `[d]` as `[1, …, 1, d]`, to broadcast against a tensor of `rank` dimensions.
fn broadcast<B: Backend>(v: FloatTensor<B>, rank: usize) -> FloatTensor<B> {
    let d = v.shape()[0];
    let dims: Vec<usize> = (0..rank)
        .map(|i| if i + 1 == rank { d } else { 1 })
        .collect();
    B::float_reshape(v, Shape::from(dims))
}

/// The sum over every dimension but the last: `[d]`.
fn sum_rows<B: Backend>(t: FloatTensor<B>) -> FloatTensor<B> {
    let shape = t.shape();
    let d = shape[shape.num_dims() - 1];
    let rows = shape.num_elements() / d.max(1);
    let flat = B::float_reshape(t, Shape::new([rows, d]));
    B::float_reshape(B::float_sum_dim(flat, 0), Shape::new([d]))
}

engine_extension! {
    /// The backend side of [`layer_norm`]: `x` `[…, d]`, `gamma` and `beta` `[d]`, the row
    /// statistics `[…, 1]`.
    pub trait LayerNormOps: Backend {
        /// `(x − mean)/√(var + eps)·γ + β` over the last dimension (burn's `layer_norm`).
        fn fused_layer_norm(
            x: FloatTensor<Self>,
            gamma: FloatTensor<Self>,
            beta: FloatTensor<Self>,
            eps: f64,
        ) -> FloatTensor<Self> {
            Self::layer_norm(x, gamma, Some(beta), eps)
        }

        /// The output, each row's mean and each row's `1/√(var + eps)` (what backward needs).
        fn fused_layer_norm_stats(
            x: FloatTensor<Self>,
            gamma: FloatTensor<Self>,
            beta: FloatTensor<Self>,
            eps: f64,
        ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
            reference_forward::<Self>(x, gamma, beta, eps)
        }

        /// The gradients of `x`, `gamma` and `beta` given the output's gradient `grad`.
        fn fused_layer_norm_backward(
            x: FloatTensor<Self>,
            gamma: FloatTensor<Self>,
            mean: FloatTensor<Self>,
            rstd: FloatTensor<Self>,
            grad: FloatTensor<Self>,
        ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
            reference_backward::<Self>(x, gamma, mean, rstd, grad)
        }
    }
}

/// [`LayerNormOps::fused_layer_norm_stats`] in burn's ops (any backend).
pub(crate) fn reference_forward<B: Backend>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    beta: FloatTensor<B>,
    eps: f64,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let rank = x.shape().num_dims();
    let mean = B::float_mean_dim(x.clone(), rank - 1);
    let centered = B::float_sub(x, mean.clone());
    let var = B::float_mean_dim(B::float_mul(centered.clone(), centered.clone()), rank - 1);
    let rstd = B::float_recip(B::float_sqrt(B::float_add_scalar(var, eps.into())));
    let xhat = B::float_mul(centered, rstd.clone());
    let y = B::float_add(
        B::float_mul(xhat, broadcast::<B>(gamma, rank)),
        broadcast::<B>(beta, rank),
    );
    (y, mean, rstd)
}

/// [`LayerNormOps::fused_layer_norm_backward`] in burn's ops (any backend):
/// `dx = rstd·(g·γ − mean(g·γ) − x̂·mean(g·γ·x̂))`, `dγ = Σ g·x̂`, `dβ = Σ g`.
pub(crate) fn reference_backward<B: Backend>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    mean: FloatTensor<B>,
    rstd: FloatTensor<B>,
    grad: FloatTensor<B>,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let rank = x.shape().num_dims();
    let xhat = B::float_mul(B::float_sub(x, mean), rstd.clone());
    let gy = B::float_mul(grad.clone(), broadcast::<B>(gamma, rank));
    let a = B::float_mean_dim(gy.clone(), rank - 1);
    let b = B::float_mean_dim(B::float_mul(gy.clone(), xhat.clone()), rank - 1);
    let inner = B::float_sub(B::float_sub(gy, a), B::float_mul(xhat.clone(), b));
    let dx = B::float_mul(inner, rstd);
    let dgamma = sum_rows::<B>(B::float_mul(grad.clone(), xhat));
    (dx, dgamma, sum_rows::<B>(grad))
}

impl LayerNormOps for Flex {
    fn fused_layer_norm_stats(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let Some([xc, g, b]) = contiguous_f32_all([&x, &gamma, &beta]) else {
            return reference_forward::<Self>(x, gamma, beta, eps);
        };
        let shape = xc.shape();
        let d = shape[shape.num_dims() - 1];
        let (y, mean, rstd) = norm_rows::forward(slice(&xc), d, slice(&g), slice(&b), eps as f32);
        let stats = row_shape(&shape);
        (
            tensor(y, shape),
            tensor(mean, stats.clone()),
            tensor(rstd, stats),
        )
    }

    fn fused_layer_norm_backward(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let Some([xc, gm, m, r, g]) = contiguous_f32_all([&x, &gamma, &mean, &rstd, &grad]) else {
            return reference_backward::<Self>(x, gamma, mean, rstd, grad);
        };
        let d = gm.shape()[0];
        let (dx, dgamma, dbeta) =
            norm_rows::backward(slice(&xc), slice(&g), slice(&gm), slice(&m), slice(&r));
        (
            tensor(dx, xc.shape()),
            tensor(dgamma, [d]),
            tensor(dbeta, [d]),
        )
    }
}

// NdArray, LibTorch and wgpu's `Cube`: the same formulas in burn's ops.
impl_on_burn_backends!(LayerNormOps);

/// Layer norm's backward: the backend's, from the kept input and row statistics.
#[derive(Debug)]
struct LayerNormBackward;

/// What the backward keeps: `x`, `gamma`, each row's mean and `1/σ`.
type Kept<B> = (
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
);

impl<B: Backend + LayerNormOps> Backward<B, 3> for LayerNormBackward {
    type State = Kept<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        fused::<B, _, 3>(ops, grads, |(x, gamma, mean, rstd), grad| {
            let (dx, dgamma, dbeta) = B::fused_layer_norm_backward(x, gamma, mean, rstd, grad);
            [dx, dgamma, dbeta]
        });
    }
}

impl<B: Backend + LayerNormOps, C: CheckpointStrategy> LayerNormOps for Autodiff<B, C> {
    fn fused_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        eps: f64,
    ) -> FloatTensor<Self> {
        let nodes = [x.node(), gamma.node(), beta.node()];
        record(
            LayerNormBackward.prepare::<C>(nodes),
            [x, gamma, beta].map(|t| t.into_primitive()),
            |[x, gamma, beta]| {
                let (y, mean, rstd) =
                    B::fused_layer_norm_stats(x.clone(), gamma.clone(), beta, eps);
                (y, (x, gamma, mean, rstd))
            },
            |[x, gamma, beta]| B::fused_layer_norm(x, gamma, beta, eps),
        )
    }
}

/// `norm` applied to `x` (features last), differentiable: fused on Flex; burn's
/// [`LayerNorm::forward`] for a norm without a shift.
pub(crate) fn layer_norm<const D: usize>(norm: &LayerNorm, x: Tensor<D>) -> Tensor<D> {
    let Some(beta) = &norm.beta else {
        return norm.forward(x);
    };
    Tensor::from_dispatch(<Dispatch as LayerNormOps>::fused_layer_norm(
        x.into_dispatch(),
        norm.gamma.val().into_dispatch(),
        beta.val().into_dispatch(),
        EPSILON,
    ))
}
