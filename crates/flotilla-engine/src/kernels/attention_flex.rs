//! Flex's causal attention kernels ([`super::attention`]): per (sample, head), the two
//! products forward and four backward through `gemm` on the head's strided columns of the
//! `[n, t, d]` buffers, the row softmax over each row's visible prefix in between.

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
    /// The shape of `q` `[n, t, d]` cut into `heads` heads.
    ///
    /// # Panics
    /// Unless `q` is `[n, t, d]` with `d` a positive multiple of `heads` (the kernels address
    /// the buffers by this shape; a burn op panics on a wrong shape the same way).
    pub(crate) fn of(q: &FloatTensor<Flex>, heads: usize) -> Self {
        let dims = q.shape();
        assert!(
            dims.num_dims() == 3 && heads > 0 && dims[2].is_multiple_of(heads),
            "causal attention: q must be [n, t, d] with d a multiple of the {heads} heads, got {dims:?}"
        );
        let (n, t, d) = (dims[0], dims[1], dims[2]);
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

    /// `[n, t, d]`: the shape of `q`, `k`, `v`, the context and its gradient.
    fn rows(self) -> [usize; 3] {
        [self.n, self.t, self.d()]
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

    /// Offsets of head `h` of sample `b` in an `[n, t, d]` buffer and in `[n, heads, t, t]`.
    fn offsets(self, b: usize, h: usize) -> (usize, usize) {
        (
            b * self.t * self.d() + h * self.dk,
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

/// The context `[n, t, d]` and the probabilities `[n, heads, t, t]`.
pub(crate) fn forward_f32(
    q: &FloatTensor<Flex>,
    k: &FloatTensor<Flex>,
    v: &FloatTensor<Flex>,
    s: Heads,
) -> (FloatTensor<Flex>, FloatTensor<Flex>) {
    for (name, x) in [("q", q), ("k", k), ("v", v)] {
        Heads::check(name, x, slice(x), &s.rows());
    }
    let (q, k, v) = (slice(q), slice(k), slice(v));
    let (t, d) = (s.t, s.d() as isize);
    // Both buffers are written by the products alone, not zeroed first: every head of every
    // sample writes its `t × dk` block of `out` and its `t × t` block of `probs` whole.
    let (out_len, probs_len) = (s.n * s.t * s.d(), s.n * s.heads * t * t);
    let mut out = Vec::<f32>::with_capacity(out_len);
    let mut probs = Vec::<f32>::with_capacity(probs_len);
    for b in 0..s.n {
        for h in 0..s.heads {
            let (x, pp) = s.offsets(b, h);
            // SAFETY: head h of sample b spans t rows of stride d from x, dk columns (x + dk ≤
            // the sample's end), and its probabilities the t×t values from pp, inside the
            // capacity of `probs`; the product writes them all (it reads no destination), so
            // the slice made of them afterwards is initialized; out is a distinct buffer.
            let p = unsafe {
                let p = probs.as_mut_ptr().add(pp);
                let kt = View(k[x..].as_ptr(), 1, d);
                product(
                    t,
                    t,
                    s.dk,
                    (p, t as isize),
                    View(q[x..].as_ptr(), d, 1),
                    kt,
                    s.scale(),
                );
                std::slice::from_raw_parts_mut(p, t * t)
            };
            causal_softmax_rows(p, t);
            // SAFETY: as above, the head's t×dk block of `out`, inside its capacity.
            unsafe {
                let dst = (out.as_mut_ptr().add(x), d);
                product(
                    t,
                    s.dk,
                    t,
                    dst,
                    View(p.as_ptr(), t as isize, 1),
                    View(v[x..].as_ptr(), d, 1),
                    1.0,
                );
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

/// The gradients of `q`, `k`, `v` from `[q, k, v, probs, grad]`.
pub(crate) fn backward_f32(
    inputs: [&FloatTensor<Flex>; 5],
    s: Heads,
) -> (FloatTensor<Flex>, FloatTensor<Flex>, FloatTensor<Flex>) {
    for (name, x) in ["q", "k", "v", "probs", "grad"].into_iter().zip(inputs) {
        let dims = if name == "probs" {
            &s.probs()[..]
        } else {
            &s.rows()[..]
        };
        Heads::check(name, x, slice(x), dims);
    }
    let [q, k, v, probs, g] = inputs.map(slice);
    let (t, d, ti) = (s.t, s.d() as isize, s.t as isize);
    let len = s.n * s.t * s.d();
    // Written by the products alone, not zeroed first (every head writes its block whole).
    let mut grads = [(); 3].map(|_| Vec::<f32>::with_capacity(len));
    let [dq, dk, dv] = grads.each_mut().map(|g| g.as_mut_ptr());
    let mut ds = vec![0.0f32; t * t];
    for b in 0..s.n {
        for h in 0..s.heads {
            let (x, pp) = s.offsets(b, h);
            let p = &probs[pp..pp + t * t];
            let gv = View(g[x..].as_ptr(), d, 1);
            // SAFETY: the head's views as in the forward pass (its blocks of dq, dk, dv inside
            // their capacity); ds is a t×t scratch buffer and
            // every destination a distinct buffer.
            unsafe {
                let pt = View(p.as_ptr(), 1, ti);
                product(t, s.dk, t, (dv.add(x), d), pt, gv, 1.0);
                let vt = View(v[x..].as_ptr(), 1, d);
                product(t, t, s.dk, (ds.as_mut_ptr(), ti), gv, vt, 1.0);
            }
            softmax_backward_rows(&mut ds, p, t, s.scale());
            // SAFETY: as above.
            unsafe {
                let (dsv, dst) = (View(ds.as_ptr(), ti, 1), View(ds.as_ptr(), 1, ti));
                product(
                    t,
                    s.dk,
                    t,
                    (dq.add(x), d),
                    dsv,
                    View(k[x..].as_ptr(), d, 1),
                    1.0,
                );
                product(
                    t,
                    s.dk,
                    t,
                    (dk.add(x), d),
                    dst,
                    View(q[x..].as_ptr(), d, 1),
                    1.0,
                );
            }
        }
    }
    // SAFETY: every head of every sample wrote its t×dk block of the three, so all values.
    grads.iter_mut().for_each(|g| unsafe { g.set_len(len) });
    let shape = [s.n, s.t, s.d()];
    let [dq, dk, dv] = grads.map(|g| tensor(g, shape));
    (dq, dk, dv)
}
