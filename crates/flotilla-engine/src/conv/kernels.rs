//! The convolution's forward and backward over plain `f32` slices: per image, its patch matrix
//! in a per-thread buffer reused from image to image and from call to call, and one GEMM
//! (the `gemm` crate Flex itself multiplies with, one thread per call:
//! [`crate::kernels::gemm::gemm_serial`]).
//!
//! The batch is cut into fixed blocks of [`IMAGES_PER_BLOCK`] images, run over rayon's pool
//! (`RAYON_NUM_THREADS`, which `--threads` sets per rank). Forward and input gradient are per
//! image, so any split gives the same values; the weight and bias gradients are summed per
//! block, image after image, and the blocks' partial sums are then added in block order, so
//! the result is bitwise the same whatever the number of threads.
//!
//! Every layer takes the GEMM path, also LeNet-5's first convolution with its one input
//! channel: against Flex's direct convolution (small-channel path included) the step's CPU
//! time fell at batch 64 and 256 (`BENCHMARKS.md` §22); a direct kernel of our own for one
//! input channel has not been written and measured against it.

use std::cell::RefCell;

use rayon::prelude::*;

use super::geometry::ConvGeom;
use crate::kernels::gemm::{MatRef, gemm_serial};

/// Images per block of the batch split: the unit of work of one rayon task and of one
/// partial weight gradient. Fixed, so the summation order never depends on the threads.
pub const IMAGES_PER_BLOCK: usize = 4;

thread_local! {
    /// This thread's patch matrix, patch-gradient matrix and masked output gradient, grown
    /// to the largest convolution seen and reused by every later call.
    static SCRATCH: RefCell<Scratch> = const {
        RefCell::new(Scratch { cols: Vec::new(), dcols: Vec::new(), dy: Vec::new() })
    };
}

/// One thread's work buffers.
struct Scratch {
    /// A patch matrix, `K × P`.
    cols: Vec<f32>,
    /// A patch-gradient matrix, `K × P`.
    dcols: Vec<f32>,
    /// One image's output gradient through the fused ReLU, `out × P`.
    dy: Vec<f32>,
}

/// The buffers [`with_scratch`] lends, cut to the lengths asked for.
struct Buffers<'a> {
    cols: &'a mut [f32],
    dcols: &'a mut [f32],
    dy: &'a mut [f32],
}

/// `f` with this thread's scratch buffers: the two patch matrices `patch` long, the output
/// gradient `out` long.
fn with_scratch<R>(patch: usize, out: usize, f: impl FnOnce(Buffers<'_>) -> R) -> R {
    SCRATCH.with(|cell| {
        let mut scratch = cell.borrow_mut();
        let Scratch { cols, dcols, dy } = &mut *scratch;
        if cols.len() < patch {
            cols.resize(patch, 0.0);
            dcols.resize(patch, 0.0);
        }
        if dy.len() < out {
            dy.resize(out, 0.0);
        }
        f(Buffers {
            cols: &mut cols[..patch],
            dcols: &mut dcols[..patch],
            dy: &mut dy[..out],
        })
    })
}

/// burn's ReLU (Flex's, value for value): `v` where it is positive or NaN, else `0`. Written
/// as a select, not a conditional store, so it vectorizes (a branch on the sign mispredicts
/// half the time: the step took 10 % more CPU time with it).
fn relu_in_place(values: &mut [f32]) {
    for v in values {
        *v = if v.is_nan() || *v > 0.0 { *v } else { 0.0 };
    }
}

/// burn's ReLU backward (Flex's): `dy` where the output `y` is positive or NaN, else `0`.
fn relu_grad(y: &[f32], dy: &[f32], out: &mut [f32]) {
    for ((o, &y), &g) in out.iter_mut().zip(y).zip(dy) {
        *o = if y.is_nan() || y > 0.0 { g } else { 0.0 };
    }
}

/// The convolution of the batch `x` (`[N, C, H, W]`) with `weight` (`[out, C, kh, kw]`) and
/// `bias` (`[out]`), through ReLU when `relu` (each image while it is in cache):
/// `[N, out, Ho, Wo]`.
pub fn forward(g: &ConvGeom, x: &[f32], weight: &[f32], bias: &[f32], relu: bool) -> Vec<f32> {
    let (k, p) = (g.patch_rows(), g.pixels());
    let w = MatRef::row_major(weight, g.out, k);
    let mut y = vec![0.0f32; g.batch * g.out_image_len()];
    y.par_chunks_mut(g.out_image_len() * IMAGES_PER_BLOCK)
        .zip(x.par_chunks(g.image_len() * IMAGES_PER_BLOCK))
        .for_each(|(y_block, x_block)| {
            with_scratch(k * p, 0, |Buffers { cols, .. }| {
                let images = y_block
                    .chunks_mut(g.out_image_len())
                    .zip(x_block.chunks(g.image_len()));
                for (y_image, x_image) in images {
                    g.im2col(x_image, cols);
                    for (row, b) in y_image.chunks_mut(p).zip(bias) {
                        row.fill(*b);
                    }
                    gemm_serial(y_image, w, MatRef::row_major(cols, k, p), true);
                    if relu {
                        relu_in_place(y_image);
                    }
                }
            });
        });
    y
}

/// The gradients of a convolution: input (when asked for), weight and bias.
pub struct Grads {
    /// `[N, C, H, W]`, or `None` when not asked for.
    pub x: Option<Vec<f32>>,
    /// `[out, C, kh, kw]`.
    pub weight: Vec<f32>,
    /// `[out]`.
    pub bias: Vec<f32>,
}

/// What the backward of [`forward`] reads, batch-wide (or one block's part of it).
#[derive(Clone, Copy)]
pub struct BackwardInputs<'a> {
    /// The forward's input, `[N, C, H, W]`.
    pub x: &'a [f32],
    /// The weight, `[out, C, kh, kw]`.
    pub weight: &'a [f32],
    /// The gradient of the output, `[N, out, Ho, Wo]`.
    pub dy: &'a [f32],
    /// With a fused ReLU, the forward's output (after the ReLU), `[N, out, Ho, Wo]`.
    pub relu_output: Option<&'a [f32]>,
}

