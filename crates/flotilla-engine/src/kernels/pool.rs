//! Max pooling of `f32` image batches on the host: each plane (one sample's channel) by one
//! thread of rayon's pool, the 2×2 stride-2 window (every max pooling of the spec models) in
//! a loop of its own, any other kernel, stride, padding and dilation in the general one. Ties
//! and NaN as burn's Flex: the first maximum in scan order wins, a NaN always does.

use rayon::prelude::*;

/// The windows of a max pooling (zero-free padding: padded positions are never chosen).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolGeom {
    /// Window height and width.
    pub kernel: [usize; 2],
    /// Vertical and horizontal stride.
    pub stride: [usize; 2],
    /// Padding on each side, top/bottom and left/right.
    pub padding: [usize; 2],
    /// Dilation.
    pub dilation: [usize; 2],
}

impl PoolGeom {
    /// The output height and width for an input plane of `[h, w]` (floor mode; `None` when
    /// the window does not fit).
    pub fn output(&self, [h, w]: [usize; 2]) -> Option<[usize; 2]> {
        let dim = |i: usize, len: usize| {
            let span = self.dilation[i] * (self.kernel[i].checked_sub(1)?) + 1;
            let padded = len + 2 * self.padding[i];
            (self.stride[i] > 0 && padded >= span).then(|| (padded - span) / self.stride[i] + 1)
        };
        Some([dim(0, h)?, dim(1, w)?])
    }

    fn is_two_by_two(&self) -> bool {
        self.kernel == [2, 2]
            && self.stride == [2, 2]
            && self.padding == [0, 0]
            && self.dilation == [1, 1]
    }
}

/// Whether `v` replaces the best value so far.
#[inline]
fn wins(v: f32, best: f32) -> bool {
    v > best || v.is_nan()
}

/// One plane, 2×2 windows, stride 2.
fn plane_2x2(x: &[f32], w: usize, [ho, wo]: [usize; 2], out: &mut [f32], idx: &mut [i32]) {
    for oh in 0..ho {
        let (r0, r1) = (2 * oh * w, (2 * oh + 1) * w);
        for ow in 0..wo {
            let c = 2 * ow;
            let (mut best, mut at) = (x[r0 + c], r0 + c);
            for p in [r0 + c + 1, r1 + c, r1 + c + 1] {
                if wins(x[p], best) {
                    (best, at) = (x[p], p);
                }
            }
            out[oh * wo + ow] = best;
            idx[oh * wo + ow] = at as i32;
        }
    }
}

/// The input positions of window `o` along one axis: `(first kernel tap, end)` inside the
/// image, as Flex's `valid_range_maxpool`.
fn taps(
    o: usize,
    k: usize,
    s: usize,
    p: usize,
    d: usize,
    len: usize,
) -> impl Iterator<Item = usize> {
    (0..k).filter_map(move |t| (o * s + t * d).checked_sub(p).filter(|&i| i < len))
}

/// One plane, any window.
fn plane_general(
    x: &[f32],
    [h, w]: [usize; 2],
    g: &PoolGeom,
    [ho, wo]: [usize; 2],
    out: &mut [f32],
    idx: &mut [i32],
) {
    for oh in 0..ho {
        for ow in 0..wo {
            let (mut best, mut at) = (f32::NEG_INFINITY, -1i32);
            for ih in taps(oh, g.kernel[0], g.stride[0], g.padding[0], g.dilation[0], h) {
                for iw in taps(ow, g.kernel[1], g.stride[1], g.padding[1], g.dilation[1], w) {
                    let p = ih * w + iw;
                    if at < 0 || wins(x[p], best) {
                        (best, at) = (x[p], p as i32);
                    }
                }
            }
            out[oh * wo + ow] = best;
            idx[oh * wo + ow] = at;
        }
    }
}

/// Max pooling of `x` (`planes` planes of `[h, w]`, contiguous): the outputs and, for each,
/// the position of its maximum within its plane (`-1`: a window wholly in the padding).
pub(crate) fn forward(
    x: &[f32],
    planes: usize,
    hw: [usize; 2],
    g: &PoolGeom,
    out_hw: [usize; 2],
) -> (Vec<f32>, Vec<i32>) {
    let (plane_in, plane_out) = (hw[0] * hw[1], out_hw[0] * out_hw[1]);
    let mut out = vec![0.0f32; planes * plane_out];
    let mut idx = vec![0i32; planes * plane_out];
    let fast = g.is_two_by_two();
    out.par_chunks_mut(plane_out.max(1))
        .zip(idx.par_chunks_mut(plane_out.max(1)))
        .zip(x.par_chunks(plane_in.max(1)))
        .with_min_len(8)
        .for_each(|((o, i), xp)| {
            if fast {
                plane_2x2(xp, hw[1], out_hw, o, i);
            } else {
                plane_general(xp, hw, g, out_hw, o, i);
            }
        });
    (out, idx)
}

/// The input gradient of max pooling: each output's gradient added to the position of its
/// maximum (in output order within a plane, so deterministic).
pub(crate) fn backward(grad: &[f32], idx: &[i32], planes: usize, plane_in: usize) -> Vec<f32> {
    let plane_out = grad.len() / planes.max(1);
    let mut gx = vec![0.0f32; planes * plane_in];
    gx.par_chunks_mut(plane_in.max(1))
        .zip(grad.par_chunks(plane_out.max(1)))
        .zip(idx.par_chunks(plane_out.max(1)))
        .with_min_len(8)
        .for_each(|((gp, go), ip)| {
            for (&g, &i) in go.iter().zip(ip) {
                if let Some(slot) = usize::try_from(i).ok().and_then(|i| gp.get_mut(i)) {
                    *slot += g;
                }
            }
        });
    gx
}
