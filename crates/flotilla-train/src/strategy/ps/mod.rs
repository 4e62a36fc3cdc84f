//! Parameter servers: flat (one server, N workers) and hierarchical (a global server over
//! local servers, each with its workers), each level `sync` or `async`; workers push
//! gradients, or weight deltas for model averaging (`local_steps > 1`).
//!
//! Every process of the job joins one world at rendezvous and takes the role of its rank in
//! the [`flotilla_cluster::Topology`]. Roles talk by [`flotilla_ps::PsMessage`]s, point to
//! point under [`flotilla_ps::TAG`]; every message carries the parameter version it
//! refers to, and every wait has the run's deadline. The protocol, push admission,
//! aggregation and inbox live in `flotilla-ps`, shared with `flotilla-burn`'s servers.

pub mod job;
pub mod local;
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
mod deadline_tests;
#[cfg(test)]
mod formula_kit;
#[cfg(test)]
mod machine_tests;

use crate::error::{Result, TrainError};
use flotilla_ps::PsMessage;

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
    comm.send(peer, flotilla_ps::TAG, bytes)?;
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
