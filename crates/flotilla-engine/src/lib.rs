//! Flotilla's tensor-engine adapter.
//!
//! Everything numeric happens in [burn](https://burn.dev) (pinned to 0.22.1): models are built
//! from a YAML [`ModelSpec`], trained through the [`Engine`] trait, and optimized by burn's own
//! optimizers. The rest of Flotilla sees only flat `f32` buffers in the documented parameter
//! order of [`ParamLayout`]. The modules are private and no burn type crosses this crate's
//! public boundary: what other crates use is re-exported here, and takes and returns plain
//! data (specs, names, flat buffers). The exceptions are [`any_module`], the bridge from a
//! burn user's own module to the same flat buffers, which is generic over burn's `Module`;
//! [`conv2d`], Flotilla's convolution on Flex for a burn `Conv2d` (the spec models' and a
//! user's own); and [`kernels`] (the linear layer and max pooling as backend extensions),
//! which also take burn's modules and tensors, so that a user's own forward pass can run them.
//!
//! A spec's layers range from convolutions to the pieces of a GPT (token and positional
//! embeddings, causal attention, pre-LN transformer blocks, layer and RMS norms): a model
//! whose output is a sequence of logits is a sequence model, with one label per position
//! ([`Engine::labels_per_sample`]). Batch norm's running statistics are buffers, a flat view
//! of their own ([`ModelState::buffer_layout`]).
#![warn(missing_docs)]

mod activation;
pub mod any_module;
mod backward_groups;
mod buffers;
mod build;
pub mod collective;
mod conv;
mod copies;
mod cut;
mod device;
mod device_spec;
mod engine;
mod error;
mod gpu;
mod graph;
mod grouped;
pub mod kernels;
mod layer;
mod limits;
mod loss;
mod model;
mod module_engine;
mod module_stage;
mod named_tensors;
mod optim;
mod params;
mod partition;
mod placement;
mod profile;
mod reshard;
mod sequence;
mod shape;
mod shard_optim;
mod spec;
mod stage;
mod stage_engine;
mod state_check;
pub mod sync_batch_norm;
#[cfg(feature = "wgpu")]
mod vulkan;
mod weights;

pub use backward_groups::BackwardGroup;
pub use conv::{conv2d, conv2d_relu};
pub use cut::{Crossing, MAIN, StageCut, ranges_from_points};
pub use device::{available_devices, check_device, describe_device};
pub use device_spec::{DeviceSpec, GpuKind};
pub use engine::{BatchRef, BurnEngine, Engine, EvalStats};
pub use error::{EngineError, Result};
pub use gpu::{device_index, gpu_count, gpu_memory, local_device, software_only};
pub use graph::{Merge, Node};
pub use limits::SpecLimits;
pub use loss::cross_entropy;
pub use module_engine::{ModuleEngine, TrainModule, layer_groups};
pub use module_stage::{
    AnyStageModule, StageBuilder, StageInput, StageModule, StageSlotsOf, module_pipeline,
};
pub use named_tensors::NamedTensors;
pub use optim::{DecayParams, OptimizerSpec};
pub use params::{ParamInfo, ParamLayout};
pub use partition::{LayerCost, StageEstimate, StageHost, check as check_cut, partition};
pub use placement::ParamPlacement;
pub use profile::profile;
pub use reshard::{FlatOptimizerState, StatePart};
pub use shard_optim::{
    ShardOptimizer, ShardPiece, optimizer_state_bound, optimizer_state_bytes, shard_pieces,
};
pub use spec::{LayerSpec, ModelSpec, Shape};
pub use stage::Stage;
pub use stage_engine::{Slot, StageEngine};
pub use weights::ModelState;

#[cfg(test)]
mod conv_tests;
#[cfg(test)]
mod engine_tests;
#[cfg(test)]
mod grouped_tests;
#[cfg(test)]
mod module_engine_tests;
#[cfg(test)]
mod module_stage_tests;
#[cfg(test)]
mod optim_tests;
#[cfg(test)]
mod reshard_tests;
#[cfg(test)]
mod shard_optim_tests;
#[cfg(test)]
mod stage_tests;
#[cfg(all(test, feature = "wgpu"))]
mod wgpu_tests;
