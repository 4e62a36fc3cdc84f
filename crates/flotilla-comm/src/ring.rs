//! Bandwidth-optimal ring all-reduce (sum) on `f32` buffers.
//!
//! The buffer is split into `world_size` contiguous segments (sizes differ by at most one
//! element). Reduce-scatter: in step `k` (0..n-1) rank `r` sends segment `(r - k) mod n` to
//! rank `r + 1` and adds segment `(r - k - 1) mod n` received from rank `r - 1`; afterwards
//! rank `r` holds the full sum of segment `(r + 1) mod n`, its `flotilla_group::shard`. All-gather: in step `k` rank `r`
//! forwards segment `(r + 1 - k) mod n` and stores segment `(r - k) mod n`. Each rank sends
//! and receives `2 (n-1)/n` of the buffer in total. The two halves are also collectives of
//! their own ([`reduce_scatter`], [`all_gather`]).
//!
//! Segments are cut into chunks of `chunk_bytes` that are pipelined: a step starts by
//! sending [`LOOKAHEAD`] chunks, then each received chunk is reduced straight from the
//! connection's reusable receive buffer into the caller's slice and the next chunk is sent,
//! so sending, the peer's receiving and local reduction overlap. Everything a step sends
//! was completed in the previous step, so no step waits on its own output.

use std::ops::Range;

use flotilla_group::{CommError, segment, shard};

use crate::buf::{f32_bytes, f32_bytes_mut};
use crate::config::WireFormat;
use crate::op::OpCtx;
use crate::reduce;

/// Chunks sent ahead of the one being received in each step.
pub(crate) const LOOKAHEAD: usize = 2;

/// Element range of chunk `c` of a segment.
fn chunk(seg: &Range<usize>, chunk_elems: usize, c: usize) -> Range<usize> {
    let start = seg.start + c * chunk_elems;
    start..(start + chunk_elems).min(seg.end)
}

fn n_chunks(seg: &Range<usize>, chunk_elems: usize) -> usize {
    seg.len().div_ceil(chunk_elems)
}

/// How a step treats what it receives.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Reduce,
    Copy,
}

struct Ring<'a, 'c> {
    ctx: &'a OpCtx<'c>,
    left: usize,
    right: usize,
    chunk_elems: usize,
    bf16: bool,
    send_tag: u32,
    recv_tag: u32,
    scratch: Vec<u8>,
}

impl Ring<'_, '_> {
    fn wire_bytes(&self, elems: usize) -> usize {
        if self.bf16 { elems * 2 } else { elems * 4 }
    }

    async fn send_chunk(&mut self, data: &[f32]) -> Result<(), CommError> {
        let tag = self.send_tag;
        self.send_tag = self.send_tag.wrapping_add(1);
        if self.bf16 {
            reduce::encode_bf16(data, &mut self.scratch);
            self.ctx.send(self.right, tag, &self.scratch).await
        } else {
            self.ctx.send(self.right, tag, f32_bytes(data)).await
        }
    }

    async fn recv_chunk(&mut self, dst: &mut [f32], mode: Mode) -> Result<(), CommError> {
        let tag = self.recv_tag;
        self.recv_tag = self.recv_tag.wrapping_add(1);
        let f = self
            .ctx
            .recv(self.left, tag, Some(self.wire_bytes(dst.len())))
            .await?;
        match (mode, self.bf16) {
            (Mode::Reduce, false) => reduce::add_assign_le_bytes(dst, &f.payload),
            (Mode::Copy, false) => f32_bytes_mut(dst).copy_from_slice(&f.payload),
            (Mode::Reduce, true) => reduce::add_assign_bf16(dst, &f.payload),
            (Mode::Copy, true) => reduce::copy_bf16(dst, &f.payload),
        }
        Ok(())
    }

    /// One ring step: send segment `send` to the right, receive segment `recv` from the left.
    async fn step(
        &mut self,
        buf: &mut [f32],
        send: Range<usize>,
        recv: Range<usize>,
        mode: Mode,
    ) -> Result<(), CommError> {
        let (ns, nr) = (
            n_chunks(&send, self.chunk_elems),
            n_chunks(&recv, self.chunk_elems),
        );
        let mut next = 0;
        while next < ns.min(LOOKAHEAD) {
            self.send_chunk(&buf[chunk(&send, self.chunk_elems, next)])
                .await?;
            next += 1;
        }
        for c in 0..nr {
            let r = chunk(&recv, self.chunk_elems, c);
            self.recv_chunk(&mut buf[r], mode).await?;
            if next < ns {
                self.send_chunk(&buf[chunk(&send, self.chunk_elems, next)])
                    .await?;
                next += 1;
            }
        }
        while next < ns {
            self.send_chunk(&buf[chunk(&send, self.chunk_elems, next)])
                .await?;
            next += 1;
        }
        Ok(())
    }
}

