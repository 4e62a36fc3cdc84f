//! Flotilla's training layer: run configuration, strategies (sync data parallel over a ring
//! all-reduce with fusion buckets), the per-rank training loop, checkpoints and run logs.
//!
//! Strategies talk to the engine through [`flotilla_engine::Engine`] (flat buffers) and to the
//! other ranks through [`flotilla_comm::Communicator`] collectives; they never see sockets.
#![warn(missing_docs)]

pub mod backend;
pub mod batches;
pub mod bucket;
pub mod checkpoint;
pub mod config;
pub mod divergence;
pub mod error;
pub mod eval;
pub mod fault;
pub mod gather;
pub mod history;
pub mod observe;
pub mod pipeline;
pub mod ps;
pub mod rejoin;
pub mod role;
pub mod runlog;
pub mod runloop;
pub mod strategies;
pub mod strategy;
pub mod trainer;

#[cfg(test)]
mod runloop_tests;
#[cfg(test)]
pub(crate) mod testkit;

pub use config::TrainConfig;
pub use error::{Result, TrainError};
pub use observe::{Observer, Quiet, StepEvent};
pub use trainer::{RunSummary, run};
