//! Layer normalization of the rows of a row-major `f32` matrix on the host: the forward pass
//! keeping each row's mean and reciprocal standard deviation, and the backward pass giving the
//! input, scale and shift gradients in one sweep. Rows are split over rayon's pool in blocks of
//! [`ROWS`] (a function of the shape alone); each block's partial scale and shift gradients are
//! added in block order, and every sum inside a row runs over the same 8 lanes, so 1 and N
//! threads give the same bits.

use multiversion::multiversion;
use rayon::prelude::*;

/// Rows per piece of work.
const ROWS: usize = 64;
/// Lanes of a row's sums (a vector register of `f32`).
pub(crate) const LANES: usize = 8;

/// `Σ f(a[i], b[i])` in [`LANES`] partial sums, added pairwise at the end (the compiler
/// vectorizes it; the order depends on the length alone).
#[inline(always)]
pub(crate) fn lane_sum(a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32) -> f32 {
    let mut acc = [0.0f32; LANES];
    let (ac, bc) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(&x, &y)| f(x, y))
        .sum();
    for (ca, cb) in ac.zip(bc) {
        for l in 0..LANES {
            acc[l] += f(ca[l], cb[l]);
        }
    }
    let [a0, a1, a2, a3, a4, a5, a6, a7] = acc;
    ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)) + tail
}

/// One row: `y = (x − mean)·rstd·γ + β`; returns `(mean, rstd)`. Compiled for AVX2 + FMA too
/// and picked at run time, as every kernel here (the same values: no operation is fused or
/// reordered, only wider).
#[multiversion(targets("x86_64+avx2+fma"))]
fn forward_row(x: &[f32], y: &mut [f32], gamma: &[f32], beta: &[f32], eps: f32) -> (f32, f32) {
    let d = x.len() as f32;
    let mean = lane_sum(x, x, |v, _| v) / d;
    let var = lane_sum(x, x, |v, _| (v - mean) * (v - mean)) / d;
    let rstd = 1.0 / (var + eps).sqrt();
    for (((o, &v), &g), &b) in y.iter_mut().zip(x).zip(gamma).zip(beta) {
        *o = (v - mean) * rstd * g + b;
    }
    (mean, rstd)
}

/// The normalized rows of `x` (`d` features each), scaled by `gamma` and shifted by `beta`,
/// with each row's mean and `1/√(var + eps)`.
pub(crate) fn forward(
    x: &[f32],
    d: usize,
    gamma: &[f32],
    beta: &[f32],
    eps: f32,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let rows = x.len() / d.max(1);
    let mut y = vec![0.0f32; x.len()];
    let (mut mean, mut rstd) = (vec![0.0f32; rows], vec![0.0f32; rows]);
    let block = ROWS * d.max(1);
    y.par_chunks_mut(block)
        .zip(x.par_chunks(block))
        .zip(mean.par_chunks_mut(ROWS).zip(rstd.par_chunks_mut(ROWS)))
        .for_each(|((y, x), (mean, rstd))| {
            for (i, (y, x)) in y.chunks_exact_mut(d).zip(x.chunks_exact(d)).enumerate() {
                (mean[i], rstd[i]) = forward_row(x, y, gamma, beta, eps);
            }
        });
    (y, mean, rstd)
}

/// What the backward of one block of rows reads.
struct Rows<'a> {
    x: &'a [f32],
    g: &'a [f32],
    mean: &'a [f32],
    rstd: &'a [f32],
}

/// One block's input gradient (into `dx`) and its partial scale and shift gradients
/// `[dγ | dβ]`, rows added in order.
#[multiversion(targets("x86_64+avx2+fma"))]
fn backward_block(r: Rows<'_>, gamma: &[f32], dx: &mut [f32]) -> Vec<f32> {
    let d = gamma.len();
    let mut partial = vec![0.0f32; 2 * d];
    let (mut xhat, mut gy) = (vec![0.0f32; d], vec![0.0f32; d]);
    let rows = r.x.chunks_exact(d).zip(r.g.chunks_exact(d));
    for (i, ((x, g), dx)) in rows.zip(dx.chunks_exact_mut(d)).enumerate() {
        let (mean, rstd) = (r.mean[i], r.rstd[i]);
        for (((h, gh), &v), (&gv, &gm)) in
            xhat.iter_mut().zip(&mut gy).zip(x).zip(g.iter().zip(gamma))
        {
            *h = (v - mean) * rstd;
            *gh = gv * gm;
        }
        let inv_d = 1.0 / d as f32;
        let a = lane_sum(&gy, &gy, |v, _| v) * inv_d;
        let b = lane_sum(&gy, &xhat, |v, h| v * h) * inv_d;
        for ((o, &gh), &h) in dx.iter_mut().zip(&gy).zip(&xhat) {
            *o = rstd * (gh - a - h * b);
        }
        let (dgamma, dbeta) = partial.split_at_mut(d);
        for (((dg, db), &gv), &h) in dgamma.iter_mut().zip(dbeta).zip(g).zip(&xhat) {
            *dg += gv * h;
            *db += gv;
        }
    }
    partial
}

/// The gradients of the input, the scale and the shift of [`forward`], given the output's
/// gradient `g` and the kept statistics.
pub(crate) fn backward(
    x: &[f32],
    g: &[f32],
    gamma: &[f32],
    mean: &[f32],
    rstd: &[f32],
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let d = gamma.len().max(1);
    let block = ROWS * d;
    let mut dx = vec![0.0f32; x.len()];
    let partials: Vec<Vec<f32>> = dx
        .par_chunks_mut(block)
        .zip(x.par_chunks(block).zip(g.par_chunks(block)))
        .zip(mean.par_chunks(ROWS).zip(rstd.par_chunks(ROWS)))
        .map(|((dx, (x, g)), (mean, rstd))| backward_block(Rows { x, g, mean, rstd }, gamma, dx))
        .collect();
    let mut sums = vec![0.0f32; 2 * gamma.len()];
    for p in &partials {
        sums.iter_mut().zip(p).for_each(|(s, v)| *s += v);
    }
    let dbeta = sums.split_off(gamma.len());
    (dx, sums, dbeta)
}
