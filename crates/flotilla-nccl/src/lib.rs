//! flotilla-nccl: Flotilla's NCCL backend — `NcclGroup`, an implementation of
//! [`flotilla_group::ProcessGroup`] whose `f32` collectives (all-reduce, broadcast,
//! reduce-scatter, all-gather) run over NCCL on this rank's GPU, chosen with
//! `backend: nccl` in a binary built with the `nccl` feature. **Compile-checked only: it
//! has not run on NVIDIA hardware** (none is attached to the machines Flotilla is tested on).
//!
//! Everything is behind this crate's `nccl` feature (off by default); without it the crate
//! is empty, and so are its docs from here on (they link to the feature's items).
#![cfg(feature = "nccl")]
//!
//! The backend: [`NcclGroup`], configured by [`NcclConfig`].
//!
//! * **Two planes**, as PyTorch's NCCL process group over its TCP store: a control group
//!   (Flotilla's TCP [`flotilla_group::ProcessGroup`], after its rendezvous) carries the NCCL
//!   unique id (rank 0 makes it, `ncclGetUniqueId`, and broadcasts its 128 bytes), barriers,
//!   bytes, integers, point-to-point messages and sub-group agreement; NCCL carries the
//!   gradients and parameters.
//! * **Staging**: the interface moves host slices (`&mut [f32]`), so each collective copies
//!   its buffer into device memory on the group's CUDA stream, runs the NCCL collective
//!   there, and copies the result back (module `ops`). A device-resident engine would hand
//!   NCCL its own buffers instead; until then every collective costs two PCIe copies.
//! * **Order and deadlines** (module `queue`): each group runs its collectives on a worker
//!   thread of its own in the order issued (NCCL's rule: every rank enqueues the same
//!   collectives in the same order); a watchdog fails a collective older than the group's
//!   timeout with a [`flotilla_group::CommError::Deadline`] naming the group and its ranks,
//!   and calls `ncclCommAbort` so the stuck kernel returns; an abort does the same.
//! * The driver and NCCL are loaded at run time (cudarc's dynamic loading): a machine without
//!   `libcuda.so` or `libnccl.so` gets an error naming the library, not a panic.
#![warn(missing_docs)]

mod comm;
mod group;
mod ops;
#[cfg(test)]
mod ops_tests;
mod queue;
#[cfg(test)]
mod queue_tests;

pub use group::{NcclConfig, NcclGroup};
