//! A host GEMM over strided `f32` matrices, split into pieces that depend only on the shapes,
//! so that every output element is computed by one call of the `gemm` crate (the one Flex
//! multiplies with, pinned to the same version) in the same order whatever the number of
//! threads: results are bitwise the same on 1 and on N threads. The pieces run on rayon's
//! current pool (`RAYON_NUM_THREADS`, which `--threads` sets per rank), one after the other
//! when it has one thread. [`gemm_serial`] is the same call unsplit, on the calling thread
//! (the convolution's per-image products, whose work is already split over the batch).

use rayon::prelude::*;

/// Multiply-adds per piece, at least (smaller products are not split at all). At 2^20 the
/// MLP's second layer at batch 64 (`64 × 256 × 128`, its forward and both gradients) is split
/// in two, so a second thread shares it.
const GRAIN: usize = 1 << 20;
/// At most this many pieces per product: one per thread on 2 threads. Each piece packs one
/// operand again and multiplies a narrower block, so more pieces cost CPU time on 1 thread
/// (4 pieces made the MLP's batch-256 step slower than burn's matmul; 2 do not).
const MAX_PIECES: usize = 2;
/// Piece boundaries fall on multiples of this many rows or columns (the micro-kernel's width).
const ALIGN: usize = 16;

/// A read-only strided view of an `m × n` matrix: element `(i, j)` at `data[i·rs + j·cs]`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct MatRef<'a> {
    /// The buffer; every element of the view is inside it.
    pub data: &'a [f32],
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
    /// Distance between rows.
    pub rs: usize,
    /// Distance between columns.
    pub cs: usize,
}

impl<'a> MatRef<'a> {
    /// A row-major `rows × cols` matrix.
    pub fn row_major(data: &'a [f32], rows: usize, cols: usize) -> Self {
        Self {
            data,
            rows,
            cols,
            rs: cols,
            cs: 1,
        }
    }

    /// The transpose (no copy).
    pub fn t(self) -> Self {
        Self {
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }

    /// Whether every element of the view lies inside `data`.
    fn in_bounds(&self) -> bool {
        if self.rows == 0 || self.cols == 0 {
            return true;
        }
        let last = (self.rows - 1) * self.rs + (self.cols - 1) * self.cs;
        last < self.data.len()
    }
}

/// Which dimension of the product is cut, and into how many pieces of how many rows/columns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Split {
    /// `true`: pieces of rows of the output; `false`: pieces of columns.
    rows: bool,
    /// Rows or columns per piece (the last may have fewer).
    size: usize,
}

/// The pieces of an `m × n` output over an inner dimension `k`: a function of the shapes only.
fn split(m: usize, n: usize, k: usize) -> Split {
    // Cutting rows packs the right operand (`k × n`) once per piece, cutting columns the left
    // (`m × k`): cut the dimension whose repacked operand is the smaller.
    let rows = m > n;
    let len = if rows { m } else { n };
    let work = m.saturating_mul(n).saturating_mul(k);
    let pieces = (work / GRAIN)
        .clamp(1, MAX_PIECES)
        .min(len.div_ceil(ALIGN).max(1));
    let size = len.div_ceil(pieces).div_ceil(ALIGN) * ALIGN;
    Split {
        rows,
        size: size.max(1),
    }
}

/// `dst = a · b` (or `dst += a · b` with `accumulate`), `dst` row-major `a.rows × b.cols`.
///
/// # Panics
/// If the shapes do not match or a view reaches outside its buffer (a bug of the caller).
pub(crate) fn gemm_into(dst: &mut [f32], a: MatRef<'_>, b: MatRef<'_>, accumulate: bool) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert!(
        b.rows == k && dst.len() == m * n,
        "gemm_into: [{m}, {k}] · [{}, {n}] into {} values",
        b.rows,
        dst.len()
    );
    if k == 0 {
        if !accumulate {
            dst.fill(0.0);
        }
        return;
    }
    // SAFETY: `dst` holds the `m × n` values, borrowed mutably for the call.
    unsafe { gemm_to(dst.as_mut_ptr(), a, b, accumulate) }
}