impl<'a> BackwardInputs<'a> {
    /// Block `b` of the batch: its images of `x`, `dy` and the output.
    fn block(&self, g: &ConvGeom, b: usize) -> Self {
        let cut = |v: &'a [f32], image: usize| {
            let len = image * IMAGES_PER_BLOCK;
            &v[b * len..((b + 1) * len).min(v.len())]
        };
        Self {
            x: cut(self.x, g.image_len()),
            weight: self.weight,
            dy: cut(self.dy, g.out_image_len()),
            relu_output: self.relu_output.map(|y| cut(y, g.out_image_len())),
        }
    }
}

/// The gradients of [`forward`] (through its ReLU when `input.relu_output` is given):
/// input (only `with_input`), weight and bias.
pub fn backward(g: &ConvGeom, input: BackwardInputs<'_>, with_input: bool) -> Grads {
    let blocks = g.batch.div_ceil(IMAGES_PER_BLOCK);
    let (dx, partials) = if with_input {
        let mut dx = vec![0.0f32; input.x.len()];
        let partials: Vec<_> = dx
            .par_chunks_mut(g.image_len() * IMAGES_PER_BLOCK)
            .enumerate()
            .map(|(b, dx_block)| block_grads(g, input.block(g, b), Some(dx_block)))
            .collect();
        (Some(dx), partials)
    } else {
        let partials: Vec<_> = (0..blocks)
            .into_par_iter()
            .map(|b| block_grads(g, input.block(g, b), None))
            .collect();
        (None, partials)
    };
    let mut partials = partials.into_iter();
    let (mut dw, mut db) = partials
        .next()
        .unwrap_or_else(|| (vec![0.0; g.out * g.patch_rows()], vec![0.0; g.out]));
    for (pw, pb) in partials {
        add(&mut dw, &pw);
        add(&mut db, &pb);
    }
    Grads {
        x: dx,
        weight: dw,
        bias: db,
    }
}

/// `acc += v`, element by element.
fn add(acc: &mut [f32], v: &[f32]) {
    for (a, b) in acc.iter_mut().zip(v) {
        *a += *b;
    }
}

/// One block's partial weight and bias gradients, summed image after image, and its input
/// gradient written into `dx_block` when given.
fn block_grads(
    g: &ConvGeom,
    input: BackwardInputs<'_>,
    mut dx_block: Option<&mut [f32]>,
) -> (Vec<f32>, Vec<f32>) {
    let (k, p) = (g.patch_rows(), g.pixels());
    let w = MatRef::row_major(input.weight, g.out, k);
    let mut dw = vec![0.0f32; g.out * k];
    let mut db = vec![0.0f32; g.out];
    let masked_len = if input.relu_output.is_some() {
        g.out_image_len()
    } else {
        0
    };
    with_scratch(k * p, masked_len, |Buffers { cols, dcols, dy }| {
        let images = input
            .x
            .chunks(g.image_len())
            .zip(input.dy.chunks(g.out_image_len()));
        for (n, (x_image, dy_image)) in images.enumerate() {
            let dy_image = match input.relu_output {
                Some(y) => {
                    let len = g.out_image_len();
                    relu_grad(&y[n * len..(n + 1) * len], dy_image, dy);
                    &*dy
                }
                None => dy_image,
            };
            g.im2col(x_image, cols);
            let dy_mat = MatRef::row_major(dy_image, g.out, p);
            // dW += dY · colsᵀ: [out, P] · [P, K].
            gemm_serial(&mut dw, dy_mat, MatRef::row_major(cols, k, p).t(), true);
            for (b, row) in db.iter_mut().zip(dy_image.chunks(p)) {
                *b += row.iter().sum::<f32>();
            }
            if let Some(dx_block) = dx_block.as_deref_mut() {
                // dcols = Wᵀ · dY: [K, out] · [out, P], then every entry back to its pixel.
                gemm_serial(dcols, w.t(), dy_mat, false);
                let len = g.image_len();
                g.col2im_add(dcols, &mut dx_block[n * len..(n + 1) * len]);
            }
        }
    });
    (dw, db)
}
