//! Latency-optimal all-reduce (sum) of small `f32` buffers: recursive doubling.
//!
//! The ring takes `2 (n-1)` dependent steps whatever the size, so below
//! [`crate::CommConfig::small_all_reduce_bytes`] its latency dominates. Recursive doubling
//! takes `log2 p` steps (`p` the largest power of two `<= n`), each exchanging the whole
//! buffer with one partner: in step `k` rank `q` and rank `q ^ 2^k` swap their partial sums
//! and each adds the other's to its own. IEEE addition is commutative (`a + b` and `b + a`
//! are the same bits; only a NaN's payload, which Rust leaves unspecified, may differ), so
//! the two partners hold bit-identical sums after every step, and every rank ends with the
//! same bits: all follow the same tree of additions.
//!
//! A world that is not a power of two folds in first (MPICH's scheme): of the first
//! `2 (n - p)` ranks, each even rank sends its buffer to the odd rank above it, which adds
//! it to its own and takes part in the doubling as rank `r / 2`; the ranks from `2 (n - p)`
//! on take part as `r - (n - p)`. At the end each odd rank of the fold sends the result back
//! down (fold-out). Frames are tagged by step: 0 the fold-in, `1..=log2 p` the doubling,
//! `log2 p + 1` the fold-out.
//!
//! With [`WireFormat::Bf16`] every partial is rounded to bf16 in place before it is sent, so
//! the sender combines exactly the value its partner receives, and the result is rounded to
//! bf16 on every rank, as the ring's is. Compression (lz4) applies to these frames as to any.

use flotilla_group::CommError;

use crate::buf::{f32_bytes, f32_bytes_mut};
use crate::config::WireFormat;
use crate::op::OpCtx;
use crate::reduce;

/// The frames of one recursive-doubling all-reduce.
struct Doubling<'a, 'c> {
    ctx: &'a OpCtx<'c>,
    bf16: bool,
    scratch: Vec<u8>,
}

impl Doubling<'_, '_> {
    /// Sends `buf` (in the wire format) to group rank `peer` as frame `tag`.
    async fn send(&mut self, peer: usize, tag: u32, buf: &mut [f32]) -> Result<(), CommError> {
        if self.bf16 {
            reduce::round_to_bf16(buf);
            reduce::encode_bf16(buf, &mut self.scratch);
            self.ctx.send(peer, tag, &self.scratch).await
        } else {
            self.ctx.send(peer, tag, f32_bytes(buf)).await
        }
    }

    /// Receives frame `tag` from group rank `peer`, of `buf.len()` elements, and adds it
    /// into `buf` (`add`) or overwrites `buf` with it.
    async fn recv(
        &mut self,
        peer: usize,
        tag: u32,
        buf: &mut [f32],
        add: bool,
    ) -> Result<(), CommError> {
        let bytes = if self.bf16 {
            buf.len() * 2
        } else {
            buf.len() * 4
        };
        let f = self.ctx.recv(peer, tag, Some(bytes)).await?;
        match (add, self.bf16) {
            (true, false) => reduce::add_assign_le_bytes(buf, &f.payload),
            (false, false) => f32_bytes_mut(buf).copy_from_slice(&f.payload),
            (true, true) => reduce::add_assign_bf16(buf, &f.payload),
            (false, true) => reduce::copy_bf16(buf, &f.payload),
        }
        Ok(())
    }
}

/// The largest power of two `<= n` (`n >= 1`).
fn pow2_floor(n: usize) -> usize {
    1 << (usize::BITS - 1 - n.leading_zeros())
}

/// Where group rank `r` of `n` stands in the doubling: its rank among the `p` that double,
/// or `None` for an even rank of the fold, which hands its buffer to `r + 1`.
fn doubling_rank(r: usize, n: usize) -> Option<usize> {
    let rem = n - pow2_floor(n);
    match r {
        r if r < 2 * rem && r % 2 == 0 => None,
        r if r < 2 * rem => Some(r / 2),
        r => Some(r - rem),
    }
}

/// The group rank of doubling rank `q` (the inverse of [`doubling_rank`]).
fn group_rank(q: usize, n: usize) -> usize {
    let rem = n - pow2_floor(n);
    if q < rem { 2 * q + 1 } else { q + rem }
}

/// Recursive-doubling all-reduce (sum) of `buf` in place; a no-op for one rank or an empty
/// buffer. Every rank ends with the same bits.
pub(crate) async fn all_reduce(ctx: &OpCtx<'_>, buf: &mut [f32]) -> Result<(), CommError> {
    let (n, r) = (ctx.size(), ctx.rank());
    if n == 1 || buf.is_empty() {
        return Ok(());
    }
    let (p, rem) = (pow2_floor(n), n - pow2_floor(n));
    let steps = p.trailing_zeros();
    let mut d = Doubling {
        ctx,
        bf16: ctx.cfg().wire_format == WireFormat::Bf16,
        scratch: Vec::new(),
    };
    let Some(q) = doubling_rank(r, n) else {
        // Even rank of the fold: hand over, then receive the result.
        d.send(r + 1, 0, buf).await?;
        return d.recv(r + 1, steps + 1, buf, false).await;
    };
    if r < 2 * rem {
        d.recv(r - 1, 0, buf, true).await?;
    }
    for k in 0..steps {
        let partner = group_rank(q ^ (1 << k), n);
        d.send(partner, k + 1, buf).await?;
        d.recv(partner, k + 1, buf, true).await?;
    }
    if d.bf16 {
        reduce::round_to_bf16(buf);
    }
    if r < 2 * rem {
        d.send(r - 1, steps + 1, buf).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubling_ranks_are_a_bijection_onto_the_power_of_two() {
        for n in 1..=17 {
            let p = pow2_floor(n);
            assert!(p <= n && n < 2 * p, "n {n} p {p}");
            let mut seen = vec![false; p];
            for r in 0..n {
                if let Some(q) = doubling_rank(r, n) {
                    assert!(!seen[q], "n {n}: doubling rank {q} twice");
                    seen[q] = true;
                    assert_eq!(group_rank(q, n), r);
                } else {
                    assert_eq!(doubling_rank(r + 1, n), Some(r / 2));
                }
            }
            assert!(seen.iter().all(|&s| s), "n {n}");
        }
    }
}
