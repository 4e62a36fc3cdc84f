//! Rabenseifner's all-reduce (sum) of `f32` buffers for the middle sizes: a reduce-scatter
//! by recursive halving, then an all-gather by recursive doubling (what Open MPI's `tuned`
//! component picks between the small-message and the ring sizes).
//!
//! Among `p` ranks (`p` a power of two), the buffer is cut into `p` blocks. Halving: in step
//! `k` rank `q` and rank `q ^ (p >> (k + 1))` split the blocks they both still hold; each
//! sends the half it gives up to the other and adds the half it keeps from the other, so
//! after `log2 p` steps rank `q` holds the sum of block `q`. Doubling: in step `k` rank `q`
//! and rank `q ^ 2^k` swap the blocks each has finished. Each rank sends `2 (p-1)/p` of the
//! buffer, as in the ring, but in `2 log2 p` dependent steps instead of `2 (n-1)`.
//!
//! Every block is summed by one rank only and then copied, so every rank ends with the same
//! bits. A world that is not a power of two folds in and out as [`crate::doubling`] does (an
//! even rank of the first `2 (n - p)` hands its whole buffer to the odd rank above it and
//! gets the result back). Every exchange is a [`Pipe::step`] (chunked and pipelined), so
//! frames stay at `chunk_bytes` whatever the size. With [`crate::WireFormat::Bf16`] each
//! block is rounded to bf16 by its owner before the all-gather, as the ring rounds its
//! segments, so every rank ends bit-identical.

use std::ops::Range;

use flotilla_group::CommError;

use crate::doubling::{doubling_rank, group_rank, pow2_floor};
use crate::op::OpCtx;
use crate::pipe::{Mode, Pipe};
use crate::reduce;

/// Element range of blocks `lo..hi` of `p` over `len` elements.
fn blocks(len: usize, p: usize, lo: usize, hi: usize) -> Range<usize> {
    let at = |i: usize| ((i as u128 * len as u128) / p as u128) as usize;
    at(lo)..at(hi)
}

/// The halving and doubling among the `p` ranks that take part; `q` is this rank's place
/// among them.
async fn halving_doubling(
    pipe: &mut Pipe<'_, '_>,
    buf: &mut [f32],
    (n, p, q): (usize, usize, usize),
) -> Result<(), CommError> {
    let len = buf.len();
    let (mut lo, mut size) = (0, p);
    while size > 1 {
        let half = size / 2;
        let partner = group_rank(q ^ half, n);
        let (keep, give) = if q & half == 0 {
            (lo..lo + half, lo + half..lo + size)
        } else {
            (lo + half..lo + size, lo..lo + half)
        };
        let (k, g) = (
            blocks(len, p, keep.start, keep.end),
            blocks(len, p, give.start, give.end),
        );
        pipe.step(buf, (partner, g), (partner, k), Mode::Reduce)
            .await?;
        (lo, size) = (keep.start, half);
    }
    if pipe.bf16() {
        // Peers receive this block rounded to bf16; round our copy alike.
        reduce::round_to_bf16(&mut buf[blocks(len, p, q, q + 1)]);
    }
    while size < p {
        let partner = group_rank(q ^ size, n);
        let theirs = lo ^ size;
        let (mine, other) = (
            blocks(len, p, lo, lo + size),
            blocks(len, p, theirs, theirs + size),
        );
        pipe.step(buf, (partner, mine), (partner, other), Mode::Copy)
            .await?;
        (lo, size) = (lo.min(theirs), 2 * size);
    }
    Ok(())
}

/// Rabenseifner all-reduce (sum) of `buf` in place; a no-op for one rank or an empty
/// buffer. Every rank ends with the same bits.
pub(crate) async fn all_reduce(ctx: &OpCtx<'_>, buf: &mut [f32]) -> Result<(), CommError> {
    let (n, r) = (ctx.size(), ctx.rank());
    if n == 1 || buf.is_empty() {
        return Ok(());
    }
    let (p, len) = (pow2_floor(n), buf.len());
    let folded = r < 2 * (n - p);
    let mut pipe = Pipe::new(ctx);
    let Some(q) = doubling_rank(r, n) else {
        // Even rank of the fold: hand over, then receive the result.
        pipe.step(buf, (r + 1, 0..len), (r + 1, 0..0), Mode::Reduce)
            .await?;
        return pipe
            .step(buf, (r + 1, 0..0), (r + 1, 0..len), Mode::Copy)
            .await;
    };
    if folded {
        pipe.step(buf, (r - 1, 0..0), (r - 1, 0..len), Mode::Reduce)
            .await?;
    }
    halving_doubling(&mut pipe, buf, (n, p, q)).await?;
    if folded {
        pipe.step(buf, (r - 1, 0..len), (r - 1, 0..0), Mode::Copy)
            .await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_tile_the_buffer_and_halves_meet() {
        for len in [0usize, 1, 3, 8, 1001] {
            for p in [1usize, 2, 4, 8] {
                assert_eq!(blocks(len, p, 0, p), 0..len);
                for lo in 0..p {
                    let (a, b) = (blocks(len, p, 0, lo), blocks(len, p, lo, p));
                    assert_eq!((a.end, b.start), (b.start, a.end));
                }
            }
        }
    }
}
