//! burn's own training loop on Flotilla: [`LearnerStrategy`], a burn-train
//! `SupervisedLearningStrategy`, so that a program written as burn's guide writes it
//! (`SupervisedTraining::new(dir, train, valid)...launch(Learner::new(model, optim, lr))`)
//! trains on every rank of a Flotilla job by adding one call:
//! `.with_training_strategy(strategy.training())`.
//!
//! ```no_run
//! # use burn::prelude::*;
//! # use burn::data::dataset::{Dataset, InMemDataset};
//! # fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let flotilla = flotilla_burn::LearnerStrategy::join()?;
//! let device = flotilla.device().clone(); // the job's `model.device`, with autodiff
//! let train = flotilla.shard(InMemDataset::new(vec![1u8, 2, 3, 4]))?; // this rank's part
//! // ... DataLoaderBuilder::new(batcher).build(train), the validation loader likewise,
//! // SupervisedTraining::new(dir, train_loader, valid_loader)
//! //     .with_training_strategy(flotilla.training())
//! //     .launch(Learner::new(model, optim, lr));
//! # Ok(()) }
//! ```
//!
//! What it does on every rank, each step: the `Learner`'s own forward and backward on this
//! rank's batch, the gradients averaged over the ranks in fusion buckets ([`crate::DataParallel`]),
//! the `Learner`'s own learning-rate scheduler and optimizer step — so N ranks of batch B
//! train as one device of batch N·B (the same global batch ends within rounding). Rank 0's
//! parameters are broadcast before the first step. burn's gradient accumulation
//! (`grads_accumulation(k)`) sums k local batches before the average, as on one device.
//! With ZeRO stage 1 (the job's `allreduce.zero: 1`, `flotilla launch --zero 1`), the
//! `Learner`'s optimizer steps this rank's share of the parameters only and holds only their
//! state ([`crate::ParamShards`]; the same bits as without); its checkpoints then hold rank
//! 0's share of the optimizer state, so a ZeRO-1 run does not resume (refused, said so).
//!
//! Rank 0 shows the metrics, of the global batch: each step's outputs ([`GlobalOutput`]) are
//! gathered and rank 0's event processor sees one output of every rank's samples; the other
//! ranks process no events. Rank 0 writes the `Learner`'s checkpoints (its own format and
//! directory), decides early stopping, and every rank stops together when any rank's
//! interrupter stops. Resume is the `Learner`'s: per epoch (`.checkpoint(epoch)`), every rank
//! reading rank 0's files (a directory every rank sees); the one stack's exact mid-epoch
//! resume is the [`crate::session`] API's.
//!
//! The training data: [`LearnerStrategy::shard`] cuts a burn `Dataset` by rank
//! ([`ShardedDataset`]: PyTorch's `DistributedSampler`, reshuffled per epoch with the same
//! seed on every rank, the last samples repeated so that every rank has as many), and the
//! strategy sets its epoch before each epoch. Every rank must give as many training batches
//! per epoch (a shard of the same length and batch size does); validation batches may differ.
//!
//! burn's own `ExecutionStrategy::DistributedDataParallel` trains on the devices of one
//! process; this strategy trains one device per Flotilla rank (a process, on any machine):
//! start one rank per device (`flotilla launch -n N`), each with its own device.

mod fit;
pub mod global_output;

use std::sync::{Arc, Mutex, PoisonError};

use burn::data::dataset::Dataset;
use burn::prelude::*;
use burn::train::{LearnerModel, TrainingStrategy};
use flotilla_group::ProcessGroup;

use flotilla_cluster::Arch;
use flotilla_train::config::AllReduceMode;
use flotilla_train::{TrainConfig, TrainError};

use crate::error::{DistError, Result};
use crate::sharded_dataset::{EpochHandle, ShardedDataset, StridedDataset};

pub use global_output::{GlobalOutput, Piece};

/// Refuses a job whose way of training the strategy does not run yet (it runs sync
/// all-reduce peers with the `Learner`'s own optimizer, whole or sharded by parameter:
/// ZeRO-1; ZeRO-2, async all-reduce and parameter servers are the one stack's, for a module
/// in [`crate::train`] or [`crate::session`]).
fn check_way(settings: &TrainConfig) -> Result<()> {
    let (arch, all) = (&settings.topology.arch, &settings.allreduce);
    let way = if *arch != Arch::Allreduce {
        Some(format!(
            "strategy {arch:?} (parameter servers or a pipeline)"
        ))
    } else if all.mode != AllReduceMode::Sync {
        Some("async all-reduce".to_string())
    } else if all.zero > 1 {
        Some(format!("ZeRO stage {}", all.zero))
    } else {
        None
    };
    match way {
        None => Ok(()),
        Some(way) => Err(DistError::Settings(TrainError::config(
            "strategy",
            format!(
                "the Learner strategy trains sync all-reduce with the Learner's own optimizer \
                 (ZeRO-0 or ZeRO-1); {way} is not on it yet: train the module with \
                 flotilla_burn::train or flotilla_burn::session, which run every way"
            ),
        ))),
    }
}

