//! Barrier, broadcast, all-gather and reductions of small integer buffers.
//!
//! Barrier, all-gather and the integer reductions exchange one frame with every peer
//! directly (one round trip over the full mesh; integer buffers are small: counters, flags,
//! bit sets). Broadcast is a pipelined chain along the ring starting at the
//! root: a length frame, then `chunk_bytes` chunks, each forwarded as soon as it arrives.
//! Each rank judges the length before it forwards it or allocates anything (the `f32`
//! broadcast: its own length; `broadcast_bytes`: the caller's maximum), and a byte buffer
//! grows with the chunks that arrived, never ahead of them.

use flotilla_group::CommError;

use crate::buf::f32_bytes_mut;
use crate::op::OpCtx;

/// Sends `payload` to every peer, then receives one frame from every peer (in rank order;
/// of exactly `len` bytes when given) and hands it to `each`.
async fn exchange(
    ctx: &OpCtx<'_>,
    payload: &[u8],
    len: Option<usize>,
    mut each: impl FnMut(usize, &[u8]),
) -> Result<(), CommError> {
    let (n, me) = (ctx.size(), ctx.rank());
    for p in (0..n).filter(|&p| p != me) {
        ctx.send(p, 0, payload).await?;
    }
    for p in (0..n).filter(|&p| p != me) {
        let f = ctx.recv(p, 0, len).await?;
        each(p, &f.payload);
    }
    Ok(())
}

/// Returns once every rank has entered the barrier.
pub(crate) async fn barrier(ctx: &OpCtx<'_>) -> Result<(), CommError> {
    exchange(ctx, &[], Some(0), |_, _| {}).await
}

/// Gathers one byte string per rank.
pub(crate) async fn all_gather_bytes(
    ctx: &OpCtx<'_>,
    mine: &[u8],
) -> Result<Vec<Vec<u8>>, CommError> {
    let mut out = vec![Vec::new(); ctx.size()];
    out[ctx.rank()] = mine.to_vec();
    exchange(ctx, mine, None, |p, b| out[p] = b.to_vec()).await?;
    Ok(out)
}

/// Reduces a small buffer of plain integers element-wise with `combine`, in rank order, so
/// that every rank computes the same result.
pub(crate) async fn all_reduce_small<T: bytemuck::Pod>(
    ctx: &OpCtx<'_>,
    buf: &mut [T],
    combine: impl Fn(T, T) -> T,
) -> Result<(), CommError> {
    let mut all: Vec<Vec<T>> = vec![Vec::new(); ctx.size()];
    all[ctx.rank()] = buf.to_vec();
    let len = std::mem::size_of_val(buf);
    exchange(ctx, bytemuck::cast_slice(buf), Some(len), |p, b| {
        // Frames arrive in pooled buffers of any alignment: copy out element by element.
        all[p] = b
            .chunks_exact(std::mem::size_of::<T>())
            .map(bytemuck::pod_read_unaligned)
            .collect();
    })
    .await?;
    for (i, x) in buf.iter_mut().enumerate() {
        *x = all.iter().map(|v| v[i]).reduce(&combine).unwrap_or(*x);
    }
    Ok(())
}

fn check_root(ctx: &OpCtx<'_>, root: usize) -> Result<(), CommError> {
    if root >= ctx.size() {
        return Err(CommError::InvalidArgument(format!(
            "broadcast root {root} out of range for world size {}",
            ctx.size()
        )));
    }
    Ok(())
}

/// What a non-root rank does with a chain broadcast: first judges the root's length (in
/// bytes) before anything is allocated for it, then takes the bytes chunk by chunk as they
/// arrive.
trait Sink {
    /// The length to receive, or why this rank refuses `len`.
    fn accept(&mut self, len: u64) -> Result<usize, CommError>;
    /// Bytes `at..at + bytes.len()` of the broadcast (in order, without gaps).
    fn put(&mut self, at: usize, bytes: &[u8]);
}

