//! Training strategies: how ranks cooperate on one optimizer step.
//!
//! A strategy sees the engine only through [`Engine`] (flat `f32` buffers) and the other ranks
//! only through a [`flotilla_comm::ProcessGroup`]; it never touches sockets.

mod sync_allreduce;

pub use sync_allreduce::SyncAllReduce;

use flotilla_engine::{BatchRef, Engine};

use crate::error::Result;

/// What one step produced.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepStats {
    /// This rank's mean loss on its batch.
    pub local_loss: f32,
    /// The mean loss over every rank's batch (the global batch).
    pub global_loss: f32,
}

/// A way of turning each rank's batch into a parameter update.
pub trait Strategy {
    /// A short name for logs (`sync-allreduce`).
    fn name(&self) -> &'static str;

    /// Makes every rank start from rank 0's parameters and optimizer state.
    fn synchronize_initial_state(&mut self, engine: &mut dyn Engine) -> Result<()>;

    /// One training step on this rank's batch at learning rate `lr`.
    fn step(&mut self, engine: &mut dyn Engine, batch: BatchRef<'_>, lr: f64) -> Result<StepStats>;
}
