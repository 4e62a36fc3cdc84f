//! flotilla-group: Flotilla's process-group interface and what every backend shares.
//!
//! Strategies, servers and pipelines talk to a [`ProcessGroup`] and never to a transport. A
//! backend implements the trait's required methods (ranks, collectives, `send`, `group`,
//! and two hooks: [`ProcessGroup::take_from_mailbox`], [`ProcessGroup::subgroup_from`]) and
//! gets the rest, written once here: `recv` and `recv_any` over its mailbox, `split` over
//! an all-gather and its new-group hook, `all_gather_u64`, `all_reduce_bucket`, and
//! defaults for rejoins, activity and abort. Two backends exist:
//! the TCP transport (`flotilla_tcp::TcpGroup`, also over in-memory links) and MPI
//! (`flotilla_mpi::MpiGroup`). This crate moves `&mut [f32]` and bytes and knows nothing of
//! sockets, TLS or async runtimes.
//!
//! * [`ProcessGroup`] and its types ([`group`]): collectives, tagged point-to-point messages
//!   with deadlines, sub-groups; [`Pending`] for a collective running in the background.
//! * [`CommError`]: every group's typed, rank-naming errors (with [`RendezvousError`] of
//!   the TCP transport's start, and any backend's own setup error as a source).
//! * What backends share: [`Mailbox`] (tagged messages by group, sender and tag, with
//!   deadlines), [`Members`] (group and world ranks, the checks on ranks given) and
//!   [`subgroup`] (the `(color, key)` exchange of `split` and the new group's order).
//! * Built on the interface alone, so every backend has them: the stall inspector
//!   ([`stall`]: names tensors or collectives some ranks never start, [`StallWatcher`], and
//!   the report that the asynchronous all-reduce's cycle, in `flotilla-train`, feeds).
//!
//! All members of a group must issue its collectives in the same order; see [`group`].
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod error;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
pub mod group;
mod mailbox;
mod members;
mod pending;
pub mod shard;
pub mod stall;
pub mod subgroup;

pub use error::{CommError, PeerName, RendezvousError};
pub use group::{Activity, CommStats, LARGE_MESSAGE_PIECE, ProcessGroup, ReduceOp, Tag, tags};
pub use mailbox::{DEFAULT_MAX_QUEUED_BYTES, MESSAGE_OVERHEAD, Mailbox, Taken};
pub use members::Members;
pub use pending::{Pending, PendingAllReduce, PendingSender};
pub use shard::{segment, segments, shard};
pub use stall::{StallPolicy, StallWatcher};
