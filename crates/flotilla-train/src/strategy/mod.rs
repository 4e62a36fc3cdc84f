//! Data-parallel strategies: how peers that all hold the model cooperate on one optimizer
//! step. Each is a [`crate::role::Role`]; it sees the engine only through
//! [`flotilla_engine::Engine`] (flat `f32` buffers) and the other ranks only through a
//! [`flotilla_comm::ProcessGroup`]; it never touches sockets.

mod sync_allreduce;

pub use sync_allreduce::SyncAllReduce;
