//! The linear layer `y = x·W + b` (optionally `relu(x·W + b)`) as one burn backend extension:
//! on Flex, one GEMM with the bias as its starting value, then the ReLU over its output (on
//! the calling thread: splitting both with the product's pieces measured no faster, BENCHMARKS
//! §52); backward, the weight gradient `xᵀ·g` and the input gradient `g·Wᵀ` as
//! GEMMs over the same buffers (transposes are strides, never copies) and the bias gradient
//! as column sums in row order. The GEMMs are split over rayon's pool by shape alone
//! (`kernels/gemm.rs`), so a step is bitwise the same on 1 and 2 threads. Other backends run
//! burn's own ops behind the same extension.

// burn 0.22 deprecates NdArray and LibTorch but still ships them: the extension names them.
#![cfg_attr(any(feature = "ndarray", feature = "libtorch"), allow(deprecated))]

use burn::backend::flex::FlexTensor;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, Flex, TensorMetadata};
use burn::nn::Linear;
use burn::prelude::*;
use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, NodeGuard, Ops};

use super::autodiff::record;
use super::backends::{engine_extension, impl_on_burn_backends};
use super::gemm::{MatRef, gemm_into, gemm_new};
use super::host;

/// The kernels of a linear layer on one backend (not differentiable; [`LinearOps`] is):
/// burn's own ops unless a backend has faster ones.
pub trait LinearKernels: Backend {
    /// `x·w (+ b)`, through ReLU when `relu`: `x` `[m, k]`, `w` `[k, n]`, `b` `[n]`.
    fn linear_forward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: Option<FloatTensor<Self>>,
        relu: bool,
    ) -> FloatTensor<Self> {
        burn_forward::<Self>(x, w, b, relu)
    }

    /// `op(a)·op(b)`, `op` the transpose where asked.
    fn matmul_t(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        ta: bool,
        tb: bool,
    ) -> FloatTensor<Self> {
        burn_matmul_t::<Self>(a, b, ta, tb)
    }

    /// The sum of the rows of `g` `[m, n]`: `[n]`, each column summed in row order.
    fn sum_rows(g: FloatTensor<Self>) -> FloatTensor<Self> {
        burn_sum_rows::<Self>(g)
    }
}

/// burn's own ops: the kernels of every backend but Flex (and Flex's for another dtype).
fn burn_forward<B: Backend>(
    x: FloatTensor<B>,
    w: FloatTensor<B>,
    b: Option<FloatTensor<B>>,
    relu: bool,
) -> FloatTensor<B> {
    let mut y = B::float_matmul(x, w);
    if let Some(b) = b {
        let n = b.shape()[0];
        y = B::float_add(y, B::float_reshape(b, [1, n].into()));
    }
    if relu { B::relu(y) } else { y }
}

/// burn's `op(a)·op(b)`.
fn burn_matmul_t<B: Backend>(
    a: FloatTensor<B>,
    b: FloatTensor<B>,
    ta: bool,
    tb: bool,
) -> FloatTensor<B> {
    let a = if ta { B::float_transpose(a) } else { a };
    let b = if tb { B::float_transpose(b) } else { b };
    B::float_matmul(a, b)
}

/// burn's sum of the rows of `g`.
fn burn_sum_rows<B: Backend>(g: FloatTensor<B>) -> FloatTensor<B> {
    let n = g.shape()[1];
    B::float_reshape(B::float_sum_dim(g, 0), [n].into())
}

// NdArray, LibTorch and wgpu's `Cube`: burn's own ops.
impl_on_burn_backends!(LinearKernels);

/// Flex's forward: the bias rows as the GEMM's starting value, then ReLU in place.
fn flex_forward(
    x: &FlexTensor,
    w: &FlexTensor,
    b: Option<&FlexTensor>,
    relu: bool,
) -> Option<FlexTensor> {
    let (xm, wm) = (host::matrix(x)?, host::matrix(w)?);
    let (m, n) = (xm.rows, wm.cols);
    let mut out = match b {
        Some(b) => {
            let bias = host::values(b).filter(|v| v.len() == n)?;
            let mut rows = Vec::with_capacity(m * n);
            (0..m).for_each(|_| rows.extend_from_slice(bias));
            gemm_into(&mut rows, xm, wm, true);
            rows
        }
        None => gemm_new(xm, wm),
    };
    if relu {
        // As Flex's ReLU: NaN passes, everything not above zero becomes zero.
        out.iter_mut()
            .for_each(|v| *v = if v.is_nan() || *v > 0.0 { *v } else { 0.0 });
    }
    Some(host::tensor(out, vec![m, n]))
}