/// burn-train's `Learner` on every rank of a Flotilla job (see the [module](self) docs).
#[derive(Debug)]
pub struct LearnerStrategy {
    group: Arc<dyn ProcessGroup>,
    device: Device,
    bucket_bytes: usize,
    seed: u64,
    zero: u8,
    epochs: Mutex<Vec<EpochHandle>>,
}

impl LearnerStrategy {
    /// A strategy over `group`, training on `device` (an autodiff device).
    pub fn new(group: Arc<dyn ProcessGroup>, device: Device) -> Self {
        Self {
            group,
            device,
            bucket_bytes: flotilla_train::TrainConfig::default().bucket_bytes(),
            seed: 0,
            zero: 0,
            epochs: Mutex::new(Vec::new()),
        }
    }

    /// Joins the job this process was started in ([`crate::init`]: `flotilla launch -n N --
    /// PROGRAM` or torchrun's variables) and trains on the job's device (`model.device`,
    /// `flex` by default; `cuda` or `wgpu` without an index: the local rank's GPU), with
    /// autodiff ([`LearnerStrategy::device`]); the fusion bucket size is the job's
    /// `comm.bucket_mb`, the shuffle's seed its `model.seed`.
    pub fn join() -> Result<Self> {
        let settings = flotilla_train::program::settings()?;
        check_way(&settings)?;
        let group =
            flotilla_train::program::join(&settings, flotilla_train::program::launcher_rank()?)?;
        let settings = flotilla_train::gpu::on_local_gpu(&settings)?;
        let device = flotilla_engine::device_by_name(&settings.model.device)?.autodiff();
        let mut strategy = Self::new(group, device);
        strategy.bucket_bytes = settings.bucket_bytes();
        strategy.seed = settings.model.seed;
        strategy.zero = settings.allreduce.zero;
        Ok(strategy)
    }

    /// The seed of [`LearnerStrategy::shard`]'s shuffle (the same on every rank).
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// The device this rank trains on (an autodiff device): build the model on it.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// ZeRO stage 1 (`1`: the `Learner`'s optimizer steps this rank's share of the parameters
    /// only, [`crate::ParamShards`]) or none (`0`, the default); [`LearnerStrategy::join`]
    /// takes the job's `allreduce.zero`.
    pub fn with_zero(mut self, stage: u8) -> Self {
        self.zero = stage;
        self
    }

    /// The ZeRO stage: 0 or 1.
    pub fn zero(&self) -> u8 {
        self.zero
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.group.rank()
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.group.size()
    }

    /// The job's process group.
    pub fn group(&self) -> &Arc<dyn ProcessGroup> {
        &self.group
    }

    /// This rank's part of a training set: shuffled per epoch (the strategy sets the epoch),
    /// padded so that every rank has as many samples.
    pub fn shard<D, I, E>(&self, dataset: D) -> Result<ShardedDataset<D>>
    where
        D: Dataset<I, E>,
        E: std::error::Error + Send + Sync + 'static,
    {
        let sharded =
            ShardedDataset::new(dataset, self.rank(), self.world_size(), self.seed, false)?;
        self.epochs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(sharded.epoch_handle());
        Ok(sharded)
    }

    /// This rank's part of a validation set, in order and not padded: samples `rank`,
    /// `rank + N`, ... (ranks differ by at most one sample), so that every sample is
    /// evaluated once, by one rank, and the metrics rank 0 shows are those of the whole set.
    pub fn shard_in_order<D>(&self, dataset: D) -> StridedDataset<D> {
        StridedDataset::new(dataset, self.rank(), self.world_size())
    }

    /// This strategy as burn-train's `TrainingStrategy::Custom`, for
    /// `SupervisedTraining::with_training_strategy`.
    pub fn training<M>(self) -> TrainingStrategy<M>
    where
        M: LearnerModel,
        <M as burn::train::TrainStep>::Output: GlobalOutput,
        <M as burn::train::InferenceStep>::Output: GlobalOutput,
    {
        TrainingStrategy::Custom(Arc::new(self))
    }

    /// Orders every dataset [`LearnerStrategy::shard`] made for `epoch` (the strategy does it
    /// before each epoch; a program's own loop over the same loaders calls it).
    pub fn set_epoch(&self, epoch: usize) {
        for handle in self
            .epochs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
        {
            handle.set(epoch as u64);
        }
    }
}
