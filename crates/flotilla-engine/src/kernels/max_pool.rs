//! Max pooling as a burn backend extension: on Flex the host kernels of `pool.rs`
//! (forward with the position of each maximum, backward a scatter by those positions); on
//! other backends burn's own `max_pool2d_with_indices` and its backward. The backward on
//! `Autodiff` is hand-written over either.

// burn 0.22 deprecates NdArray and LibTorch but still ships them: the extension names them.
#![cfg_attr(any(feature = "ndarray", feature = "libtorch"), allow(deprecated))]

use burn::backend::flex::FlexTensor;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Backend, Dispatch, Flex, TensorMetadata, get_or_init_device_settings};
use burn::nn::PaddingConfig2d;
use burn::nn::pool::MaxPool2d;
use burn::prelude::*;
use burn::tensor::{DType, TensorData};
use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, unary};

use super::autodiff::record;
use super::backends::{engine_extension, impl_on_burn_backends};
use super::host;
use super::pool::{self, PoolGeom};

/// The kernels of max pooling on one backend (not differentiable; [`PoolOps`] is): burn's
/// own ops unless a backend has faster ones.
pub trait PoolKernels: Backend {
    /// The pooled `x` `[N, C, H, W]` and the position of each maximum.
    fn max_pool_forward(x: FloatTensor<Self>, g: PoolGeom) -> (FloatTensor<Self>, IntTensor<Self>) {
        burn_forward::<Self>(x, g)
    }

    /// The gradient of `x` from the output's gradient and the positions of the maxima.
    fn max_pool_backward(
        x: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        indices: IntTensor<Self>,
        g: PoolGeom,
    ) -> FloatTensor<Self> {
        burn_backward::<Self>(x, grad, indices, g)
    }
}

/// burn's max pooling, its indices in the device's own integer type (as burn's autodiff takes
/// them: wgpu has no 64-bit integers, and its backward misreads `i64` indices).
fn burn_forward<B: Backend>(x: FloatTensor<B>, g: PoolGeom) -> (FloatTensor<B>, IntTensor<B>) {
    let int_dtype = get_or_init_device_settings::<B>(&x.device()).int_dtype;
    let r = B::max_pool2d_with_indices(
        x, g.kernel, g.stride, g.padding, g.dilation, false, int_dtype,
    );
    (r.output, r.indices)
}

/// burn's backward of max pooling.
fn burn_backward<B: Backend>(
    x: FloatTensor<B>,
    grad: FloatTensor<B>,
    indices: IntTensor<B>,
    g: PoolGeom,
) -> FloatTensor<B> {
    B::max_pool2d_with_indices_backward(
        x, g.kernel, g.stride, g.padding, g.dilation, false, grad, indices,
    )
    .x_grad
}

// NdArray, LibTorch and wgpu's `Cube`: burn's own ops.
impl_on_burn_backends!(PoolKernels);

/// `[N, C, H, W]` of a contiguous 4-D `f32` tensor, with its values.
fn image(x: &FlexTensor) -> Option<([usize; 4], &[f32])> {
    (x.layout().num_dims() == 4).then_some(())?;
    Some((x.layout().shape().dims::<4>(), host::values(x)?))
}

fn flex_forward(x: &FlexTensor, g: &PoolGeom) -> Option<(FlexTensor, FlexTensor)> {
    let ([n, c, h, w], values) = image(x)?;
    let [ho, wo] = g.output([h, w])?;
    let (out, idx) = pool::forward(values, n * c, [h, w], g, [ho, wo]);
    let idx = FlexTensor::from_data(TensorData::new(idx, [n, c, ho, wo]));
    Some((host::tensor(out, vec![n, c, ho, wo]), idx))
}