/// `a · b` in a new row-major `a.rows × b.cols` buffer that the product writes without its
/// being zeroed first (the zeroing of every output was 5 % of gpt-char's step).
///
/// # Panics
/// As [`gemm_into`].
pub(crate) fn gemm_new(a: MatRef<'_>, b: MatRef<'_>) -> Vec<f32> {
    let len = a.rows * b.cols;
    if a.cols == 0 {
        return vec![0.0; len];
    }
    let mut out = Vec::with_capacity(len);
    // SAFETY: `out` has room for the `m × n` values; with `accumulate` false and `k > 0` the
    // product writes every one of them without reading any, so all are set before `set_len`.
    unsafe {
        gemm_to(out.as_mut_ptr(), a, b, false);
        out.set_len(len);
    }
    out
}

/// [`gemm_into`] on the `a.rows × b.cols` values at `dst`, `k > 0`.
///
/// # Safety
/// `dst` is valid for writes (and, with `accumulate`, reads) of `a.rows · b.cols` values that
/// nothing else accesses during the call.
unsafe fn gemm_to(dst: *mut f32, a: MatRef<'_>, b: MatRef<'_>, accumulate: bool) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert!(
        b.rows == k && a.in_bounds() && b.in_bounds(),
        "gemm: [{m}, {k}] · [{}, {n}] outside its buffers",
        b.rows
    );
    if m == 0 || n == 0 {
        return;
    }
    let s = split(m, n, k);
    let len = if s.rows { m } else { n };
    let starts: Vec<usize> = (0..len).step_by(s.size).collect();
    let out = DstPtr(dst);
    let piece = |&start: &usize| {
        let count = s.size.min(len - start);
        // SAFETY: the pieces cover disjoint rows (or columns) of `dst`, which is `m × n`
        // row-major and the caller's alone for the whole call; `a` and `b` were checked to lie
        // inside their buffers, and the offsets below stay inside those views.
        unsafe {
            if s.rows {
                run(out.at(start * n), n, a, start, count, b, 0, n, accumulate);
            } else {
                run(out.at(start), n, a, 0, m, b, start, count, accumulate);
            }
        }
    };
    if rayon::current_num_threads() <= 1 || starts.len() == 1 {
        starts.iter().for_each(piece);
    } else {
        starts.par_iter().for_each(piece);
    }
}

/// `dst = a · b` (or `dst += a · b` with `accumulate`) on this thread, in one call of the
/// `gemm` crate, unsplit: `dst` row-major `a.rows × b.cols` at its start (a work buffer may be
/// longer). For a caller that splits its work itself (the convolution, over the batch).
///
/// # Panics
/// If the shapes do not match or a view reaches outside its buffer (a bug of the caller).
pub(crate) fn gemm_serial(dst: &mut [f32], a: MatRef<'_>, b: MatRef<'_>, accumulate: bool) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert!(
        b.rows == k && dst.len() >= m * n && a.in_bounds() && b.in_bounds(),
        "gemm_serial: [{m}, {k}] · [{}, {n}] into {} values",
        b.rows,
        dst.len()
    );
    if m == 0 || n == 0 {
        return;
    }
    // SAFETY: the assert above keeps every element read (`a`, `b`: `in_bounds`) and written
    // (`dst`: `m·n` row-major) inside its slice, borrowed for the whole call.
    unsafe { run(dst.as_mut_ptr(), n, a, 0, m, b, 0, n, accumulate) }
}

/// The output buffer, shared by the pieces that write disjoint parts of it.
#[derive(Clone, Copy)]
struct DstPtr(*mut f32);

