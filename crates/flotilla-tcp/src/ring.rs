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
//! Each step is a [`Pipe::step`]: segments are cut into pipelined chunks. Everything a step
//! sends was completed in the previous step, so no step waits on its own output.

use flotilla_group::{CommError, segment, shard};

use crate::op::OpCtx;
use crate::pipe::{Mode, Pipe};
use crate::reduce;

/// The ring of `ctx`'s group: receive from the left, send to the right.
fn neighbours(ctx: &OpCtx<'_>) -> (usize, usize) {
    let (n, r) = (ctx.size(), ctx.rank());
    ((r + n - 1) % n, (r + 1) % n)
}

/// The reduce-scatter half: afterwards this rank holds the full sum of its [`shard`]
/// (bf16-rounded like what its peers receive, when the wire is bf16).
async fn scatter_half(
    ctx: &OpCtx<'_>,
    pipe: &mut Pipe<'_, '_>,
    buf: &mut [f32],
) -> Result<(), CommError> {
    let (n, r, len) = (ctx.size(), ctx.rank(), buf.len());
    let (left, right) = neighbours(ctx);
    for k in 0..n - 1 {
        let send = segment(len, n, (r + n - k) % n);
        let recv = segment(len, n, (r + 2 * n - k - 1) % n);
        pipe.step(buf, (right, send), (left, recv), Mode::Reduce)
            .await?;
    }
    if pipe.bf16() {
        // Peers will receive this segment rounded to bf16; round our copy the same way so
        // every rank ends bit-identical.
        reduce::round_to_bf16(&mut buf[shard(len, n, r)]);
    }
    Ok(())
}

/// The all-gather half: this rank starts with its [`shard`] and ends with every one.
async fn gather_half(
    ctx: &OpCtx<'_>,
    pipe: &mut Pipe<'_, '_>,
    buf: &mut [f32],
) -> Result<(), CommError> {
    let (n, r, len) = (ctx.size(), ctx.rank(), buf.len());
    let (left, right) = neighbours(ctx);
    for k in 0..n - 1 {
        let send = segment(len, n, (r + 1 + n - k) % n);
        let recv = segment(len, n, (r + n - k) % n);
        pipe.step(buf, (right, send), (left, recv), Mode::Copy)
            .await?;
    }
    Ok(())
}

/// Ring all-reduce (sum) of `buf` in place: [`reduce_scatter`] then [`all_gather`] on one
/// ring. A no-op for one rank or an empty buffer.
pub(crate) async fn all_reduce(ctx: &OpCtx<'_>, buf: &mut [f32]) -> Result<(), CommError> {
    if ctx.size() == 1 || buf.is_empty() {
        return Ok(());
    }
    let mut pipe = Pipe::new(ctx);
    scatter_half(ctx, &mut pipe, buf).await?;
    gather_half(ctx, &mut pipe, buf).await
}

/// Ring reduce-scatter (sum): afterwards `buf[shard(len, n, rank)]` holds the sum of that
/// shard over the group, summed in the all-reduce's order (the rest of `buf` holds partial
/// sums). A no-op for one rank or an empty buffer.
pub(crate) async fn reduce_scatter(ctx: &OpCtx<'_>, buf: &mut [f32]) -> Result<(), CommError> {
    if ctx.size() == 1 || buf.is_empty() {
        return Ok(());
    }
    scatter_half(ctx, &mut Pipe::new(ctx), buf).await
}

/// Ring all-gather: each rank gives `buf[shard(len, n, rank)]` and ends with every shard.
/// A no-op for one rank or an empty buffer.
pub(crate) async fn all_gather(ctx: &OpCtx<'_>, buf: &mut [f32]) -> Result<(), CommError> {
    if ctx.size() == 1 || buf.is_empty() {
        return Ok(());
    }
    gather_half(ctx, &mut Pipe::new(ctx), buf).await
}
