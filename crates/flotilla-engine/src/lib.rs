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
//!
//! The source is in folders by job: `spec/` (model specs, and the burn models built from
//! them), `device/` (devices by name, this machine's GPUs, where parameters are, the copies
//! between host and device), `optim/` (optimizers and their state, whole or one rank's shard),
//! `pipeline/` (cutting a model into stages, profiling and partitioning it, running a stage).
//! At the top is the engine itself (the [`Engine`] trait and its implementations, flat views
//! of parameters and buffers, the grouped backward, the differentiable all-reduce), with
//! `conv/` and `kernels/` (the host kernels).
#![warn(missing_docs)]

pub mod any_module;
mod backward_groups;
mod buffers;
pub mod collective;
mod conv;
mod device;
mod engine;
mod error;
mod grouped;
pub mod kernels;
mod module_blocks;
mod module_blocks_pass;
mod module_engine;
mod optim;
mod params;
mod pipeline;
mod recompute;
mod rng;
mod sharded;
mod sharded_tie;
mod spec;
pub mod sync_batch_norm;
mod weights;
mod weights_reader;
mod weights_writer;

pub use backward_groups::BackwardGroup;
pub use conv::{conv2d, conv2d_relu};
pub use device::device_spec::{DeviceSpec, GpuKind};
pub use device::gpu::{
    cuda_driver_count, device_index, gpu_count, gpu_memory, local_device, software_only,
};
pub use device::placement::ParamPlacement;
pub use device::{
    BURN_DEVICE_ENV, available_devices, burn_device_for, check_device, describe_device,
    device_by_name,
};
pub use engine::{BatchRef, BurnEngine, Engine, EvalStats};
pub use error::{EngineError, Result};
pub use kernels::gemm_rate::gemm_flops_per_s;
pub use module_blocks::ModuleBlock;
pub use module_engine::{ModuleEngine, TrainModule, layer_groups};
pub use optim::offload::OFFLOAD_CHUNK_VALUES;
pub use optim::recut::{Remap, ShardRecut, StateFile, recut_shard};
pub use optim::reshard::{FlatOptimizerState, StatePart};
pub use optim::shard_optim::{
    ShardOptimizer, ShardPiece, optimizer_state_bound, optimizer_state_bytes, shard_pieces,
};
pub use optim::{DecayParams, OptimizerSpec};
pub use params::{ParamInfo, ParamLayout};
pub use pipeline::cut::{Crossing, MAIN, StageCut, ranges_from_points};
pub use pipeline::loss::cross_entropy;
pub use pipeline::module_stage::{
    AnyStageModule, StageBuilder, StageInput, StageModule, StageSlotsOf, module_pipeline,
    stage_classes,
};
pub use pipeline::named_tensors::NamedTensors;
pub use pipeline::partition::{LayerCost, StageEstimate, StageHost, check as check_cut, partition};
pub use pipeline::profile::profile;
pub use pipeline::stage::Stage;
pub use pipeline::stage_engine::{Slot, StageEngine, StageSeed};
pub use sharded::{ShardSink, ShardedPass};
pub use spec::graph::{Merge, Node};
pub use spec::limits::SpecLimits;
pub use spec::{LayerSpec, ModelSpec, Shape};
pub use weights::ModelState;
pub use weights_reader::WeightsReader;
pub use weights_writer::{SavedTensor, WeightsPlan};

#[cfg(test)]
mod conv_tests;
#[cfg(test)]
mod engine_tests;
#[cfg(test)]
mod grouped_tests;
#[cfg(test)]
mod module_blocks_tests;
#[cfg(test)]
mod module_engine_tests;
#[cfg(test)]
mod recompute_tests;
#[cfg(test)]
mod sharded_tests;
#[cfg(test)]
mod tied_tests;
#[cfg(test)]
mod weights_writer_tests;
#[cfg(all(test, feature = "wgpu"))]
mod wgpu_tests;