impl LinearKernels for Flex {
    fn linear_forward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: Option<FloatTensor<Self>>,
        relu: bool,
    ) -> FloatTensor<Self> {
        match flex_forward(&x, &w, b.as_ref(), relu) {
            Some(y) => y,
            None => burn_forward::<Self>(x, w, b, relu),
        }
    }

    fn matmul_t(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        ta: bool,
        tb: bool,
    ) -> FloatTensor<Self> {
        let views = host::matrix(&a).zip(host::matrix(&b));
        let Some((am, bm)) = views else {
            return burn_matmul_t::<Self>(a, b, ta, tb);
        };
        let am = if ta { am.t() } else { am };
        let bm = if tb { bm.t() } else { bm };
        if am.cols != bm.rows {
            return burn_matmul_t::<Self>(a, b, ta, tb);
        }
        host::tensor(gemm_new(am, bm), vec![am.rows, bm.cols])
    }

    fn sum_rows(g: FloatTensor<Self>) -> FloatTensor<Self> {
        let Some(gm) = host::matrix(&g) else {
            return burn_sum_rows::<Self>(g);
        };
        host::tensor(column_sums(gm), vec![gm.cols])
    }
}

/// Each column's sum, rows added in order (deterministic, one pass over the rows; a
/// row-major `g` as whole rows, which the compiler vectorizes).
fn column_sums(g: MatRef<'_>) -> Vec<f32> {
    let mut sums = vec![0.0f32; g.cols];
    for i in 0..g.rows {
        let row = &g.data[i * g.rs..];
        if g.cs == 1 {
            sums.iter_mut()
                .zip(&row[..g.cols])
                .for_each(|(s, v)| *s += v);
        } else {
            for (j, s) in sums.iter_mut().enumerate() {
                *s += row[j * g.cs];
            }
        }
    }
    sums
}

engine_extension! {
    /// The differentiable linear layer of every backend.
    pub trait LinearOps: Backend {
        /// `relu?(x·w + b)`: `x` `[m, k]`, `w` `[k, n]`, `b` `[n]`.
        fn linear(
            x: FloatTensor<Self>,
            w: FloatTensor<Self>,
            b: FloatTensor<Self>,
            relu: bool,
        ) -> FloatTensor<Self>;
        /// `relu?(x·w)`.
        fn linear_no_bias(
            x: FloatTensor<Self>,
            w: FloatTensor<Self>,
            relu: bool,
        ) -> FloatTensor<Self>;
    }
}

/// [`LinearOps`] on every backend but `Autodiff` (Flex and burn's): its [`LinearKernels`].
impl<B: LinearKernels> LinearOps for B {
    fn linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
        relu: bool,
    ) -> FloatTensor<Self> {
        B::linear_forward(x, w, Some(b), relu)
    }

    fn linear_no_bias(x: FloatTensor<Self>, w: FloatTensor<Self>, relu: bool) -> FloatTensor<Self> {
        B::linear_forward(x, w, None, relu)
    }
}

/// What backward needs: the input, the weight and (with ReLU) the output.
#[derive(Debug, Clone)]
struct LinearState<B: Backend> {
    x: FloatTensor<B>,
    w: FloatTensor<B>,
    relu_output: Option<FloatTensor<B>>,
}

impl<B: Backend> LinearState<B> {
    fn new(x: FloatTensor<B>, w: FloatTensor<B>, y: &FloatTensor<B>, relu: bool) -> Self {
        Self {
            x,
            w,
            relu_output: relu.then(|| y.clone()),
        }
    }
}

