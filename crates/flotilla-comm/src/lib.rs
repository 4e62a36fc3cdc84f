//! flotilla-comm: the communication layer of Flotilla.
//!
//! It moves flat `f32` buffers and bytes between the processes of a training job and never
//! depends on the tensor engine. The API is blocking (one training thread per process); a
//! small tokio runtime owned by each [`Communicator`] does the I/O.
//!
//! * [`frame`]: length-prefixed frames with a magic/version header, a channel id (control,
//!   collectives, point-to-point share one TCP connection per pair of ranks), flags (LZ4),
//!   sequence number and a maximum frame size.
//! * Rendezvous (torchrun-style `RANK`/`WORLD_SIZE`/`MASTER_ADDR`/`MASTER_PORT`): rank 0
//!   admits ranks, checks config hash and cluster token, distributes the address table;
//!   ranks then build a full mesh. See [`CommConfig`].
//! * Collectives: [`Communicator::barrier`], [`Communicator::broadcast_f32`],
//!   [`Communicator::broadcast_bytes`], [`Communicator::all_gather_u64`], the pipelined ring
//!   [`Communicator::all_reduce_sum`] and its asynchronous form
//!   [`Communicator::all_reduce_start`] for overlapping gradient buckets with compute.
//! * [`bench`]: the all-reduce benchmark behind `flotilla bench allreduce`.
//!
//! All ranks must issue collectives in the same order; see [`Communicator`] for the
//! ordering invariant and the failure model.
//!
//! ```no_run
//! use flotilla_comm::{CommConfig, Communicator};
//! let comm = Communicator::connect(CommConfig::from_env()?)?;
//! let mut grads = vec![1.0f32; 1024];
//! comm.all_reduce_sum(&mut grads)?;
//! # Ok::<(), flotilla_comm::CommError>(())
//! ```
#![warn(missing_docs)]

pub mod bench;
mod buf;
mod collectives;
mod comm;
mod config;
mod conn;
mod error;
pub mod frame;
mod net;
mod reduce;
mod rendezvous;
mod ring;
mod wire;

pub use comm::{CommStats, Communicator, PendingAllReduce};
pub use config::{CommConfig, Compression, DEFAULT_MASTER_PORT, WireFormat};
pub use error::{CommError, PeerName, RendezvousError};
