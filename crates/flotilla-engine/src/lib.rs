//! Flotilla's tensor-engine adapter.
//!
//! Everything numeric happens in [burn](https://burn.dev) (pinned to 0.22.1): models are built
//! from a YAML [`ModelSpec`], trained through the [`Engine`] trait, and optimized by burn's own
//! optimizers. The rest of Flotilla sees only flat `f32` buffers in the documented parameter
//! order of [`ParamLayout`]; no burn type crosses this crate's public boundary except through
//! [`BurnEngine`]'s constructor arguments, which are plain data.
#![warn(missing_docs)]

pub mod backward_groups;
pub mod device;
pub mod engine;
pub mod error;
pub mod graph;
pub mod grouped;
pub mod layer;
pub mod limits;
pub mod loss;
pub mod model;
pub mod optim;
pub mod params;
pub mod partition;
pub mod profile;
pub mod spec;
pub mod split;
pub mod stage;
pub mod weights;

pub use backward_groups::BackwardGroup;
pub use device::{available_devices, device_by_name};
pub use engine::{BatchRef, BurnEngine, Engine, EvalStats};
pub use error::{EngineError, Result};
pub use graph::{Merge, Node};
pub use limits::SpecLimits;
pub use loss::cross_entropy;
pub use optim::OptimizerSpec;
pub use params::{ParamInfo, ParamLayout};
pub use partition::{LayerCost, StageEstimate, StageHost, partition};
pub use profile::profile;
pub use spec::{LayerSpec, ModelSpec, Shape};
pub use split::{Crossing, MAIN, Split};
pub use stage::{Slot, Stage};
pub use weights::ModelState;

#[cfg(test)]
mod engine_tests;
#[cfg(test)]
mod grouped_tests;
#[cfg(test)]
mod stage_tests;
