//! Parameter servers: flat (one server, N workers) and hierarchical (a global server over
//! local servers, each with its workers), each level `sync` or `async`; workers push
//! gradients, or weight deltas for model averaging (`local_steps > 1`).
//!
//! Every process of the job joins one world at rendezvous and takes the role of its rank in
//! the [`flotilla_cluster::Topology`]. Roles talk by [`protocol::PsMessage`]s, point to
//! point under [`protocol::TAG`]; every message carries the parameter version it
//! refers to, and every wait has the run's deadline.

pub mod aggregate;
pub mod inbox;
pub mod local;
pub mod protocol;
pub mod rejoins;
pub mod serve;
pub mod server;
pub mod shard_server;
pub mod staleness;
pub mod worker;

#[cfg(test)]
mod async_tests;
#[cfg(test)]
mod averaging_tests;
#[cfg(test)]
mod formula_kit;
#[cfg(test)]
mod machine_tests;

use flotilla_cluster::{RoleKind, Topology};

use crate::error::{Result, TrainError};
use crate::strategy::Strategy;
use protocol::PsMessage;

/// What every role of a parameter-server job is given (the run loop's context).
pub use crate::strategy::Cx as PsContext;

/// Sends one message to `peer`.
pub fn send(
    comm: &std::sync::Arc<dyn flotilla_comm::ProcessGroup>,
    peer: usize,
    msg: &PsMessage,
) -> Result<()> {
    send_bytes(comm, peer, &msg.encode())
}

/// Sends an already encoded message to `peer` (to encode once for several peers).
pub fn send_bytes(
    comm: &std::sync::Arc<dyn flotilla_comm::ProcessGroup>,
    peer: usize,
    bytes: &[u8],
) -> Result<()> {
    comm.send(peer, protocol::TAG, bytes)?;
    Ok(())
}

/// Tells `down` (children) and `up` (parents) that this rank failed with `e`
/// ([`PsMessage::Abort`]; best effort: a peer that is gone cannot be told) and returns `e`.
/// Every rank of the tree then fails naming the rank at fault, not only the neighbours that
/// saw it go. A deadline is not told up: a parent that a rank waited for too long is itself
/// waiting for the rank at fault, and its own deadline names that rank.
pub fn abort_peers(
    comm: &std::sync::Arc<dyn flotilla_comm::ProcessGroup>,
    down: &[usize],
    up: &[usize],
    e: TrainError,
) -> TrainError {
    let bytes = PsMessage::Abort {
        reason: e.to_string(),
    }
    .encode();
    let up = if e.is_deadline() { &[][..] } else { up };
    for &p in down.iter().chain(up) {
        let _ = send_bytes(comm, p, &bytes);
    }
    e
}

/// The error of a rank whose peer `from` failed with `reason` (a [`PsMessage::Abort`]).
pub fn aborted_by(from: usize, reason: &str) -> TrainError {
    TrainError::Peer {
        peer: from,
        message: format!("rank {from} failed: {reason}"),
    }
}

/// This rank's role in a parameter-server topology, and the shard of the training data it
/// trains on (`(workers, index)`; servers train on nothing). `resumed_at`: the root's round
/// of the checkpoint the job resumes from (0 for a fresh start).
pub fn build_role(
    ctx: &mut PsContext<'_>,
    topology: &Topology,
    resumed_at: u64,
) -> Result<(Box<dyn Strategy>, (usize, usize))> {
    let Some(role) = topology.role(ctx.rank).cloned() else {
        return Err(crate::TrainError::config(
            "topology",
            format!(
                "rank {} has no role in a topology of {}",
                ctx.rank,
                topology.world_size()
            ),
        ));
    };
    let sync = role
        .aggregation
        .map(|a| a == flotilla_cluster::Aggregation::Sync);
    ctx.log(&format!(
        "role {}: parents [{}] children [{}]",
        topology.label(ctx.rank),
        role.parents
            .iter()
            .map(|r| r.to_string())
            .collect::<Vec<_>>()
            .join(", "),
        role.children
            .iter()
            .map(|r| r.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    ))?;
    let n = ctx.engine()?.num_params();
    let shard_servers: Vec<usize> = topology
        .servers()
        .filter(|r| matches!(r.kind, RoleKind::ShardServer { .. }))
        .map(|r| r.rank)
        .collect();
    let ranges = topology.shard_ranges(n);
    let sync = sync.unwrap_or(true);
    let policy = staleness::for_job(ctx.config, topology, ctx.rank).own;
    Ok(match role.kind {
        RoleKind::Worker { index } => {
            let ranges = if role.parents.len() == ranges.len() {
                ranges
            } else {
                flotilla_cluster::balanced_ranges(n, 1)
            };
            let w = worker::Worker::new(ctx, &role.parents, &ranges)?.resumed_at(resumed_at);
            (Box::new(w), (ctx.num_workers, index))
        }
        RoleKind::LocalServer { .. } => {
            let parent = role.parents.first().copied().unwrap_or(0);
            let m = local::LocalServer::new(ctx, parent, &role.children, sync)?;
            (Box::new(m), (1, 0))
        }
        RoleKind::ShardServer { shard } => {
            let plan = server::ShardPlan {
                index: shard,
                ranges,
                servers: shard_servers,
            };
            let m = shard_server::ShardServer::new(ctx, &role.children, sync, plan)?
                .with_staleness_lr(policy.staleness_lr)
                .resumed_at(resumed_at);
            (Box::new(m), (1, 0))
        }
        RoleKind::Stage { .. } => {
            return Err(crate::TrainError::config(
                "topology",
                "a pipeline stage is not a parameter-server role",
            ));
        }
        RoleKind::GlobalServer => {
            let plan = server::ShardPlan::whole(n);
            let m = shard_server::ShardServer::new(ctx, &role.children, sync, plan)?
                .with_staleness_lr(policy.staleness_lr)
                .resumed_at(resumed_at);
            (Box::new(m), (1, 0))
        }
    })
}
