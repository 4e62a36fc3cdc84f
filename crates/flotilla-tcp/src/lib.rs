//! flotilla-tcp: Flotilla's TCP transport (with shared memory between ranks of one host),
//! one backend of the process-group interface (`flotilla_group`).
//!
//! It moves flat `f32` buffers and bytes between the processes of a training job and never
//! depends on the tensor engine. The API is blocking (one training thread per process); a
//! small tokio runtime owned by each [`TcpGroup`] does the I/O. The interface itself
//! ([`ProcessGroup`], [`CommError`], the stall inspector) lives in `flotilla_group`; this
//! crate re-exports what its users name.
//!
//! * [`frame`]: length-prefixed frames with a magic/version header, a channel id (control,
//!   collectives, point-to-point share one TCP connection per pair of ranks), flags (LZ4),
//!   sequence number and a maximum frame size.
//! * Rendezvous (torchrun-style `RANK`/`WORLD_SIZE`/`MASTER_ADDR`/`MASTER_PORT`): rank 0
//!   admits ranks, checks config hash and world size, distributes the address table;
//!   ranks then build a full mesh. With TLS ([`tls`]), every connection is first wrapped in
//!   mutual TLS (certificates of the cluster CA); with a cluster [`Secret`], every connection
//!   then proves both ends hold it (a mutual HMAC challenge-response). See [`CommConfig`].
//! * [`TcpGroup`] implements [`ProcessGroup`] over TCP, or over in-memory links between
//!   threads ([`TcpGroup::in_memory`]): collectives (barrier, broadcast, all-gather, the
//!   `f32` all-reduce — recursive doubling up to [`CommConfig::small_all_reduce_bytes`],
//!   Rabenseifner's halving and doubling up to [`CommConfig::mid_all_reduce_bytes`] (on a
//!   power-of-two group), the pipelined ring above — and its non-blocking form for overlapping gradient buckets
//!   with compute, integer and bit-set reductions), tagged point-to-point `send` into the
//!   process's mailbox, and sub-groups (`split`, `group`) with their own sequence space over
//!   the same connections.
//! * Shared memory (`shm`): the `f32` all-reduce and broadcast of a group whose members all
//!   share this host (host keys exchanged at the rendezvous; threads of
//!   [`TcpGroup::in_memory`] share one) go through a shared segment instead
//!   ([`Transport`], [`CommConfig::shm_dir`]); everything else stays on the connections.
//! * Hierarchical all-reduce (`hier`): a group spanning several hosts with the same number
//!   `k > 1` of its ranks on each sums inside each host over shared memory, across hosts over
//!   TCP on `1/k` of the buffer per rank, and gathers inside each host again
//!   ([`Hierarchical`]); [`CommStats::bytes_sent_inter_host`] counts what crossed hosts.
//!
//! All members of a group must issue its collectives in the same order; see
//! [`flotilla_group::group`] for the ordering invariant and [`TcpGroup`] for the failure
//! model.
//!
//! ```no_run
//! use flotilla_tcp::{CommConfig, TcpGroup, ProcessGroup, Secret};
//! // Rank 1 of 2; rank 0 listens at 127.0.0.1:29500 (the default).
//! let secret = Secret::from_env()?.expect("FLOTILLA_SECRET or FLOTILLA_SECRET_FILE");
//! let comm = TcpGroup::connect(CommConfig::new(Some(1), 2).with_secret(Some(secret)))?;
//! let mut grads = vec![1.0f32; 1024];
//! comm.all_reduce_sum(&mut grads)?;
//! # Ok::<(), flotilla_tcp::CommError>(())
//! ```
#![warn(missing_docs)]
#![warn(clippy::undocumented_unsafe_blocks)]

mod auth;
mod buf;
mod collectives;
#[cfg(test)]
mod collectives_tests;
mod config;
mod conn;
mod doubling;
mod flat;
pub mod frame;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
mod hier;
#[cfg(test)]
mod hier_tests;
mod host;
mod inherited;
mod net;
mod op;
mod pipe;
mod rabenseifner;
mod reduce;
mod rendezvous;
mod ring;
mod secret;
mod segment;
mod shm;
mod stream;
mod tcp_group;
pub mod tls;
mod tls_error;
mod wire;
mod world;

pub use config::{
    CommConfig, Compression, DEFAULT_MASTER_PORT, DEFAULT_MID_ALL_REDUCE_BYTES,
    DEFAULT_SHM_CHUNK_BYTES, DEFAULT_SMALL_ALL_REDUCE_BYTES, Hierarchical, Rejoin, Transport,
    WireFormat,
};
pub use flotilla_group::{
    CommError, CommStats, LARGE_MESSAGE_PIECE, PeerName, Pending, PendingAllReduce, ProcessGroup,
    ReduceOp, RendezvousError, StallPolicy, StallWatcher, Tag, shard, tags,
};
pub use inherited::LISTEN_FD_ENV;
pub use rendezvous::announce::{PORT_ANNOUNCEMENT, announced_port};
pub use rendezvous::beacon::Beacon;
pub use rendezvous::lighthouse::{Lighthouse, LighthouseConfig, LighthouseEvent};
pub use secret::{
    HOW_TO_MAKE_A_SECRET, INSECURE_ENV, MAX_SECRET_FILE_BYTES, MIN_SECRET_BYTES, SECRET_ENV,
    SECRET_FILE_ENV, Secret, TOKEN_ENV,
};
pub use tcp_group::{Generation, TcpGroup};
pub use tls::{TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV, TlsConfig, TlsError, TlsFiles};
