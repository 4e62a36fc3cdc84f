//! The gradient at the output of a linear layer with ReLU on Flex, before its two GEMMs:
//! ReLU's mask (the gradient kept where the output is above zero or NaN, as Flex's
//! `relu_backward`) and the bias gradient (each column summed in row order), in one pass over
//! the gradient, in place (burn copies it first only when another tensor shares it), split
//! over rayon's pool by columns. Each column is masked and summed by one thread in row order
//! whatever the number of threads, so the values are bitwise those of Flex's mask and then
//! the sums on one thread. Before, the mask was a new tensor and the sums a second pass, both
//! on one thread while the other waited (MLP 256 on 2 threads, issue 37; no change beyond the
//! noise measured, BENCHMARKS §52).

use multiversion::multiversion;
use rayon::prelude::*;

/// Values per piece, at least (smaller gradients are not split).
const GRAIN: usize = 1 << 15;
/// Piece boundaries fall on multiples of this many columns (a cache line of `f32`s).
const ALIGN: usize = 16;

/// Masks the row-major `m × n` gradient `g` in place by the ReLU output `y` (the same shape)
/// and returns the column sums of the result (when `sums`).
///
/// # Panics
/// If `g` or `y` does not hold `m × n` values (a bug of the caller).
pub(crate) fn mask_and_sums(
    g: &mut [f32],
    (m, n): (usize, usize),
    y: &[f32],
    sums: bool,
) -> Option<Vec<f32>> {
    assert!(
        g.len() == m * n && y.len() == m * n,
        "mask_and_sums: {} values for [{m}, {n}]",
        g.len()
    );
    let threads = rayon::current_num_threads();
    let pieces = if threads > 1 && m * n >= 2 * GRAIN {
        threads.min(n.div_ceil(ALIGN)).max(1)
    } else {
        1
    };
    let size = (n.div_ceil(pieces).div_ceil(ALIGN) * ALIGN).max(1);
    let mut col_sums = vec![0.0f32; if sums { n } else { 0 }];
    let (gp, sums_out) = (Ptr(g.as_mut_ptr()), Ptr(col_sums.as_mut_ptr()));
    let piece = |&c0: &usize| {
        let cols = size.min(n - c0);
        let mut acc = vec![0.0f32; if sums { cols } else { 0 }];
        for i in 0..m {
            let at = i * n + c0;
            // SAFETY: `g` is `m × n` and borrowed mutably for the call; the pieces own
            // disjoint columns of it, so this row segment is this piece's alone.
            let row = unsafe { std::slice::from_raw_parts_mut(gp.at(at), cols) };
            mask_row(row, &y[at..at + cols]);
            if sums {
                add_row(&mut acc, row);
            }
        }
        if sums {
            // SAFETY: `col_sums` is `n` long; the pieces write disjoint columns of it.
            unsafe { std::ptr::copy_nonoverlapping(acc.as_ptr(), sums_out.at(c0), cols) };
        }
    };
    let starts: Vec<usize> = (0..n).step_by(size).collect();
    if starts.len() > 1 {
        starts.par_iter().for_each(piece);
    } else {
        starts.iter().for_each(piece);
    }
    sums.then_some(col_sums)
}

/// ReLU's backward on one row, as Flex's: the gradient kept where the output is above zero or
/// NaN (`!(y <= 0)`), else zero.
#[multiversion(targets("x86_64+avx2+fma"))]
fn mask_row(g: &mut [f32], y: &[f32]) {
    g.iter_mut()
        .zip(y)
        .for_each(|(g, &y)| *g = if y <= 0.0 { 0.0 } else { *g });
}

/// `acc += row`, element by element.
#[multiversion(targets("x86_64+avx2+fma"))]
fn add_row(acc: &mut [f32], row: &[f32]) {
    acc.iter_mut().zip(row).for_each(|(s, v)| *s += v);
}

/// A buffer written by the pieces in disjoint columns.
#[derive(Clone, Copy)]
struct Ptr(*mut f32);

// SAFETY: the pieces write disjoint elements, and the buffers outlive them.
unsafe impl Send for Ptr {}
// SAFETY: as above.
unsafe impl Sync for Ptr {}

impl Ptr {
    /// The element `offset` of the buffer (a method, so that closures capture the `Ptr`, not
    /// its raw pointer).
    ///
    /// # Safety
    /// `offset` is inside the buffer's allocation.
    unsafe fn at(self, offset: usize) -> *mut f32 {
        // SAFETY: the caller keeps `offset` inside the allocation.
        unsafe { self.0.add(offset) }
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::Flex;

    use super::super::host;
    use super::super::linear::LinearKernels;
    use super::*;

    /// Values with zeros, negative zeros, NaNs and both signs.
    fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| match (i * 7 + seed) % 11 {
                0 => 0.0,
                1 => -0.0,
                2 => f32::NAN,
                r => (r as f32 - 6.5) * 0.37 + (i as f32) * 1e-3,
            })
            .collect()
    }

    /// The mask, then each column's sum in row order, on one thread: the reference.
    fn serial(g: &[f32], y: &[f32], n: usize) -> (Vec<f32>, Vec<f32>) {
        let masked: Vec<f32> = g
            .iter()
            .zip(y)
            .map(|(&g, &y)| if y.is_nan() || y > 0.0 { g } else { 0.0 })
            .collect();
        let mut sums = vec![0.0f32; n];
        for row in masked.chunks_exact(n) {
            sums.iter_mut().zip(row).for_each(|(s, v)| *s += v);
        }
        (masked, sums)
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn masks_and_sums_as_one_thread_does_on_any_number_of_threads() {
        for (m, n) in [(3, 5), (256, 256), (300, 131), (1024, 40)] {
            let (g, y) = (values(m * n, 1), values(m * n, 4));
            let (want, want_sums) = serial(&g, &y, n);
            for threads in [1, 2, 3] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .expect("pool");
                let mut got = g.clone();
                let sums = pool.install(|| mask_and_sums(&mut got, (m, n), &y, true));
                let case = format!("[{m}, {n}], {threads} threads");
                assert_eq!(bits(&got), bits(&want), "{case}: gradient");
                assert_eq!(bits(&sums.expect("sums")), bits(&want_sums), "{case}");
                let mut again = g.clone();
                let none = pool.install(|| mask_and_sums(&mut again, (m, n), &y, false));
                assert!(none.is_none(), "{case}: sums not asked for");
                assert_eq!(bits(&again), bits(&want), "{case}: without sums");
            }
        }
    }

    #[test]
    fn a_shared_gradient_is_left_as_it_was() {
        let (m, n) = (64, 48);
        let (g, y) = (values(m * n, 2), values(m * n, 5));
        let gt = host::tensor(g.clone(), vec![m, n]);
        let kept = gt.clone();
        let yt = host::tensor(y.clone(), vec![m, n]);
        let (masked, sums) = Flex::output_grad(Some(yt), gt, true);
        let (want, want_sums) = serial(&g, &y, n);
        assert_eq!(bits(host::slice(&masked)), bits(&want));
        assert_eq!(bits(host::slice(&sums.expect("sums"))), bits(&want_sums));
        assert_eq!(
            bits(host::slice(&kept)),
            bits(&g),
            "the other holder's values"
        );
    }
}
