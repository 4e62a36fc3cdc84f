//! Flotilla's training layer: run configuration, the ways of training ([`strategy`]: sync and
//! async all-reduce, parameter servers, pipeline stages), the per-rank run loop, checkpoints
//! and run logs.
//!
//! Strategies talk to the engine through [`flotilla_engine::Engine`] (flat buffers) and to the
//! other ranks through a [`flotilla_tcp::ProcessGroup`]; they never see sockets.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod backend;
pub mod batches;
pub mod bucket;
pub mod checkpoint;
pub mod checkpoint_export;
pub(crate) mod checkpoint_offer;
pub mod config;
pub mod divergence;
pub mod elastic;
pub mod error;
pub mod eval;
pub mod fault;
pub mod gather;
pub mod gpu;
pub mod history;
pub mod job_data;
pub mod model_file;
pub mod observe;
pub mod plan;
pub mod presets;
pub mod program;
pub mod rejoin;
mod resident;
pub mod run;
pub mod runlog;
pub mod runloop;
pub mod strategy;
pub mod trainer;

#[cfg(test)]
mod runloop_tests;
#[cfg(test)]
pub(crate) mod testkit;

pub use config::TrainConfig;
pub use error::{Result, TrainError};
pub use observe::{Observer, Quiet, StepEvent};
pub use run::{Progress, Run, run};
pub use strategy::{ModelIo, ModelSource, StageMaker};
/// The pipeline and parameter servers at the crate's root, where the config
/// (`crate::pipeline::Schedule`), the CLI and the fuzz targets name them.
pub use strategy::{pipeline, ps};
pub use trainer::RunSummary;
