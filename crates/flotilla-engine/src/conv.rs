//! 2-D convolution as im2col and one GEMM, for the small images Flotilla's specs train on.
//!
//! burn's CPU backends compute a convolution's weight gradient as another convolution (batch
//! and channels swapped, the output gradient as a kernel the size of the image), which is most
//! of a LeNet-5 step on Flex. Here a [`Conv2d`] layer runs as
//! `y = im2col(x) · Wᵀ + b` ([`crate::patches`]): the patch matrix `[N·Ho·Wo, C·kh·kw]` times
//! the weight as a `[out, C·kh·kw]` matrix, in burn's own matmul; burn's autodiff then gives
//! the weight gradient as one GEMM (`dYᵀ · patches`) and the input gradient as one GEMM
//! (`dY · W`) and [`col2im`](crate::patches::PatchOps::col2im). Same parameters, same module
//! (checkpoints, layouts and initialisation are burn's), the same function up to the order of
//! the float sums; deterministic. A layer this form does not cover (groups, dilation, `Same`
//! padding) runs burn's own `forward`.

use burn::nn::PaddingConfig2d;
use burn::nn::conv::Conv2d;
use burn::prelude::*;

use crate::patches::{Patches, im2col};

/// The windows of `conv` over an input of `dims`, if this form covers the layer.
fn patches_of(conv: &Conv2d, [n, c, h, w]: [usize; 4]) -> Option<Patches> {
    if conv.groups != 1 || conv.dilation != [1, 1] {
        return None;
    }
    let (top, left, bottom, right) = match conv.padding {
        PaddingConfig2d::Valid => (0, 0, 0, 0),
        PaddingConfig2d::Explicit(top, left, bottom, right) => (top, left, bottom, right),
        PaddingConfig2d::Same => return None,
    };
    let [kh, kw] = conv.kernel_size;
    let [sh, sw] = conv.stride;
    if sh == 0 || sw == 0 {
        return None;
    }
    let ho = (h + top + bottom).checked_sub(kh)? / sh + 1;
    let wo = (w + left + right).checked_sub(kw)? / sw + 1;
    Some(Patches {
        input: [n, c, h, w],
        kernel: [kh, kw],
        stride: [sh, sw],
        pad: [top, left],
        output: [ho, wo],
    })
}

/// `conv` applied to `x` `[N, C, H, W]`: `[N, out, Ho, Wo]`.
pub(crate) fn conv2d(conv: &Conv2d, x: Tensor<4>) -> Tensor<4> {
    let Some(patches) = patches_of(conv, x.dims()) else {
        return conv.forward(x);
    };
    let [n, ..] = patches.input;
    let [ho, wo] = patches.output;
    let out = conv.weight.dims()[0];
    let weight = conv.weight.val().reshape([out, patches.cols()]);
    let mut y = im2col(x, patches).matmul(weight.transpose());
    if let Some(bias) = &conv.bias {
        y = y + bias.val().unsqueeze::<2>();
    }
    y.reshape([n, ho, wo, out]).permute([0, 3, 1, 2])
}
