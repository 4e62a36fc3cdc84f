//! The windows of one convolution over one batch, and the patch matrix of one image
//! (im2col) and its adjoint (col2im), over plain `f32` slices.
//!
//! One image's patch matrix is `[C·kh·kw, Ho·Wo]`, row-major: row `(c, i, j)` (the weight's
//! own order) holds, for every output pixel, the input pixel under kernel tap `(i, j)` of
//! channel `c`, zero where the window hangs over the padding. It is `K × P` floats
//! ([`ConvGeom::patch_rows`] × [`ConvGeom::pixels`]): 78 KiB for LeNet-5's first convolution,
//! 59 KiB for its second, so it stays in L2 and is reused from image to image.

/// The input pixels under one output row of one patch row: output columns `lo..hi` read the
/// input from `start` on, every stride-th value.
struct Window {
    start: usize,
    lo: usize,
    hi: usize,
}

/// The shape of one convolution (groups 1, dilation 1, zero padding) on one input batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvGeom {
    /// Batch size.
    pub batch: usize,
    /// Input channels, height and width.
    pub input: [usize; 3],
    /// Output channels.
    pub out: usize,
    /// Window height and width.
    pub kernel: [usize; 2],
    /// Vertical and horizontal stride (at least 1).
    pub stride: [usize; 2],
    /// Zero padding above and to the left (below and to the right follow from `output`).
    pub pad: [usize; 2],
    /// Output height and width.
    pub output: [usize; 2],
}

impl ConvGeom {
    /// Values of one input image: `C·H·W`.
    pub fn image_len(&self) -> usize {
        self.input.iter().product()
    }

    /// Rows of one image's patch matrix, the weight's row length: `C·kh·kw`.
    pub fn patch_rows(&self) -> usize {
        self.input[0] * self.kernel[0] * self.kernel[1]
    }

    /// Output pixels of one image: `Ho·Wo`.
    pub fn pixels(&self) -> usize {
        self.output[0] * self.output[1]
    }

    /// Values of one output image: `out·Ho·Wo`.
    pub fn out_image_len(&self) -> usize {
        self.out * self.pixels()
    }

    /// For output row `o` and kernel row `i`: the input row, if it is inside the image.
    fn in_row(&self, o: usize, i: usize) -> Option<usize> {
        (o * self.stride[0] + i)
            .checked_sub(self.pad[0])
            .filter(|&r| r < self.input[1])
    }

    /// The output columns `lo..hi` whose input column under kernel column `j` is inside the
    /// image (empty when none is).
    fn col_range(&self, j: usize) -> (usize, usize) {
        let [sw, pw, w, wo] = [self.stride[1], self.pad[1], self.input[2], self.output[1]];
        let lo = pw.saturating_sub(j).div_ceil(sw).min(wo);
        let hi = match (w + pw).checked_sub(j + 1) {
            Some(last) => (last / sw + 1).min(wo),
            None => 0,
        };
        (lo, hi.max(lo))
    }

    /// Calls `f(segment, Some(Window { .. }))` for every output row of every patch row whose
    /// input row is inside the image and `f(segment, None)` for the others, in one fixed order
    /// (`segment`: where that output row starts in the patch matrix).
    fn walk(&self, mut f: impl FnMut(usize, Option<Window>)) {
        let [c, h, w] = self.input;
        let [kh, kw] = self.kernel;
        let [ho, wo] = self.output;
        for ch in 0..c {
            for i in 0..kh {
                for j in 0..kw {
                    let row = ((ch * kh + i) * kw + j) * ho * wo;
                    let (lo, hi) = self.col_range(j);
                    // The input column of output column `lo` (only read when `lo < hi`).
                    let first = (lo * self.stride[1] + j).saturating_sub(self.pad[1]);
                    for oh in 0..ho {
                        let window = self.in_row(oh, i).map(|r| Window {
                            start: (ch * h + r) * w + first,
                            lo,
                            hi,
                        });
                        f(row + oh * wo, window);
                    }
                }
            }
        }
    }

    /// Writes the patch matrix of one image `x` (`[C, H, W]`) into `cols` (`K × P`).
    pub fn im2col(&self, x: &[f32], cols: &mut [f32]) {
        let wo = self.output[1];
        let sw = self.stride[1];
        self.walk(|seg, window| {
            let dst = &mut cols[seg..seg + wo];
            let Some(Window { start, lo, hi }) = window else {
                dst.fill(0.0);
                return;
            };
            zero_short(&mut dst[..lo]);
            zero_short(&mut dst[hi..]);
            let src = &x[start..];
            if sw == 1 {
                copy_short(&mut dst[lo..hi], &src[..hi - lo]);
            } else {
                for (d, s) in dst[lo..hi].iter_mut().zip(src.iter().step_by(sw)) {
                    *d = *s;
                }
            }
        });
    }

    /// Adds every entry of one image's patch matrix `cols` to the pixel of `dx` (`[C, H, W]`)
    /// it was taken from: the adjoint of [`ConvGeom::im2col`], in one fixed order.
    pub fn col2im_add(&self, cols: &[f32], dx: &mut [f32]) {
        let sw = self.stride[1];
        self.walk(|seg, window| {
            if let Some(Window { start, lo, hi }) = window {
                let src = &cols[seg + lo..seg + hi];
                if sw == 1 {
                    // Contiguous on both sides: a loop the compiler vectorizes.
                    for (d, s) in dx[start..start + src.len()].iter_mut().zip(src) {
                        *d += *s;
                    }
                } else {
                    for (d, s) in dx[start..].iter_mut().step_by(sw).zip(src) {
                        *d += *s;
                    }
                }
            }
        });
    }
}

/// `dst = src` (equal lengths) in fixed steps of 8 floats the compiler inlines, the last step
/// overlapping the one before, rather than a `memcpy` call: im2col's segments are an output
/// row, 10–30 floats in LeNet-5, and the calls were 8–10 % of its step.
#[inline(always)]
fn copy_short(dst: &mut [f32], src: &[f32]) {
    const STEP: usize = 8;
    let len = dst.len().min(src.len());
    if len < STEP {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = *s;
        }
        return;
    }
    let mut at = 0;
    loop {
        let from = at.min(len - STEP);
        let d: &mut [f32; STEP] = (&mut dst[from..from + STEP]).try_into().expect("8 floats");
        let s: &[f32; STEP] = src[from..from + STEP].try_into().expect("8 floats");
        *d = *s;
        if from + STEP == len {
            return;
        }
        at += STEP;
    }
}

/// `dst = 0`, element by element (the padding's few columns, where a `memset` call costs more
/// than the stores).
#[inline(always)]
fn zero_short(dst: &mut [f32]) {
    for d in dst {
        *d = 0.0;
    }
}
