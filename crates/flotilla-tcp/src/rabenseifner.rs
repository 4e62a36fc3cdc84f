//! Rabenseifner's all-reduce (sum) of `f32` buffers for the middle sizes: a reduce-scatter
//! by recursive halving, then an all-gather by recursive doubling (what Open MPI's `tuned`
//! component picks between the small-message and the ring sizes).
//!
//! Among `n` ranks (`n` a power of two), the buffer is cut into `n` blocks. Halving: in step
//! `k` rank `q` and rank `q ^ (n >> (k + 1))` split the blocks they both still hold; each
//! sends the half it gives up to the other and adds the half it keeps from the other, so
//! after `log2 n` steps rank `q` holds the sum of block `q`. Doubling: in step `k` rank `q`
//! and rank `q ^ 2^k` swap the blocks each has finished. Each rank sends `2 (n-1)/n` of the
//! buffer, as in the ring, but in `2 log2 n` dependent steps instead of `2 (n-1)`.
//!
//! Only for worlds of a power of two: the fold that [`crate::doubling`] uses for the others
//! (an even rank hands its whole buffer to the odd rank above it and gets the result back)
//! puts two whole buffers more on the folded ranks' links, and measured 2.2× slower than the
//! ring with 3 ranks on 1 Gbit/s links (`scripts/bench_shaped_links.sh`, `RANKS=3`), so the
//! size dispatch (`tcp_group.rs`) sends those worlds to the ring.
//!
//! Every block is summed by one rank only and then copied, so every rank ends with the same
//! bits. Every exchange is a [`Pipe::step`] (chunked and pipelined), so frames stay at
//! `chunk_bytes` whatever the size. With [`crate::WireFormat::Bf16`] each block is rounded to
//! bf16 by its owner before the all-gather, as the ring rounds its segments, so every rank
//! ends bit-identical.

use flotilla_group::{CommError, segments as blocks};

use crate::op::OpCtx;
use crate::pipe::{Mode, Pipe};
use crate::reduce;

/// Rabenseifner all-reduce (sum) of `buf` in place over a world whose size is a power of
/// two; a no-op for one rank or an empty buffer. Every rank ends with the same bits.
pub(crate) async fn all_reduce(ctx: &OpCtx<'_>, buf: &mut [f32]) -> Result<(), CommError> {
    let (n, q, len) = (ctx.size(), ctx.rank(), buf.len());
    if n == 1 || len == 0 {
        return Ok(());
    }
    if !n.is_power_of_two() {
        return Err(CommError::InvalidArgument(format!(
            "Rabenseifner's all-reduce needs a power-of-two world, not {n} ranks"
        )));
    }
    let mut pipe = Pipe::new(ctx);
    let (mut lo, mut size) = (0, n);
    while size > 1 {
        let half = size / 2;
        let (keep, give) = if q & half == 0 {
            (lo..lo + half, lo + half..lo + size)
        } else {
            (lo + half..lo + size, lo..lo + half)
        };
        let (k, g) = (
            blocks(len, n, keep.start, keep.end),
            blocks(len, n, give.start, give.end),
        );
        pipe.step(buf, (q ^ half, g), (q ^ half, k), Mode::Reduce)
            .await?;
        (lo, size) = (keep.start, half);
    }
    if pipe.bf16() {
        // Peers receive this block rounded to bf16; round our copy alike.
        reduce::round_to_bf16(&mut buf[blocks(len, n, q, q + 1)]);
    }
    while size < n {
        let theirs = lo ^ size;
        let (mine, other) = (
            blocks(len, n, lo, lo + size),
            blocks(len, n, theirs, theirs + size),
        );
        pipe.step(buf, (q ^ size, mine), (q ^ size, other), Mode::Copy)
            .await?;
        (lo, size) = (lo.min(theirs), 2 * size);
    }
    Ok(())
}
