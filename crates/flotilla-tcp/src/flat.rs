//! The flat `f32` all-reduce of one group over one transport: the group's shared-memory
//! segment when its members share a host, else a TCP algorithm picked by size (recursive
//! doubling, Rabenseifner's halving and doubling, the pipelined ring); and the broadcast
//! and barrier over the segment. A group whose members could not share their segment
//! (`shm/setup.rs`) runs the TCP algorithms instead. `tcp_group.rs` runs them in a group's turn;
//! `hier.rs` runs them on the sub-groups of a hierarchical all-reduce.

use std::sync::atomic::Ordering;

use flotilla_group::CommError;

use crate::collectives;
use crate::config::CommConfig;
use crate::doubling;
use crate::frame::Op;
use crate::op::OpCtx;
use crate::rabenseifner;
use crate::ring;
use crate::shm;
use crate::world::GroupState;

/// The flat all-reduce algorithms, picked by size (the same on every rank: the thresholds
/// are part of the job's config).
#[derive(Clone, Copy)]
pub(crate) enum Algorithm {
    Shm,
    Doubling,
    Rabenseifner,
    Ring,
}

impl Algorithm {
    /// The algorithm of an all-reduce of `bytes` on `ranks` ranks: the shared-memory segment
    /// for a group on one host, else by size (Rabenseifner's only on a power of two: see
    /// `rabenseifner.rs`).
    pub(crate) fn pick(cfg: &CommConfig, shm: bool, bytes: usize, ranks: usize) -> Self {
        if shm {
            Self::Shm
        } else if bytes <= cfg.small_all_reduce_bytes {
            Self::Doubling
        } else if bytes <= cfg.mid_all_reduce_bytes && ranks.is_power_of_two() {
            Self::Rabenseifner
        } else {
            Self::Ring
        }
    }

    /// The algorithm of an all-reduce of `buf` on group `g`.
    pub(crate) fn of(g: &GroupState, buf: &[f32]) -> Self {
        let bytes = std::mem::size_of_val(buf);
        Self::pick(&g.world.cfg, g.uses_segment(), bytes, g.members.len())
    }

    /// Its name in the `all_reduce` span.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Shm => "shm",
            Self::Doubling => "doubling",
            Self::Rabenseifner => "rabenseifner",
            Self::Ring => "ring",
        }
    }

    /// Runs all-reduce `ticket` of group `g` with this algorithm (in the group's turn).
    pub(crate) async fn run(
        self,
        g: &GroupState,
        ticket: u64,
        buf: &mut [f32],
    ) -> Result<(), CommError> {
        let ctx = OpCtx::new(g, ticket, Op::AllReduce);
        match self {
            Self::Shm => shm_all_reduce(g, ticket, buf).await,
            Self::Doubling => doubling::all_reduce(&ctx, buf).await,
            Self::Rabenseifner => rabenseifner::all_reduce(&ctx, buf).await,
            Self::Ring => ring::all_reduce(&ctx, buf).await,
        }
    }
}

/// Barrier `ticket` of group `g` on its shared-memory segment (in its turn): the segment's
/// barrier, no frame sent (over TCP when the group fell back to it).
pub(crate) async fn shm_barrier(g: &GroupState, ticket: u64) -> Result<(), CommError> {
    let Some(seg) = shm::segment(g, ticket, Op::Barrier).await? else {
        return collectives::barrier(&OpCtx::new(g, ticket, Op::Barrier)).await;
    };
    let watch = shm::GroupWatch {
        g,
        op: OpCtx::new(g, ticket, Op::Barrier).describe() + " (shared memory)",
    };
    shm::run_blocking(&seg, || seg.barrier(&watch))
}

/// Broadcast `ticket` of group `g` over its shared-memory segment (in its turn; over TCP
/// when the group fell back to it).
pub(crate) async fn shm_broadcast(
    g: &GroupState,
    ticket: u64,
    buf: &mut [f32],
    root: usize,
) -> Result<(), CommError> {
    let Some(seg) = shm::segment(g, ticket, Op::Broadcast).await? else {
        let ctx = OpCtx::new(g, ticket, Op::Broadcast);
        return collectives::broadcast_f32(&ctx, buf, root).await;
    };
    let watch = shm::GroupWatch {
        g,
        op: OpCtx::new(g, ticket, Op::Broadcast).describe() + " (shared memory)",
    };
    if g.me() == root {
        let s = &g.world.ep.stats;
        s.shm_bytes
            .fetch_add(std::mem::size_of_val(buf) as u64, Ordering::Relaxed);
    }
    shm::run_blocking(&seg, || seg.broadcast(buf, root, &watch))
}

/// All-gather `ticket` of group `g` over its shared-memory segment (in its turn; over TCP,
/// the ring's, when the group fell back to it).
pub(crate) async fn shm_all_gather(
    g: &GroupState,
    ticket: u64,
    buf: &mut [f32],
) -> Result<(), CommError> {
    let Some(seg) = shm::segment(g, ticket, Op::AllGatherF32).await? else {
        return ring::all_gather(&OpCtx::new(g, ticket, Op::AllGatherF32), buf).await;
    };
    let watch = shm::GroupWatch {
        g,
        op: OpCtx::new(g, ticket, Op::AllGatherF32).describe() + " (shared memory)",
    };
    let own = flotilla_group::shard(buf.len(), g.members.len(), g.me());
    let s = &g.world.ep.stats;
    s.shm_bytes
        .fetch_add((own.len() * 4) as u64, Ordering::Relaxed);
    shm::run_blocking(&seg, || seg.all_gather(buf, &watch))
}

/// All-reduce `ticket` of group `g` over its shared-memory segment (in its turn; when the
/// group fell back to TCP, with the TCP algorithm its size picks).
pub(crate) async fn shm_all_reduce(
    g: &GroupState,
    ticket: u64,
    buf: &mut [f32],
) -> Result<(), CommError> {
    let Some(seg) = shm::segment(g, ticket, Op::AllReduce).await? else {
        let bytes = std::mem::size_of_val(buf);
        let tcp = Algorithm::pick(&g.world.cfg, false, bytes, g.members.len());
        // Boxed: `run` calls this function (for `Shm`), never for a TCP algorithm.
        return Box::pin(tcp.run(g, ticket, buf)).await;
    };
    let watch = shm::GroupWatch {
        g,
        op: OpCtx::new(g, ticket, Op::AllReduce).describe() + " (shared memory)",
    };
    let s = &g.world.ep.stats;
    s.shm_bytes
        .fetch_add(std::mem::size_of_val(buf) as u64, Ordering::Relaxed);
    shm::run_blocking(&seg, || seg.all_reduce(buf, &watch))
}
