//! flotilla-burn: multi-process training of a burn user's own model, in the user's own loop.
//!
//! What Horovod and PyTorch DDP made familiar, for any `#[derive(Module)]` struct and any burn
//! optimizer: connect to the job ([`init`]: the torchrun variables `RANK`, `WORLD_SIZE`,
//! `MASTER_ADDR`, `MASTER_PORT` that `flotilla launch -n N -- PROGRAM` sets), wrap the model
//! in a [`DataParallel`] (which checks that every rank has the same parameter list), take rank
//! 0's parameters and optimizer state, and after each backward pass hand burn's
//! `GradientsParams` to [`DataParallel::average`]: the averaged gradients come back, ready for
//! the optimizer. No flat buffers in user code.
//!
//! Every other way of training of `flotilla train` — async all-reduce, ZeRO, parameter
//! servers (flat, sharded, hierarchical; sync or async; model averaging with
//! `local_steps`) — is the library's one implementation, for a user's module as for a spec
//! model: [`train`] runs the configured one on a [`UserModule`] (the module says its loss
//! and logits through [`TrainModule`]), with checkpoints and `--resume`, the timeline,
//! `/metrics` and the report of a config job (`examples/lenet5_program.rs`). [`session`] is
//! the same run for the program's own loop: `while let Some(p) = run.step()? { ... }`, with
//! evaluation, checkpoints and a stop of its own between steps ([`Session`]);
//! [`spec_session`] the same for the job's YAML model.
//!
//! A program's own loop in an elastic job (`flotilla launch -n MIN:MAX -- PROGRAM`) runs
//! under [`elastic::run`]: its [`TrainState`] committed after each step, rolled back and
//! taken from the members when one is lost, handed to a process that joins
//! (`examples/custom_model.rs`).
//!
//! A program written as burn's guide writes it, with burn-train's `Learner`
//! (`SupervisedTraining`: its metrics, checkpoints and resume), trains on every rank with
//! [`LearnerStrategy`] ([`learner`]; `examples/mnist_learner.rs`).
//!
//! For a model too big for one rank, the program cuts it into stage modules
//! ([`StageModule`]: a forward over [`NamedTensors`]; [`UserModule::with_stages`]), and
//! `strategy: pipeline` runs them in the library's one pipeline — the spec's: GPipe or 1F1B,
//! skip tensors straight to the stage that takes them, replicas of every stage, checkpoints
//! and `--resume` (`examples/pipeline_model.rs`). The same stage modules are what ZeRO stage
//! 3 (`zero: 3`, PyTorch FSDP's `fully_shard` per module) shards the module by: each rank
//! keeps 1/N of the parameters, gradients and optimizer state; each stage module's
//! parameters are gathered just before it runs (the next one's gather prefetched), released
//! after, and gathered again to recompute its forward in backward; dropout in it draws the
//! same masks both times. A fresh start draws the module one tensor at a time, never whole;
//! it trains to the bits of `zero: 0` where a YAML model does (`examples/lenet5_program.rs`
//! with `--zero 3`). `recompute: true` runs them the same way on the whole module's
//! parameters (PyTorch's activation checkpointing per stage module).
//!
//! [`conv2d`] runs a burn `Conv2d` of the user's model through Flotilla's convolution on Flex
//! (per-image GEMMs, the batch split over rayon's threads with bitwise the same result at any
//! count): `flotilla_burn::conv2d(&self.conv, x)` in place of `self.conv.forward(x)`
//! ([`conv2d_relu`] for `relu(self.conv.forward(x))`, the ReLU fused), the same module, parameters and checkpoints; other
//! backends and layers it does not cover
//! (dilation, groups, `Same` padding) run burn's own forward.
//!
//! ```no_run
//! # use burn::prelude::*;
//! # use burn::nn::{Linear, LinearConfig};
//! # use burn::optim::{GradientsParams, SgdConfig};
//! # #[derive(Module, Debug)] struct Net { fc: Linear }
//! # fn batch(rank: usize, step: usize) -> (Tensor<2>, Tensor<2>) { unimplemented!() }
//! let group = flotilla_burn::init()?;
//! let device = Device::default().autodiff();
//! let net = Net { fc: LinearConfig::new(4, 1).init(&device) };
//! let dp = flotilla_burn::DataParallel::new(group, &net)?;
//! let mut net = dp.broadcast_model(net)?;
//! let mut optim = dp.broadcast_optimizer(SgdConfig::new().init())?;
//! # let mut dp = dp;
//! for step in 0..100 {
//!     let (x, y) = batch(dp.rank(), step); // this rank's shard of the global batch
//!     let loss = (net.fc.forward(x) - y).powf_scalar(2.0).mean();
//!     let grads = GradientsParams::from_grads(loss.backward(), &net);
//!     let grads = dp.average(grads, &net)?;
//!     net = optim.step(0.1, net, grads);
//! }
//! dp.save(&net, "net.safetensors".as_ref())?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod agree;
mod checkpoint;
mod data_parallel;
pub mod elastic;
mod error;
pub mod learner;
mod param_shards;
mod sharded_dataset;
mod sync_batch_norm;
mod user_module;

