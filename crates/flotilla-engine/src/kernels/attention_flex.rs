//! Flex's causal attention kernels ([`super::attention`]): per (sample, head), the two
//! products forward and four backward through `gemm` on the head's strided columns of Q, K
//! and V packed in one `[n, t, 3d]` buffer (the one product of the three projections) and of
//! the `[n, t, d]` context, the row softmax over each row's visible prefix in between.

use burn::backend::tensor::FloatTensor;
use burn::backend::{Flex, TensorMetadata};
use gemm::{Parallelism, gemm};

use multiversion::multiversion;

use super::host::{slice, tensor};
use super::math::exp_neg;
use super::norm_rows::lane_sum;

/// The shape of one attention call: `n` samples of `t` positions, `heads` heads of `dk`
/// features each (`d = heads·dk`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Heads {
    n: usize,
    t: usize,
    heads: usize,
    dk: usize,
}

impl Heads {
    /// The shape of `qkv` `[n, t, 3d]` (Q, K and V packed) cut into `heads` heads.
    ///
    /// # Panics
    /// Unless `qkv` is `[n, t, 3d]` with `d` a positive multiple of `heads` (the kernels
    /// address the buffers by this shape; a burn op panics on a wrong shape the same way).
    pub(crate) fn of(qkv: &FloatTensor<Flex>, heads: usize) -> Self {
        let dims = qkv.shape();
        assert!(
            dims.num_dims() == 3 && heads > 0 && dims[2].is_multiple_of(3 * heads),
            "causal attention: qkv must be [n, t, 3d] with d a multiple of the {heads} heads, got {dims:?}"
        );
        let (n, t, d) = (dims[0], dims[1], dims[2] / 3);
        Self {
            n,
            t,
            heads,
            dk: d / heads,
        }
    }

    /// Checks that `x` (named `name`) has the shape `dims` and as many values: the strided
    /// views of the kernels read and write exactly that many, unchecked.
    ///
    /// # Panics
    /// Naming the tensor and both shapes, before any unchecked access.
    fn check(name: &str, x: &FloatTensor<Flex>, values: &[f32], dims: &[usize]) {
        let shape = x.shape();
        let len: usize = dims.iter().product();
        assert!(
            shape.as_slice() == dims && values.len() == len,
            "causal attention: {name} must be {dims:?} ({len} contiguous values), got {shape:?} \
             ({} values)",
            values.len()
        );
    }

    /// `[n, t, d]`: the shape of the context and its gradient.
    fn rows(self) -> [usize; 3] {
        [self.n, self.t, self.d()]
    }

    /// `[n, t, 3d]`: the shape of Q, K, V packed, and of their gradients.
    fn packed(self) -> [usize; 3] {
        [self.n, self.t, 3 * self.d()]
    }

    /// `[n, heads, t, t]`: the shape of the probabilities.
    fn probs(self) -> [usize; 4] {
        [self.n, self.heads, self.t, self.t]
    }

    fn d(self) -> usize {
        self.heads * self.dk
    }

    fn scale(self) -> f32 {
        1.0 / (self.dk as f32).sqrt()
    }

    /// Offsets of head `h` of sample `b` in an `[n, t, d]` buffer, in the packed `[n, t, 3d]`
    /// one (its Q columns; K's are `d` further, V's `2d`) and in `[n, heads, t, t]`.
    fn offsets(self, b: usize, h: usize) -> (usize, usize, usize) {
        (
            b * self.t * self.d() + h * self.dk,
            b * self.t * 3 * self.d() + h * self.dk,
            (b * self.heads + h) * self.t * self.t,
        )
    }
}

/// A strided matrix view: pointer, row stride, column stride.
#[derive(Clone, Copy)]
struct View(*const f32, isize, isize);

/// `dst (m×n, row stride dst_rs) = alpha · lhs (m×k) · rhs (k×n)`, single-threaded.
///
/// # Safety
/// Every view must address `m×k`, `k×n` and `m×n` valid elements with its strides, and `dst`
/// must not overlap them.
unsafe fn product(
    m: usize,
    n: usize,
    k: usize,
    dst: (*mut f32, isize),
    lhs: View,
    rhs: View,
    alpha: f32,
) {
    // SAFETY: the caller's contract.
    unsafe {
        gemm(
            m,
            n,
            k,
            dst.0,
            1,
            dst.1,
            false,
            lhs.0,
            lhs.2,
            lhs.1,
            rhs.0,
            rhs.2,
            rhs.1,
            0.0,
            alpha,
            false,
            false,
            false,
            Parallelism::None,
        );
    }
}

/// Softmax of each row `i` of the `t×t` scores over columns `0..=i`, zero after them: the
/// exponentials by [`exp_neg`] (every argument is `≤ 0`, a score less its row's maximum),
/// which vectorizes where libm's `expf` does not, and the row's sum in [`LANES`](super::norm_rows::LANES) lanes.
#[multiversion(targets("x86_64+avx2+fma"))]
fn causal_softmax_rows(scores: &mut [f32], t: usize) {
    for (i, row) in scores.chunks_exact_mut(t).enumerate() {
        let (seen, hidden) = row.split_at_mut(i + 1);
        let mut max = f32::NEG_INFINITY;
        for &s in seen.iter() {
            max = max.max(s);
        }
        for s in seen.iter_mut() {
            *s = exp_neg(*s - max);
        }
        let inv = 1.0 / lane_sum(seen, seen, |v, _| v);
        for s in seen.iter_mut() {
            *s *= inv;
        }
        hidden.fill(0.0);
    }
}

