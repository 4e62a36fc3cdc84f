//! The patches of an image batch (im2col) and their adjoint (col2im), as a differentiable burn
//! backend extension: what [`crate::conv`] builds a convolution from.
//!
//! [`im2col`] lays every k×k window of `x` `[N, C, H, W]` out as one row of a matrix
//! `[N·Ho·Wo, C·kh·kw]` (rows in output order `n, oh, ow`; columns in weight order `c, i, j`;
//! zeros where the window hangs over the padding). Its backward is [`PatchOps::col2im`], which
//! adds each row's values back to the pixels they came from, in one fixed order (so the
//! gradient is deterministic). Both are host loops over `f32`; the GEMMs around them are
//! burn's own matmul.

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, Flex, TensorMetadata, backend_extension};
use burn::prelude::*;
use burn::tensor::TensorData;
use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind, unary};

/// The geometry of a convolution's windows over one input batch (dilation 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Patches {
    /// Batch size, channels, height and width of the input.
    pub input: [usize; 4],
    /// Window height and width.
    pub kernel: [usize; 2],
    /// Vertical and horizontal stride.
    pub stride: [usize; 2],
    /// Zero padding above and to the left (the rows and columns below and to the right follow
    /// from the output size).
    pub pad: [usize; 2],
    /// Output height and width.
    pub output: [usize; 2],
}

impl Patches {
    /// Rows of the patch matrix: `N·Ho·Wo`.
    pub fn rows(&self) -> usize {
        self.input[0] * self.output[0] * self.output[1]
    }

    /// Columns of the patch matrix: `C·kh·kw`.
    pub fn cols(&self) -> usize {
        self.input[1] * self.kernel[0] * self.kernel[1]
    }

    /// For output row `o` and kernel row `i`: the input row, if it is inside the image.
    fn in_row(&self, o: usize, i: usize) -> Option<usize> {
        (o * self.stride[0] + i)
            .checked_sub(self.pad[0])
            .filter(|&r| r < self.input[2])
    }

    /// For output column `o` and kernel column `j`: the input column, if inside the image.
    fn in_col(&self, o: usize, j: usize) -> Option<usize> {
        (o * self.stride[1] + j)
            .checked_sub(self.pad[1])
            .filter(|&c| c < self.input[3])
    }

    /// Calls `f(patch_index, pixel_index)` for every patch entry that lies inside the image,
    /// in one fixed order (row by row of the patch matrix).
    fn for_each(&self, mut f: impl FnMut(usize, usize)) {
        let [n, c, h, w] = self.input;
        let [kh, kw] = self.kernel;
        let [ho, wo] = self.output;
        let mut row = 0;
        for b in 0..n {
            for oh in 0..ho {
                for ow in 0..wo {
                    let base = row * self.cols();
                    for ch in 0..c {
                        let plane = (b * c + ch) * h * w;
                        for i in 0..kh {
                            let Some(r) = self.in_row(oh, i) else {
                                continue;
                            };
                            for j in 0..kw {
                                if let Some(col) = self.in_col(ow, j) {
                                    f(base + (ch * kh + i) * kw + j, plane + r * w + col);
                                }
                            }
                        }
                    }
                    row += 1;
                }
            }
        }
    }

    /// The patch matrix of the image `x` (`[N, C, H, W]`, row-major).
    pub fn im2col(&self, x: &[f32]) -> Vec<f32> {
        let mut cols = vec![0.0f32; self.rows() * self.cols()];
        self.for_each(|p, i| cols[p] = x[i]);
        cols
    }

    /// The adjoint of [`Patches::im2col`]: every patch value added to its pixel.
    pub fn col2im(&self, cols: &[f32]) -> Vec<f32> {
        let mut x = vec![0.0f32; self.input.iter().product()];
        self.for_each(|p, i| x[i] += cols[p]);
        x
    }
}

/// The backend side of the patch ops.
#[backend_extension(
    Flex,
    NdArray: cfg(feature = "ndarray"),
    LibTorch: cfg(feature = "libtorch"),
    Autodiff,
)]
pub trait PatchOps: Backend {
    /// The patch matrix `[N·Ho·Wo, C·kh·kw]` of the image batch `x` (see [`Patches`]).
    fn im2col(x: FloatTensor<Self>, patches: Patches) -> FloatTensor<Self>;
    /// The image batch `[N, C, H, W]` whose pixels are the sums of their patch entries.
    fn col2im(cols: FloatTensor<Self>, patches: Patches) -> FloatTensor<Self>;
}