// SAFETY: the pieces of `gemm_into` write disjoint elements, and the buffer outlives them.
unsafe impl Send for DstPtr {}
// SAFETY: as above.
unsafe impl Sync for DstPtr {}

impl DstPtr {
    /// The element `offset` of the buffer.
    ///
    /// # Safety
    /// `offset` is inside the buffer.
    unsafe fn at(self, offset: usize) -> *mut f32 {
        // SAFETY: the caller keeps `offset` inside the buffer.
        unsafe { self.0.add(offset) }
    }
}

/// One piece: rows `r0..r0+rows` of `a` times columns `c0..c0+cols` of `b` into `dst`
/// (row stride `ld`), on this thread.
///
/// # Safety
/// `dst` points at a `rows × cols` block with row stride `ld` that no one else touches; the
/// rows and columns are inside `a` and `b`.
#[allow(clippy::too_many_arguments)]
unsafe fn run(
    dst: *mut f32,
    ld: usize,
    a: MatRef<'_>,
    r0: usize,
    rows: usize,
    b: MatRef<'_>,
    c0: usize,
    cols: usize,
    accumulate: bool,
) {
    let lhs = a.data[r0 * a.rs..].as_ptr();
    let rhs = b.data[c0 * b.cs..].as_ptr();
    // SAFETY: the caller's contract; strides are element counts well below `isize::MAX`
    // (they index allocated buffers).
    unsafe {
        gemm::gemm(
            rows,
            cols,
            a.cols,
            dst,
            1,
            ld as isize,
            accumulate,
            lhs,
            a.cs as isize,
            a.rs as isize,
            rhs,
            b.cs as isize,
            b.rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_depend_on_shapes_only_and_cover_the_output() {
        let s = split(64, 256, 784);
        assert!(
            !s.rows && s.size.is_multiple_of(ALIGN) && s.size * MAX_PIECES >= 256,
            "{s:?}"
        );
        let s = split(784, 256, 64);
        assert!(s.rows && s.size * MAX_PIECES >= 784, "{s:?}");
        assert_eq!(split(4, 3, 2).size, ALIGN);
    }

    #[test]
    fn a_new_product_never_reads_its_unzeroed_buffer() {
        // The allocator hands a buffer of the same size back: fill one with NaN, free it, and
        // the product in the new one must not carry any (it writes every value, reads none).
        let (m, k, n) = (48, 40, 33);
        let a: Vec<f32> = (0..m * k).map(|i| (i % 7) as f32 - 3.0).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i % 5) as f32 - 2.0).collect();
        let (am, bm) = (MatRef::row_major(&a, m, k), MatRef::row_major(&b, k, n));
        let mut want = vec![0.0f32; m * n];
        gemm_into(&mut want, am, bm, false);
        for _ in 0..8 {
            drop(std::hint::black_box(vec![f32::NAN; m * n]));
            assert_eq!(gemm_new(am, bm), want);
        }
        assert_eq!(
            gemm_new(MatRef::row_major(&[], m, 0), MatRef::row_major(&[], 0, n)),
            vec![0.0; m * n]
        );
    }

    #[test]
    fn strided_product_matches_a_naive_sum() {
        let (m, k, n) = (37, 29, 53);
        let a: Vec<f32> = (0..m * k).map(|i| ((i * 7 % 13) as f32) - 6.0).collect();
        let bt: Vec<f32> = (0..n * k).map(|i| ((i * 5 % 11) as f32) - 5.0).collect();
        // b as the transpose of a row-major `n × k` buffer.
        let b = MatRef::row_major(&bt, n, k).t();
        let mut dst = vec![1.0f32; m * n];
        gemm_into(&mut dst, MatRef::row_major(&a, m, k), b, true);
        for i in 0..m {
            for j in 0..n {
                let want: f32 = 1.0 + (0..k).map(|p| a[i * k + p] * bt[j * k + p]).sum::<f32>();
                assert_eq!(dst[i * n + j], want, "({i}, {j})");
            }
        }
    }
}
