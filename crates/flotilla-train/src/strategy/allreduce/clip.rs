//! Clipping by global norm (`allreduce.clip_grad_norm`, PyTorch's `clip_grad_norm_`): the
//! averaged gradient is scaled by `min(1, max / (‖g‖ + 1e-6))`, `‖g‖` its L2 norm over every
//! parameter. The norm is summed in one order whether the gradient is whole on every rank or
//! sharded by ZeRO: each rank's share (its [`owned_ranges`], in flat order) squared and
//! summed in `f64`, then the shares summed in rank order; so ZeRO's step stays bitwise the
//! step of plain all-reduce.

use flotilla_tcp::ProcessGroup;

use super::zero::owned_ranges;
use crate::bucket::BucketPlan;
use crate::error::{Result, TrainError};

/// PyTorch's epsilon in the clipping factor.
const EPSILON: f64 = 1e-6;

/// The sum of the squares of `values`, in order, in `f64`.
pub(crate) fn square_sum(values: &[f32]) -> f64 {
    values.iter().map(|&v| f64::from(v) * f64::from(v)).sum()
}

/// The factor that scales a gradient of norm `norm` to at most `max`: 1 when it is within.
fn factor(norm: f64, max: f64) -> f32 {
    (max / (norm + EPSILON)).min(1.0) as f32
}

/// The global norm of a gradient every one of `n` ranks holds whole (`flat`): the shares of
/// the ranks a ZeRO job would have, summed in rank order.
fn whole_norm(flat: &[f32], plan: &BucketPlan, n: usize) -> f64 {
    let shares = (0..n).map(|r| {
        let mut ranges = owned_ranges(plan, n, r);
        ranges.sort_by_key(|r| r.start);
        ranges
            .into_iter()
            .map(|x| square_sum(&flat[x]))
            .sum::<f64>()
    });
    shares.sum::<f64>().sqrt()
}

/// The global norm of a gradient sharded over `comm`'s ranks (`shard`: this rank's values,
/// in flat order): every rank's share gathered, summed in rank order.
fn sharded_norm(shard: &[f32], comm: &dyn ProcessGroup) -> Result<f64> {
    gathered_norm(square_sum(shard), comm, 0..comm.size())
}

/// The norm of a gradient whose shares of squares (`mine`: this rank's) are gathered over
/// `comm`: the shares of the ranks `members` summed in that order (a pipeline's: the stages
/// of one replica). Collective over `comm`.
pub(crate) fn gathered_norm(
    mine: f64,
    comm: &dyn ProcessGroup,
    members: std::ops::Range<usize>,
) -> Result<f64> {
    let shares = comm.all_gather_bytes(&mine.to_le_bytes())?;
    let mut total = 0.0f64;
    for rank in members {
        let bytes = shares.get(rank).map(Vec::as_slice).unwrap_or_default();
        let bytes: [u8; 8] = bytes.try_into().map_err(|_| {
            TrainError::Divergence(format!(
                "rank {rank} sent a gradient norm share of {} bytes, not 8",
                bytes.len()
            ))
        })?;
        total += f64::from_le_bytes(bytes);
    }
    Ok(total.sqrt())
}

/// Scales `grads` of global norm `norm` to at most `max` (PyTorch's factor).
pub(crate) fn scale_to(grads: &mut [f32], norm: f64, max: f64) {
    let f = factor(norm, max);
    if f < 1.0 {
        for g in grads.iter_mut() {
            *g *= f;
        }
    }
}

/// Clips `grads` (the whole averaged gradient, or with `sharded` this rank's ZeRO shard of
/// it) to global norm `max`; returns the norm before clipping.
pub fn clip(
    grads: &mut [f32],
    max: f64,
    sharded: bool,
    plan: &BucketPlan,
    comm: &dyn ProcessGroup,
) -> Result<f64> {
    let norm = if sharded {
        sharded_norm(grads, comm)?
    } else {
        whole_norm(grads, plan, comm.size())
    };
    scale_to(grads, norm, max);
    Ok(norm)
}
