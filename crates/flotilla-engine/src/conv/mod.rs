//! Flotilla's own 2-D convolution on Flex: forward and backward as per-image GEMMs over
//! patch matrices kept in per-thread buffers, the batch split over rayon's pool in fixed
//! blocks, bitwise the same at any thread count.
//!
//! burn's Flex backend convolves directly (a generic 3-D loop with a small-channel path) and
//! computes the weight gradient as another convolution, batch and channels swapped: the
//! convolutions were 56 % of a LeNet-5 step, on one thread whatever `--threads` said
//! (`BENCHMARKS.md` §22). [`conv2d`] runs a burn [`Conv2d`] module through
//! [`ops::ConvOps`], a burn backend extension whose backward (`Autodiff`) computes the input,
//! weight and bias gradients in one pass: same parameters, same module (initialisation,
//! checkpoints and layouts are burn's), the same function up to the order of float sums. A
//! ReLU that follows the layer (`relu`: the spec models fuse `conv2d` → `relu`) is applied to
//! each image's output while it is in cache, and its backward masks the output gradient
//! image by image inside the convolution's backward, from the kept output, as burn's
//! `relu_backward` does: no separate pass, no extra tensor.
//!
//! What it covers: groups 1, dilation 1, symmetric zero padding, any stride and kernel, `f32`
//! on Flex. Anything else (another backend, `Same` padding, dilation, groups, another float
//! type) runs burn's own `Conv2d::forward`.

mod geometry;
mod kernels;
mod ops;

use burn::backend::Dispatch;
use burn::nn::PaddingConfig2d;
use burn::nn::conv::Conv2d;
use burn::prelude::*;
use burn::tensor::DType;

pub use geometry::ConvGeom;
#[cfg(test)]
pub(crate) use kernels::IMAGES_PER_BLOCK;

use ops::ConvOps;

/// The windows of `conv` over `x`, if [`conv2d`]'s own kernels cover the pair.
fn geometry_of(conv: &Conv2d, x: &Tensor<4>) -> Option<ConvGeom> {
    let symmetric = match conv.padding {
        PaddingConfig2d::Valid => Some([0, 0]),
        PaddingConfig2d::Explicit(top, left, bottom, right) => {
            (top == bottom && left == right).then_some([top, left])
        }
        PaddingConfig2d::Same => None,
    };
    let pad = symmetric?;
    let plain = conv.groups == 1 && conv.dilation == [1, 1] && conv.stride.iter().all(|&s| s > 0);
    let f32s = x.dtype() == DType::F32 && conv.weight.val().dtype() == DType::F32;
    if !plain || !f32s || x.device().inner() != Device::flex() {
        return None;
    }
    let [n, c, h, w] = x.dims();
    let [out, wc, kh, kw] = conv.weight.dims();
    // Empty channels or images: burn's convolution (the kernels cut the batch by image size).
    if wc != c || [c, h, w, out].contains(&0) {
        return None;
    }
    let ho = (h + 2 * pad[0]).checked_sub(kh)? / conv.stride[0] + 1;
    let wo = (w + 2 * pad[1]).checked_sub(kw)? / conv.stride[1] + 1;
    Some(ConvGeom {
        batch: n,
        input: [c, h, w],
        out,
        kernel: [kh, kw],
        stride: conv.stride,
        pad,
        output: [ho, wo],
    })
}

/// `conv` applied to `x` `[N, C, H, W]`: `[N, out, Ho, Wo]`, through Flotilla's kernels where
/// they cover the layer (see the module docs), else burn's `Conv2d::forward`.
pub fn conv2d(conv: &Conv2d, x: Tensor<4>) -> Tensor<4> {
    conv2d_fused(conv, x, false)
}

/// `relu(conv(x))`, the ReLU fused into the convolution (forward and backward) where
/// Flotilla's kernels cover the layer, else burn's `Conv2d::forward` and `relu`.
pub fn conv2d_relu(conv: &Conv2d, x: Tensor<4>) -> Tensor<4> {
    conv2d_fused(conv, x, true)
}

/// `conv` applied to `x`, then a ReLU when `relu`: what [`conv2d`] and [`conv2d_relu`] run.
pub(crate) fn conv2d_fused(conv: &Conv2d, x: Tensor<4>, relu: bool) -> Tensor<4> {
    let Some(geom) = geometry_of(conv, &x) else {
        let y = conv.forward(x);
        return if relu {
            burn::tensor::activation::relu(y)
        } else {
            y
        };
    };
    let bias = match &conv.bias {
        Some(bias) => bias.val(),
        None => Tensor::zeros([geom.out], &conv.weight.device()),
    };
    Tensor::from_dispatch(<Dispatch as ConvOps>::conv2d_patches(
        x.into_dispatch(),
        conv.weight.val().into_dispatch(),
        bias.into_dispatch(),
        geom,
        relu,
    ))
}