/// `f` applied to a tensor's values on the host, its result shaped `shape` on the same device.
fn on_host<B: Backend>(
    tensor: FloatTensor<B>,
    shape: Vec<usize>,
    f: impl FnOnce(&[f32]) -> Vec<f32>,
) -> FloatTensor<B> {
    let device = tensor.device();
    let values = burn::tensor::try_read_sync(B::float_into_data(tensor))
        .and_then(|r| r.ok())
        .and_then(|data| data.try_into_vec::<f32>().ok());
    // A backend op cannot fail: a tensor that cannot be read (never on a CPU backend) gives
    // zeros of the right shape.
    let out = match values {
        Some(v) => f(&v),
        None => vec![0.0; shape.iter().product()],
    };
    B::float_from_data(TensorData::new(out, shape), &device)
}

/// The patch ops of any backend, through host memory.
fn host_im2col<B: Backend>(x: FloatTensor<B>, p: Patches) -> FloatTensor<B> {
    on_host::<B>(x, vec![p.rows(), p.cols()], |v| p.im2col(v))
}

fn host_col2im<B: Backend>(cols: FloatTensor<B>, p: Patches) -> FloatTensor<B> {
    on_host::<B>(cols, p.input.to_vec(), |v| p.col2im(v))
}

impl PatchOps for Flex {
    fn im2col(x: FloatTensor<Self>, patches: Patches) -> FloatTensor<Self> {
        host_im2col::<Self>(x, patches)
    }
    fn col2im(cols: FloatTensor<Self>, patches: Patches) -> FloatTensor<Self> {
        host_col2im::<Self>(cols, patches)
    }
}

#[cfg(feature = "ndarray")]
impl PatchOps for burn::backend::NdArray {
    fn im2col(x: FloatTensor<Self>, patches: Patches) -> FloatTensor<Self> {
        host_im2col::<Self>(x, patches)
    }
    fn col2im(cols: FloatTensor<Self>, patches: Patches) -> FloatTensor<Self> {
        host_col2im::<Self>(cols, patches)
    }
}

// burn 0.22 deprecates its LibTorch backend but still ships it (the `libtorch` feature).
#[cfg(feature = "libtorch")]
#[allow(deprecated)]
impl PatchOps for burn::backend::LibTorch {
    fn im2col(x: FloatTensor<Self>, patches: Patches) -> FloatTensor<Self> {
        host_im2col::<Self>(x, patches)
    }
    fn col2im(cols: FloatTensor<Self>, patches: Patches) -> FloatTensor<Self> {
        host_col2im::<Self>(cols, patches)
    }
}

/// im2col's backward: col2im of the gradient.
#[derive(Debug)]
struct Im2col;

impl<B: Backend + PatchOps> Backward<B, 1> for Im2col {
    type State = Patches;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let patches = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            B::col2im(grad, patches)
        });
    }
}

/// col2im's backward: im2col of the gradient.
#[derive(Debug)]
struct Col2im;

impl<B: Backend + PatchOps> Backward<B, 1> for Col2im {
    type State = Patches;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let patches = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            B::im2col(grad, patches)
        });
    }
}

impl<B: Backend + PatchOps, C: CheckpointStrategy> PatchOps for Autodiff<B, C> {
    fn im2col(x: FloatTensor<Self>, patches: Patches) -> FloatTensor<Self> {
        let guard = x.node();
        let output = B::im2col(x.into_primitive(), patches);
        match Im2col.prepare::<C>([guard]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(patches, output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        }
    }

    fn col2im(cols: FloatTensor<Self>, patches: Patches) -> FloatTensor<Self> {
        let guard = cols.node();
        let output = B::col2im(cols.into_primitive(), patches);
        match Col2im.prepare::<C>([guard]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(patches, output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        }
    }
}

/// The patch matrix `[N·Ho·Wo, C·kh·kw]` of `x` `[N, C, H, W]`, differentiable.
pub(crate) fn im2col(x: Tensor<4>, patches: Patches) -> Tensor<2> {
    Tensor::from_dispatch(<Dispatch as PatchOps>::im2col(x.into_dispatch(), patches))
}

/// The adjoint of [`im2col`]: patch entries summed into an image batch, differentiable.
#[cfg(test)]
pub(crate) fn col2im(cols: Tensor<2>, patches: Patches) -> Tensor<4> {
    Tensor::from_dispatch(<Dispatch as PatchOps>::col2im(
        cols.into_dispatch(),
        patches,
    ))
}