fn flex_backward(x: &FlexTensor, grad: &FlexTensor, idx: &FlexTensor) -> Option<FlexTensor> {
    let ([n, c, h, w], _) = image(x)?;
    let grad = host::values(grad)?;
    let idx = (idx.dtype() == DType::I32).then(|| idx.as_slice::<i32>())??;
    (grad.len() == idx.len()).then_some(())?;
    Some(host::tensor(
        pool::backward(grad, idx, n * c, h * w),
        vec![n, c, h, w],
    ))
}

impl PoolKernels for Flex {
    fn max_pool_forward(x: FloatTensor<Self>, g: PoolGeom) -> (FloatTensor<Self>, IntTensor<Self>) {
        flex_forward(&x, &g).unwrap_or_else(|| burn_forward::<Self>(x, g))
    }

    fn max_pool_backward(
        x: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        indices: IntTensor<Self>,
        g: PoolGeom,
    ) -> FloatTensor<Self> {
        let grad = if grad.is_contiguous() {
            grad
        } else {
            grad.to_contiguous()
        };
        flex_backward(&x, &grad, &indices)
            .unwrap_or_else(|| burn_backward::<Self>(x, grad, indices, g))
    }
}

engine_extension! {
    /// Differentiable max pooling on every backend.
    pub trait PoolOps: Backend {
        /// `x` `[N, C, H, W]` max-pooled over the windows of `g`.
        fn max_pool(x: FloatTensor<Self>, g: PoolGeom) -> FloatTensor<Self>;
    }
}

/// [`PoolOps`] on every backend but `Autodiff` (Flex and burn's): its [`PoolKernels`].
impl<B: PoolKernels> PoolOps for B {
    fn max_pool(x: FloatTensor<Self>, g: PoolGeom) -> FloatTensor<Self> {
        B::max_pool_forward(x, g).0
    }
}

/// What backward needs: the input, the positions of the maxima, the windows.
#[derive(Debug, Clone)]
struct PoolState<B: Backend> {
    x: FloatTensor<B>,
    indices: IntTensor<B>,
    geom: PoolGeom,
}

/// Max pooling's backward.
#[derive(Debug)]
struct MaxPoolBackward;

impl<B: PoolKernels> Backward<B, 1> for MaxPoolBackward {
    type State = PoolState<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let s = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            B::max_pool_backward(s.x, grad, s.indices, s.geom)
        });
    }
}

impl<B: PoolKernels, C: CheckpointStrategy> PoolOps for Autodiff<B, C> {
    fn max_pool(x: FloatTensor<Self>, g: PoolGeom) -> FloatTensor<Self> {
        let (x, node) = x.into_parts();
        record(
            MaxPoolBackward.prepare::<C>([node]),
            x,
            |x| {
                let (y, indices) = B::max_pool_forward(x.clone(), g);
                (
                    y,
                    PoolState {
                        x,
                        indices,
                        geom: g,
                    },
                )
            },
            |x| B::max_pool_forward(x, g).0,
        )
    }
}

/// The windows of `m`, when its padding is symmetric and its output sizes round down (the
/// others run burn's own forward).
fn geometry(m: &MaxPool2d) -> Option<PoolGeom> {
    if m.ceil_mode {
        return None;
    }
    let padding = match m.padding {
        PaddingConfig2d::Valid => [0, 0],
        PaddingConfig2d::Explicit(top, left, bottom, right) if top == bottom && left == right => {
            [top, left]
        }
        _ => return None,
    };
    Some(PoolGeom {
        kernel: m.kernel_size,
        stride: m.stride,
        padding,
        dilation: m.dilation,
    })
}

/// `m` applied to `x` `[N, C, H, W]`: burn's [`MaxPool2d::forward`], differentiable, on
/// Flex in the kernels of `kernels/pool.rs`.
pub fn max_pool2d(m: &MaxPool2d, x: Tensor<4>) -> Tensor<4> {
    let [_, _, h, w] = x.dims();
    match geometry(m).filter(|g| g.output([h, w]).is_some()) {
        Some(g) => Tensor::from_dispatch(<Dispatch as PoolOps>::max_pool(x.into_dispatch(), g)),
        None => m.forward(x),
    }
}