/// `dS = P ∘ (dP − Σⱼ P·dP)` of each row, times `scale`, in place of `dP` (the sum in
/// [`LANES`](super::norm_rows::LANES) lanes).
#[multiversion(targets("x86_64+avx2+fma"))]
fn softmax_backward_rows(dp: &mut [f32], p: &[f32], t: usize, scale: f32) {
    for (drow, prow) in dp.chunks_exact_mut(t).zip(p.chunks_exact(t)) {
        let dot = lane_sum(drow, prow, |d, p| d * p);
        for (d, &p) in drow.iter_mut().zip(prow) {
            *d = p * (*d - dot) * scale;
        }
    }
}

/// The context `[n, t, d]` and the probabilities `[n, heads, t, t]` of `qkv` `[n, t, 3d]`.
pub(crate) fn forward_f32(
    qkv: &FloatTensor<Flex>,
    s: Heads,
) -> (FloatTensor<Flex>, FloatTensor<Flex>) {
    Heads::check("qkv", qkv, slice(qkv), &s.packed());
    let qkv = slice(qkv);
    let (t, d, rs) = (s.t, s.d() as isize, 3 * s.d() as isize);
    // Both buffers are written by the products alone, not zeroed first: every head of every
    // sample writes its `t × dk` block of `out` and its `t × t` block of `probs` whole.
    let (out_len, probs_len) = (s.n * s.t * s.d(), s.n * s.heads * t * t);
    let mut out = Vec::<f32>::with_capacity(out_len);
    let mut probs = Vec::<f32>::with_capacity(probs_len);
    for b in 0..s.n {
        for h in 0..s.heads {
            let (xo, xi, pp) = s.offsets(b, h);
            let (q, k, v) = (&qkv[xi..], &qkv[xi + s.d()..], &qkv[xi + 2 * s.d()..]);
            // SAFETY: head h of sample b spans t rows of stride 3d from xi in `qkv` (Q's dk
            // columns there, K's d and V's 2d further, all inside the sample), and its
            // probabilities the t×t values from pp, inside the capacity of `probs`; the
            // product writes them all (it reads no destination), so the slice made of them
            // afterwards is initialized; out is a distinct buffer.
            let p = unsafe {
                let p = probs.as_mut_ptr().add(pp);
                let kt = View(k.as_ptr(), 1, rs);
                product(
                    t,
                    t,
                    s.dk,
                    (p, t as isize),
                    View(q.as_ptr(), rs, 1),
                    kt,
                    s.scale(),
                );
                std::slice::from_raw_parts_mut(p, t * t)
            };
            causal_softmax_rows(p, t);
            // SAFETY: as above, the head's t×dk block of `out` (row stride d) inside its capacity.
            unsafe {
                let dst = (out.as_mut_ptr().add(xo), d);
                let pv = View(p.as_ptr(), t as isize, 1);
                product(t, s.dk, t, dst, pv, View(v.as_ptr(), rs, 1), 1.0);
            }
        }
    }
    // SAFETY: every value of both buffers was written above.
    unsafe {
        out.set_len(out_len);
        probs.set_len(probs_len);
    }
    (
        tensor(out, [s.n, s.t, s.d()]),
        tensor(probs, [s.n, s.heads, t, t]),
    )
}

/// The gradients of Q, K and V, packed as `qkv` is, from `[qkv, probs, grad]`.
pub(crate) fn backward_f32(inputs: [&FloatTensor<Flex>; 3], s: Heads) -> FloatTensor<Flex> {
    let shapes = [&s.packed()[..], &s.probs()[..], &s.rows()[..]];
    for ((name, x), dims) in ["qkv", "probs", "grad"].into_iter().zip(inputs).zip(shapes) {
        Heads::check(name, x, slice(x), dims);
    }
    let [qkv, probs, g] = inputs.map(slice);
    let (t, d, rs, ti) = (s.t, s.d() as isize, 3 * s.d() as isize, s.t as isize);
    let len = s.n * s.t * 3 * s.d();
    // Written by the products alone, not zeroed first (every head writes its dq, dk and dv
    // blocks whole, so every value).
    let mut grads = Vec::<f32>::with_capacity(len);
    let mut ds = vec![0.0f32; t * t];
    for b in 0..s.n {
        for h in 0..s.heads {
            let (xo, xi, pp) = s.offsets(b, h);
            let p = &probs[pp..pp + t * t];
            let (q, k, v) = (&qkv[xi..], &qkv[xi + s.d()..], &qkv[xi + 2 * s.d()..]);
            let gv = View(g[xo..].as_ptr(), d, 1);
            // SAFETY: the head's views as in the forward pass; its dq, dk and dv blocks (t rows
            // of stride 3d from xi, xi + d, xi + 2d) inside the capacity of `grads`; ds is a
            // t×t scratch buffer; every destination is distinct from every source.
            unsafe {
                let dq = grads.as_mut_ptr().add(xi);
                let (dk, dv) = (dq.add(s.d()), dq.add(2 * s.d()));
                product(t, s.dk, t, (dv, rs), View(p.as_ptr(), 1, ti), gv, 1.0);
                let vt = View(v.as_ptr(), 1, rs);
                product(t, t, s.dk, (ds.as_mut_ptr(), ti), gv, vt, 1.0);
                softmax_backward_rows(&mut ds, p, t, s.scale());
                let (dsv, dst) = (View(ds.as_ptr(), ti, 1), View(ds.as_ptr(), 1, ti));
                product(t, s.dk, t, (dq, rs), dsv, View(k.as_ptr(), rs, 1), 1.0);
                product(t, s.dk, t, (dk, rs), dst, View(q.as_ptr(), rs, 1), 1.0);
            }
        }
    }
    // SAFETY: every head of every sample wrote its three t×dk blocks, so every value.
    unsafe { grads.set_len(len) };
    tensor(grads, s.packed())
}