use std::sync::Arc;

pub use checkpoint::{load, save};
pub use data_parallel::{BufferSync, DataParallel};
pub use elastic::{ElasticRun, TrainState};
pub use error::{DistError, Result};
pub use flotilla_data::{ImageDataset, Normalization, Samples};
pub use flotilla_engine::{BatchRef, EngineError, NamedTensors, StageModule, TrainModule};
pub use flotilla_engine::{conv2d, conv2d_relu};
pub use flotilla_group::{ProcessGroup, ReduceOp};
pub use flotilla_rank::Session;
pub use flotilla_train::Progress;
pub use flotilla_train::RunSummary;
pub use learner::{GlobalOutput, LearnerStrategy, Piece};
pub use param_shards::ParamShards;
pub use sharded_dataset::{EpochHandle, ShardedDataset, StridedDataset};
pub use sync_batch_norm::{BatchNormSync, SyncBatchNorm, batch_norm_sync};
pub use user_module::{StageModules, UserModule, session, session_with_data, spec_session, train};

/// Flotilla's CPU kernels for a burn user's own forward pass (Flex; burn's ops elsewhere):
/// `kernels::linear::linear(&layer, x, relu)` in place of `layer.forward(x)` (and a ReLU
/// after it), `kernels::max_pool::max_pool2d(&pool, x)` in place of `pool.forward(x)`; the
/// same parameters and values, differentiable, bitwise the same on any number of threads.
pub mod kernels {
    pub use flotilla_engine::kernels::{linear, max_pool};
}

/// Joins the job this process was started in, as torchrun's ranks do: the settings of
/// the environment in the one schema a config job reads (`flotilla_train::program`: the
/// launcher's `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, `RANK`, every
/// `FLOTILLA_<SECTION>__<FIELD>`, the file `FLOTILLA_CONFIG` names), over the backend they
/// name (`comm.backend`: TCP by default, with the job's secret and TLS when the launcher set
/// them; MPI, NCCL).
pub fn init() -> Result<Arc<dyn ProcessGroup>> {
    let (_settings, group) = flotilla_train::program::join_from_env()?;
    Ok(group)
}

/// Held by every test that seeds the device and draws parameters: the device's random
/// generator is one for the process, and the tests run on parallel threads, so a draw of
/// another test between a seed and its draws would change them (one lock for the crate; a
/// lock per test file does not exclude the other files).
#[cfg(test)]
pub(crate) static SEED_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[cfg(test)]
mod data_parallel_tests;
#[cfg(test)]
mod sharded_dataset_tests;
#[cfg(test)]
mod sync_batch_norm_tests;