/// The gradients of a linear layer for the parents that need one (`x`, `w`, then `b` when
/// there is one).
fn linear_backward<B: LinearKernels, const N: usize>(
    ops: Ops<LinearState<B>, N>,
    grads: &mut Gradients,
) {
    let mut g = grads.consume::<B>(&ops.node);
    let state = ops.state;
    if let Some(y) = state.relu_output {
        g = B::relu_backward(y, g);
    }
    let mut parents = ops.parents.into_iter();
    let (px, pw, pb) = (
        parents.next().flatten(),
        parents.next().flatten(),
        parents.next().flatten(),
    );
    if let Some(p) = pb {
        grads.register::<B>(p.id, B::sum_rows(g.clone()));
    }
    if let Some(p) = pw {
        grads.register::<B>(p.id, B::matmul_t(state.x, g.clone(), true, false));
    }
    if let Some(p) = px {
        grads.register::<B>(p.id, B::matmul_t(g, state.w, false, true));
    }
}

/// Backward of a linear layer: parents `x`, `w` and, with a bias, `b`.
#[derive(Debug)]
struct LinearBackward;

impl<B: LinearKernels, const N: usize> Backward<B, N> for LinearBackward {
    type State = LinearState<B>;

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        linear_backward::<B, N>(ops, grads);
    }
}

/// The linear layer on `Autodiff`: the forward on `B`, recorded with the nodes of `x`, `w`
/// and (when there is one) `b` as its parents.
fn linear_autodiff<B: LinearKernels, C: CheckpointStrategy, const N: usize>(
    nodes: [NodeGuard; N],
    x: FloatTensor<B>,
    w: FloatTensor<B>,
    b: Option<FloatTensor<B>>,
    relu: bool,
) -> FloatTensor<Autodiff<B, C>> {
    let y = B::linear_forward(x.clone(), w.clone(), b, relu);
    record(
        LinearBackward.prepare::<C>(nodes),
        (x, w, y),
        |(x, w, y)| {
            let state = LinearState::new(x, w, &y, relu);
            (y, state)
        },
        |(_, _, y)| y,
    )
}

impl<B: LinearKernels, C: CheckpointStrategy> LinearOps for Autodiff<B, C> {
    fn linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
        relu: bool,
    ) -> FloatTensor<Self> {
        let nodes = [x.node(), w.node(), b.node()];
        let [x, w, b] = [x, w, b].map(|t| t.into_primitive());
        linear_autodiff::<B, C, 3>(nodes, x, w, Some(b), relu)
    }

    fn linear_no_bias(x: FloatTensor<Self>, w: FloatTensor<Self>, relu: bool) -> FloatTensor<Self> {
        let nodes = [x.node(), w.node()];
        let [x, w] = [x, w].map(|t| t.into_primitive());
        linear_autodiff::<B, C, 2>(nodes, x, w, None, relu)
    }
}

/// `layer` applied to `x` (any rank, features last), through ReLU when `relu`: burn's
/// [`Linear::forward`] (and a ReLU after it), differentiable, on Flex in the kernels above.
pub fn linear<const D: usize>(layer: &Linear, x: Tensor<D>, relu: bool) -> Tensor<D> {
    let bias = layer.bias.as_ref().map(|b| b.val());
    linear_of(layer.weight.val(), bias, x, relu)
}

/// [`linear`] with the weight `w` `[k, n]` and bias `b` `[n]` given as tensors (the three
/// projections of attention concatenated into one product).
pub(crate) fn linear_of<const D: usize>(
    w: Tensor<2>,
    bias: Option<Tensor<1>>,
    x: Tensor<D>,
    relu: bool,
) -> Tensor<D> {
    let dims = x.dims();
    let k = dims[D - 1];
    let rows = dims[..D - 1].iter().product::<usize>();
    let x2 = x.reshape([rows, k]);
    let n = w.dims()[1];
    let y = match bias {
        Some(b) => <Dispatch as LinearOps>::linear(
            x2.into_dispatch(),
            w.into_dispatch(),
            b.into_dispatch(),
            relu,
        ),
        None => {
            <Dispatch as LinearOps>::linear_no_bias(x2.into_dispatch(), w.into_dispatch(), relu)
        }
    };
    let y = Tensor::<2>::from_dispatch(y);
    let mut out = dims;
    out[D - 1] = n;
    y.reshape(out)
}
