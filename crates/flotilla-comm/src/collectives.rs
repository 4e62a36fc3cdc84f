//! Barrier, broadcast, all-gather and reductions of small integer buffers.
//!
//! Barrier, all-gather and the integer reductions exchange one frame with every peer
//! directly (one round trip over the full mesh; integer buffers are small: counters, flags,
//! bit sets). Broadcast is a pipelined chain along the ring starting at the
//! root: a length frame, then `chunk_bytes` chunks, each forwarded as soon as it arrives.

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

/// Pipelined chain broadcast. `len_of` is called on non-root ranks with the root's length
/// (in bytes) and must return the local buffer to fill, of exactly that length.
async fn chain<'b>(
    ctx: &OpCtx<'_>,
    root: usize,
    root_buf: Option<&'b mut [u8]>,
    len_of: impl FnOnce(u64) -> Result<&'b mut [u8], CommError>,
) -> Result<(), CommError> {
    let (n, me) = (ctx.size(), ctx.rank());
    if n == 1 {
        return Ok(());
    }
    let (left, right) = ((me + n - 1) % n, (me + 1) % n);
    let forward = right != root;
    let chunk = ctx.cfg().chunk_bytes;
    if let Some(buf) = root_buf {
        ctx.send(right, 0, &(buf.len() as u64).to_le_bytes())
            .await?;
        for (i, c) in buf.chunks(chunk).enumerate() {
            ctx.send(right, i as u32 + 1, c).await?;
        }
        return Ok(());
    }
    let f = ctx.recv(left, 0, Some(8)).await?;
    if forward {
        ctx.send(right, 0, &f.payload).await?;
    }
    let mut a = [0u8; 8];
    a.copy_from_slice(&f.payload);
    let buf = len_of(u64::from_le_bytes(a))?;
    for (i, c) in buf.chunks_mut(chunk).enumerate() {
        let tag = i as u32 + 1;
        let f = ctx.recv(left, tag, Some(c.len())).await?;
        if forward {
            ctx.send(right, tag, &f.payload).await?;
        }
        c.copy_from_slice(&f.payload);
    }
    Ok(())
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
        return chain(ctx, root, Some(bytes), |_| unreachable_len()).await;
    }
    let (mine, world_left, op) = (
        bytes.len() as u64,
        ctx.world_rank((ctx.rank() + ctx.size() - 1) % ctx.size()),
        ctx.describe(),
    );
    chain(ctx, root, None, move |theirs| {
        if theirs == mine {
            Ok(bytes)
        } else {
            Err(CommError::Protocol {
                peer: world_left,
                detail: format!(
                    "{op}: root {root} broadcasts {} f32 values but this rank passed {}",
                    theirs / 4,
                    mine / 4
                ),
            })
        }
    })
    .await
}

/// Broadcasts `root`'s bytes; other ranks' buffers are resized to match.
pub(crate) async fn broadcast_bytes(
    ctx: &OpCtx<'_>,
    buf: &mut Vec<u8>,
    root: usize,
) -> Result<(), CommError> {
    check_root(ctx, root)?;
    if ctx.rank() == root {
        return chain(ctx, root, Some(buf.as_mut_slice()), |_| unreachable_len()).await;
    }
    let max = ctx.cfg().max_frame_bytes as u64 * 1024;
    let world_left = ctx.world_rank((ctx.rank() + ctx.size() - 1) % ctx.size());
    chain(ctx, root, None, move |len| {
        let len = usize::try_from(len)
            .ok()
            .filter(|&l| l as u64 <= max)
            .ok_or_else(|| CommError::Protocol {
                peer: world_left,
                detail: format!("broadcast of {len} bytes exceeds the limit of {max} bytes"),
            })?;
        buf.clear();
        buf.resize(len, 0);
        Ok(buf.as_mut_slice())
    })
    .await
}

/// The root never asks for a length; kept as an error rather than a panic.
fn unreachable_len<'b>() -> Result<&'b mut [u8], CommError> {
    Err(CommError::InvalidArgument(
        "internal: root asked for a broadcast length".into(),
    ))
}
