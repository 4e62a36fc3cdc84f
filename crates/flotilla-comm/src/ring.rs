//! Bandwidth-optimal ring all-reduce (sum) on `f32` buffers.
//!
//! The buffer is split into `world_size` contiguous segments (sizes differ by at most one
//! element). Reduce-scatter: in step `k` (0..n-1) rank `r` sends segment `(r - k) mod n` to
//! rank `r + 1` and adds segment `(r - k - 1) mod n` received from rank `r - 1`; afterwards
//! rank `r` holds the full sum of segment `(r + 1) mod n`. All-gather: in step `k` rank `r`
//! forwards segment `(r + 1 - k) mod n` and stores segment `(r - k) mod n`. Each rank sends
//! and receives `2 (n-1)/n` of the buffer in total.
//!
//! Each step is a [`Pipe::step`]: segments are cut into pipelined chunks. Everything a step
//! sends was completed in the previous step, so no step waits on its own output.

use flotilla_group::CommError;

use crate::op::OpCtx;
use crate::pipe::{Mode, Pipe, segment};
use crate::reduce;

/// Ring all-reduce (sum) of `buf` in place. A no-op for one rank or an empty buffer.
pub(crate) async fn all_reduce(ctx: &OpCtx<'_>, buf: &mut [f32]) -> Result<(), CommError> {
    let (n, r) = (ctx.size(), ctx.rank());
    if n == 1 || buf.is_empty() {
        return Ok(());
    }
    let len = buf.len();
    let (left, right) = ((r + n - 1) % n, (r + 1) % n);
    let mut pipe = Pipe::new(ctx);
    for k in 0..n - 1 {
        let send = segment(len, n, (r + n - k) % n);
        let recv = segment(len, n, (r + 2 * n - k - 1) % n);
        pipe.step(buf, (right, send), (left, recv), Mode::Reduce)
            .await?;
    }
    if pipe.bf16() {
        // Peers will receive this segment rounded to bf16; round our copy the same way so
        // every rank ends bit-identical.
        reduce::round_to_bf16(&mut buf[segment(len, n, (r + 1) % n)]);
    }
    for k in 0..n - 1 {
        let send = segment(len, n, (r + 1 + n - k) % n);
        let recv = segment(len, n, (r + n - k) % n);
        pipe.step(buf, (right, send), (left, recv), Mode::Copy)
            .await?;
    }
    Ok(())
}