impl<'a, 'c> Ring<'a, 'c> {
    /// The ring of `ctx`'s group: receive from the left, send to the right.
    fn new(ctx: &'a OpCtx<'c>) -> Self {
        let (n, r) = (ctx.size(), ctx.rank());
        Ring {
            ctx,
            left: (r + n - 1) % n,
            right: (r + 1) % n,
            chunk_elems: (ctx.cfg().chunk_bytes / 4).max(1),
            bf16: ctx.cfg().wire_format == WireFormat::Bf16,
            send_tag: 0,
            recv_tag: 0,
            scratch: Vec::new(),
        }
    }

    /// The reduce-scatter half: afterwards this rank holds the full sum of its
    /// [`shard`] (bf16-rounded like what its peers receive, when the wire is bf16).
    async fn reduce_scatter(&mut self, buf: &mut [f32]) -> Result<(), CommError> {
        let (n, r, len) = (self.ctx.size(), self.ctx.rank(), buf.len());
        for k in 0..n - 1 {
            let send = segment(len, n, (r + n - k) % n);
            let recv = segment(len, n, (r + 2 * n - k - 1) % n);
            self.step(buf, send, recv, Mode::Reduce).await?;
        }
        if self.bf16 {
            // Peers will receive this segment rounded to bf16; round our copy the same way so
            // every rank ends bit-identical.
            reduce::round_to_bf16(&mut buf[shard(len, n, r)]);
        }
        Ok(())
    }

    /// The all-gather half: this rank starts with its [`shard`] and ends with every one.
    async fn all_gather(&mut self, buf: &mut [f32]) -> Result<(), CommError> {
        let (n, r, len) = (self.ctx.size(), self.ctx.rank(), buf.len());
        for k in 0..n - 1 {
            let send = segment(len, n, (r + 1 + n - k) % n);
            let recv = segment(len, n, (r + n - k) % n);
            self.step(buf, send, recv, Mode::Copy).await?;
        }
        Ok(())
    }
}

/// Ring all-reduce (sum) of `buf` in place: [`reduce_scatter`] then [`all_gather`] on one
/// ring. A no-op for one rank or an empty buffer.
pub(crate) async fn all_reduce(ctx: &OpCtx<'_>, buf: &mut [f32]) -> Result<(), CommError> {
    if ctx.size() == 1 || buf.is_empty() {
        return Ok(());
    }
    let mut ring = Ring::new(ctx);
    ring.reduce_scatter(buf).await?;
    ring.all_gather(buf).await
}

/// Ring reduce-scatter (sum): afterwards `buf[shard(len, n, rank)]` holds the sum of that
/// shard over the group, summed in the all-reduce's order (the rest of `buf` holds partial
/// sums). A no-op for one rank or an empty buffer.
pub(crate) async fn reduce_scatter(ctx: &OpCtx<'_>, buf: &mut [f32]) -> Result<(), CommError> {
    if ctx.size() == 1 || buf.is_empty() {
        return Ok(());
    }
    Ring::new(ctx).reduce_scatter(buf).await
}

/// Ring all-gather: each rank gives `buf[shard(len, n, rank)]` and ends with every shard.
/// A no-op for one rank or an empty buffer.
pub(crate) async fn all_gather(ctx: &OpCtx<'_>, buf: &mut [f32]) -> Result<(), CommError> {
    if ctx.size() == 1 || buf.is_empty() {
        return Ok(());
    }
    Ring::new(ctx).all_gather(buf).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_segment() {
        let seg = 10..45;
        let n = n_chunks(&seg, 8);
        assert_eq!(n, 5);
        assert_eq!(chunk(&seg, 8, 0), 10..18);
        assert_eq!(chunk(&seg, 8, 4), 42..45);
        assert_eq!(n_chunks(&(3..3), 8), 0);
    }
}
