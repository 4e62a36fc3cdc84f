//! flotilla-mpi: Flotilla's MPI backend — `MpiGroup`, an implementation of
//! [`flotilla_group::ProcessGroup`] over MPI (rsmpi on Open MPI), chosen with `backend: mpi`
//! in a binary built with the `mpi` feature and started by `mpirun`. It depends on the
//! interface crate alone (no tokio, no TLS); `recv_any` and `split` are the interface's
//! provided methods over this backend's mailbox take and `MPI_Comm_split`.
//!
//! Everything is behind this crate's `mpi` feature (off by default), so that building the
//! workspace needs no MPI headers; without it the crate is empty, and so are its docs from
//! here on (they link to the feature's items).
#![cfg(feature = "mpi")]
//!
//! * MPI is initialised once per process, on first use, at
//!   `MPI_THREAD_MULTIPLE` (anything less is a clear error), and ended by [`finalize`].
//! * Each group runs its collectives on a worker thread of its own, in the order issued
//!   (module `worker`): that order is the group's collective order, including non-blocking
//!   all-reduces, and groups (the async all-reduce's cycle, the stall inspector) run
//!   side by side.
//! * Point-to-point messages: one MPI tag, the Flotilla tag in a trailer (module `wire`); a
//!   progress thread drains them into a mailbox per group, by (sender, tag)
//!   ([`flotilla_group::Mailbox`]), and fails collectives past their deadline or after an
//!   abort (modules `runtime`, `serve`).
//! * [`RawAllReduce`]: `MPI_Allreduce` with nothing between, the reference `flotilla bench
//!   allreduce --backend mpi` times.
//!
//! An example is on [`MpiGroup`] (crate-level examples would be compiled without the feature).
#![warn(missing_docs)]

mod group;
mod ops;
mod raw;
mod raw_allreduce;
mod runtime;
mod serve;
mod state;
mod stats;
mod wire;
mod worker;

pub use group::{MpiConfig, MpiGroup};
pub use raw_allreduce::RawAllReduce;
pub use runtime::{Finalized, MpiInitError, finalize};
