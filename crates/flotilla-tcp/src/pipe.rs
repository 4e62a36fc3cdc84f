//! Pipelined, chunked exchanges of `f32` ranges between ranks: the moving part of the ring
//! ([`crate::ring`]) and of Rabenseifner's all-reduce ([`crate::rabenseifner`]).
//!
//! A [`Pipe::step`] sends one range of the caller's buffer to a rank and receives another
//! range from a rank (the same one, or another), both cut into chunks of `chunk_bytes`: it
//! starts by sending [`LOOKAHEAD`] chunks, then each received chunk is reduced (or copied)
//! straight from the connection's receive buffer into the caller's slice and the next chunk
//! is sent, so sending, the peer's receiving and the local reduction overlap. The ranges of
//! one step never overlap, and the caller only sends what an earlier step completed, so a
//! step never waits on its own output. Frames are numbered per peer and direction (the
//! `n`-th frame this rank sends to `q` is frame `n` of the collective on that link), so any
//! sequence of steps between any ranks matches frame for frame on both ends.
//!
//! With [`WireFormat::Bf16`] every chunk travels as bf16 (accumulation stays `f32`).

use std::ops::Range;

use flotilla_group::CommError;

use crate::buf::{f32_bytes, f32_bytes_mut};
use crate::config::WireFormat;
use crate::op::OpCtx;
use crate::reduce;

/// Chunks sent ahead of the one being received in each step.
pub(crate) const LOOKAHEAD: usize = 2;

/// Element range of chunk `c` of a range.
fn chunk(seg: &Range<usize>, chunk_elems: usize, c: usize) -> Range<usize> {
    let start = seg.start + c * chunk_elems;
    start..(start + chunk_elems).min(seg.end)
}

fn n_chunks(seg: &Range<usize>, chunk_elems: usize) -> usize {
    seg.len().div_ceil(chunk_elems)
}

/// How a step treats what it receives.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Adds it into the buffer.
    Reduce,
    /// Overwrites the buffer with it.
    Copy,
}

/// The chunked exchanges of one collective (see the module docs). Ranks are group ranks.
pub(crate) struct Pipe<'a, 'c> {
    ctx: &'a OpCtx<'c>,
    chunk_elems: usize,
    bf16: bool,
    /// Frames sent to / received from each group rank so far.
    sent: Vec<u32>,
    got: Vec<u32>,
    scratch: Vec<u8>,
}

impl<'a, 'c> Pipe<'a, 'c> {
    /// The exchanges of collective `ctx`, with its configured chunk size and wire format.
    pub(crate) fn new(ctx: &'a OpCtx<'c>) -> Self {
        Self {
            ctx,
            chunk_elems: (ctx.cfg().chunk_bytes / 4).max(1),
            bf16: ctx.cfg().wire_format == WireFormat::Bf16,
            sent: vec![0; ctx.size()],
            got: vec![0; ctx.size()],
            scratch: Vec::new(),
        }
    }

    /// Whether chunks travel as bf16.
    pub(crate) fn bf16(&self) -> bool {
        self.bf16
    }

    fn wire_bytes(&self, elems: usize) -> usize {
        if self.bf16 { elems * 2 } else { elems * 4 }
    }

    async fn send_chunk(&mut self, to: usize, data: &[f32]) -> Result<(), CommError> {
        let tag = self.sent[to];
        self.sent[to] = tag.wrapping_add(1);
        if self.bf16 {
            reduce::encode_bf16(data, &mut self.scratch);
            self.ctx.send(to, tag, &self.scratch).await
        } else {
            self.ctx.send(to, tag, f32_bytes(data)).await
        }
    }

    async fn recv_chunk(
        &mut self,
        from: usize,
        dst: &mut [f32],
        mode: Mode,
    ) -> Result<(), CommError> {
        let tag = self.got[from];
        self.got[from] = tag.wrapping_add(1);
        let f = self
            .ctx
            .recv(from, tag, Some(self.wire_bytes(dst.len())))
            .await?;
        match (mode, self.bf16) {
            (Mode::Reduce, false) => reduce::add_assign_le_bytes(dst, &f.payload),
            (Mode::Copy, false) => f32_bytes_mut(dst).copy_from_slice(&f.payload),
            (Mode::Reduce, true) => reduce::add_assign_bf16(dst, &f.payload),
            (Mode::Copy, true) => reduce::copy_bf16(dst, &f.payload),
        }
        Ok(())
    }

    /// Sends `buf[send]` to group rank `to` and receives `buf[recv]` from group rank `from`
    /// (added in or copied by `mode`), pipelined chunk by chunk. Either range may be empty.
    pub(crate) async fn step(
        &mut self,
        buf: &mut [f32],
        (to, send): (usize, Range<usize>),
        (from, recv): (usize, Range<usize>),
        mode: Mode,
    ) -> Result<(), CommError> {
        let ce = self.chunk_elems;
        let (ns, nr) = (n_chunks(&send, ce), n_chunks(&recv, ce));
        let mut next = 0;
        while next < ns.min(LOOKAHEAD) {
            self.send_chunk(to, &buf[chunk(&send, ce, next)]).await?;
            next += 1;
        }
        for c in 0..nr {
            self.recv_chunk(from, &mut buf[chunk(&recv, ce, c)], mode)
                .await?;
            if next < ns {
                self.send_chunk(to, &buf[chunk(&send, ce, next)]).await?;
                next += 1;
            }
        }
        while next < ns {
            self.send_chunk(to, &buf[chunk(&send, ce, next)]).await?;
            next += 1;
        }
        Ok(())
    }
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