/// A rank's part in a chain broadcast.
enum Part<'s> {
    /// The root, sending these bytes.
    Root(&'s [u8]),
    /// Any other rank, handing what it receives to its sink.
    Receive(&'s mut (dyn Sink + Send)),
}

/// Pipelined chain broadcast from `root`.
async fn chain(ctx: &OpCtx<'_>, root: usize, part: Part<'_>) -> Result<(), CommError> {
    let (n, me) = (ctx.size(), ctx.rank());
    if n == 1 {
        return Ok(());
    }
    let (left, right) = ((me + n - 1) % n, (me + 1) % n);
    let forward = right != root;
    let chunk = ctx.cfg().chunk_bytes.max(1);
    let sink = match part {
        Part::Receive(sink) => sink,
        Part::Root(buf) => {
            ctx.send(right, 0, &(buf.len() as u64).to_le_bytes())
                .await?;
            for (i, c) in buf.chunks(chunk).enumerate() {
                ctx.send(right, i as u32 + 1, c).await?;
            }
            return Ok(());
        }
    };
    let f = ctx.recv(left, 0, Some(8)).await?;
    let mut a = [0u8; 8];
    a.copy_from_slice(&f.payload);
    // Judged before it travels on or anything is allocated for it.
    let len = sink.accept(u64::from_le_bytes(a))?;
    if forward {
        ctx.send(right, 0, &f.payload).await?;
    }
    drop(f);
    let (mut at, mut tag) = (0, 1u32);
    while at < len {
        let c = chunk.min(len - at);
        let f = ctx.recv(left, tag, Some(c)).await?;
        if forward {
            ctx.send(right, tag, &f.payload).await?;
        }
        sink.put(at, &f.payload);
        at += c;
        tag = tag.wrapping_add(1);
    }
    Ok(())
}

/// A non-root rank's `f32` buffer: the root's length must be its own.
struct IntoSlice<'b> {
    bytes: &'b mut [u8],
    /// Whom a mismatch names, and in which collective.
    root_world: usize,
    op: String,
}

impl Sink for IntoSlice<'_> {
    fn accept(&mut self, len: u64) -> Result<usize, CommError> {
        let mine = self.bytes.len();
        if len == mine as u64 {
            return Ok(mine);
        }
        Err(CommError::Protocol {
            peer: self.root_world,
            detail: format!(
                "{}: the root broadcasts {} f32 values but this rank passed {}",
                self.op,
                len / 4,
                mine / 4
            ),
        })
    }

    fn put(&mut self, at: usize, bytes: &[u8]) {
        self.bytes[at..at + bytes.len()].copy_from_slice(bytes);
    }
}

/// A non-root rank's byte buffer: the root's length must be at most the caller's maximum,
/// and the buffer grows with what arrived (doubling, never past the root's length), not
/// with what the root announced.
struct GrowVec<'b> {
    buf: &'b mut Vec<u8>,
    max_len: usize,
    /// The accepted length.
    len: usize,
    root_world: usize,
    op: String,
}

impl Sink for GrowVec<'_> {
    fn accept(&mut self, len: u64) -> Result<usize, CommError> {
        let len = usize::try_from(len)
            .ok()
            .filter(|&l| l <= self.max_len)
            .ok_or_else(|| CommError::Protocol {
                peer: self.root_world,
                detail: format!(
                    "{}: the root broadcasts {len} bytes, more than this rank's maximum of {} \
                     (broadcast_bytes' max_len)",
                    self.op, self.max_len
                ),
            })?;
        self.buf.clear();
        self.len = len;
        Ok(len)
    }

    fn put(&mut self, _at: usize, bytes: &[u8]) {
        let need = self.buf.len() + bytes.len();
        if need > self.buf.capacity() {
            let target = need.max(2 * self.buf.capacity()).min(self.len.max(need));
            self.buf.reserve_exact(target - self.buf.len());
        }
        self.buf.extend_from_slice(bytes);
    }
}

/// Broadcasts `root`'s `f32` buffer; every rank must pass the same length.
pub(crate) async fn broadcast_f32(
    ctx: &OpCtx<'_>,
    buf: &mut [f32],
    root: usize,
) -> Result<(), CommError> {
    check_root(ctx, root)?;
    let bytes = f32_bytes_mut(buf);
    if ctx.rank() == root {
        return chain(ctx, root, Part::Root(bytes)).await;
    }
    let mut sink = IntoSlice {
        bytes,
        root_world: ctx.world_rank(root),
        op: ctx.describe(),
    };
    chain(ctx, root, Part::Receive(&mut sink)).await
}

/// Broadcasts `root`'s bytes, at most `max_len` of them; other ranks' buffers are replaced.
pub(crate) async fn broadcast_bytes(
    ctx: &OpCtx<'_>,
    buf: &mut Vec<u8>,
    root: usize,
    max_len: usize,
) -> Result<(), CommError> {
    check_root(ctx, root)?;
    if ctx.rank() == root {
        if buf.len() > max_len {
            return Err(CommError::InvalidArgument(format!(
                "broadcast_bytes of {} bytes, more than its max_len of {max_len}",
                buf.len()
            )));
        }
        return chain(ctx, root, Part::Root(buf)).await;
    }
    let mut sink = GrowVec {
        buf,
        max_len,
        len: 0,
        root_world: ctx.world_rank(root),
        op: ctx.describe(),
    };
    chain(ctx, root, Part::Receive(&mut sink)).await
}
