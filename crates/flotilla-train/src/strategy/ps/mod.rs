//! Parameter servers: flat (one server, N workers) and hierarchical (a global server over
//! local servers, each with its workers), each level `sync` or `async`; workers push
//! gradients, or weight deltas for model averaging (`local_steps > 1`).
//!
//! Every process of the job joins one world at rendezvous and takes the role of its rank in
//! the [`flotilla_cluster::Topology`]. Roles talk by [`flotilla_ps::PsMessage`]s, point to
//! point under [`flotilla_ps::TAG`]; every message carries the parameter version it
//! refers to, and every wait has the run's deadline. The protocol, push admission,
//! aggregation and inbox live in `flotilla-ps`.

mod deadlines;
pub mod job;
pub mod local;
mod members;
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
mod elastic_tests;
#[cfg(test)]
mod formula_kit;
#[cfg(test)]
mod local_elastic_tests;
#[cfg(test)]
mod machine_tests;

use crate::error::{Result, TrainError};
use flotilla_ps::PsMessage;

/// What every role of a parameter-server job is given (the run loop's context).
pub use crate::strategy::Cx as PsContext;

/// Sends one message to `peer`.
pub fn send(
    comm: &std::sync::Arc<dyn flotilla_tcp::ProcessGroup>,
    peer: usize,
    msg: &PsMessage,
) -> Result<()> {
    send_bytes(comm, peer, &msg.encode())
}

/// Sends an already encoded message to `peer` (to encode once for several peers).
pub fn send_bytes(
    comm: &std::sync::Arc<dyn flotilla_tcp::ProcessGroup>,
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
    comm: &std::sync::Arc<dyn flotilla_tcp::ProcessGroup>,
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

/// Refusals in a row after which a worker or local server stops pushing, naming the last
/// reason: a push refused that often (stale each time, or not finite on batch after batch)
/// will not be taken.
pub const MAX_REFUSED_IN_A_ROW: u32 = 100;

/// A child's count of its parent's refusals in a row.
#[derive(Debug, Default)]
pub(crate) struct Refusals {
    in_a_row: u32,
    /// A refusal was answered with a pull, whose parameters do not mean a push was taken.
    pulled_again: bool,
}

impl Refusals {
    /// Takes `parent`'s refusal of this rank's push: `Ok` to pull and push again, or the
    /// error that ends this rank (a refusal no retry changes, or too many in a row).
    pub(crate) fn refused(&mut self, parent: usize, reason: String, retry: bool) -> Result<()> {
        self.in_a_row += 1;
        self.pulled_again = true;
        let how = if !retry {
            "for good".to_string()
        } else if self.in_a_row >= MAX_REFUSED_IN_A_ROW {
            format!("{} times in a row (the last)", self.in_a_row)
        } else {
            return Ok(());
        };
        Err(TrainError::PushRefused {
            parent,
            how,
            reason,
        })
    }

    /// Parameters came: the answer to the pull after a refusal, or to a push that was
    /// taken (which ends a run of refusals).
    pub(crate) fn params(&mut self) {
        if std::mem::take(&mut self.pulled_again) {
            return;
        }
        self.in_a_row = 0;
    }
}

/// The error of a rank whose peer `from` failed with `reason` (a [`PsMessage::Abort`]).
pub fn aborted_by(from: usize, reason: &str) -> TrainError {
    TrainError::Peer {
        peer: from,
        message: format!("rank {from} failed: {reason}"),
    }
}
