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
//! // This rank's part of the training set, at the job's batch size:
//! // let train_loader = flotilla.train_loader(train_dataset, batcher)?;
//! let valid = flotilla.shard_in_order(InMemDataset::new(vec![1u8, 2, 3, 4]));
//! // ... DataLoaderBuilder::new(batcher).build(valid),
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
//! Async all-reduce (`strategy: async_allreduce`, `flotilla launch --strategy
//! async_allreduce`) is the one stack's, not a second implementation: the `Learner` is the
//! run's engine (its `train_step` and its optimizer, `engine.rs`), the run's data are the
//! training set's sample indices (`source.rs`: sharded, reshuffled and cut into batches as a
//! job's data, which the user's batcher turns into the `Learner`'s input: the training loader
//! must be [`LearnerStrategy::train_loader`]'s), and the run's cycle reduces the gradients
//! (`stack.rs`); at staleness 0 it ends on the bits of the sync loop. The run joins the job
//! when the `Learner` starts and writes its own report (`run.log`, `summary.json`) under the
//! job's `telemetry.output`; it drops a last partial batch where the sync loop's loader pads.
//!
//! Parameter servers (`strategy: flat` or `hierarchical`, sync or async, sharded, and model
//! averaging with `topology.local_steps > 1`) go through the same run (`rounds.rs`): every
//! rank runs the same program and the `Learner`; a worker's steps are its `train_step` (and,
//! averaging, its optimizer), a server applies the mean update with its `Learner`'s optimizer
//! and scheduler. The ranks' group carries the servers' messages, so nothing is agreed over
//! it: rank 0, the root server, validates the whole model on the whole validation set
//! ([`LearnerStrategy::shard_in_order`] gives it every sample), writes the checkpoints and
//! decides early stopping (its stop reaches every rank through the servers); the first
//! worker's event processor shows the training metrics of its own batches. A flat sync
//! server ends on the bits of sync all-reduce; several shard servers start from the root's
//! initial parameters (the ranks' own models may have drawn other values).
//!
//! In an elastic job of sync or async all-reduce peers (`flotilla launch -n MIN:MAX
//! --max-restarts K -- PROGRAM`) the run's generations carry the `Learner` (`elastic.rs`): a
//! lost member's step (async: its steps in flight) is redone among the others, a joiner
//! receives the parameters and the `Learner`'s optimizer and scheduler state from a member
//! over the wire (`state.rs`) and trains on in the epoch the members stand in; the generation's
//! rank 0 shows its own batches' metrics, validates the whole validation set, writes the
//! checkpoints and decides early stopping; every member stops where the run's vote agrees.
//! With ZeRO-1 there the run cuts the `Learner`'s optimizer state among the members by whole
//! parameter (`flotilla_train`'s ZeRO by parameter, through [`flotilla_engine::Engine::apply_grads_to`]):
//! each part on its owner and the member before it, re-cut at each new generation.
//!
//! Resume through the run (async all-reduce, parameter servers) starts the run's batches and
//! count after the checkpoint's epoch ([`flotilla_train::job_data::JobData::start_epoch`]):
//! the same bits as a run without a stop under a parameter server, not under async
//! all-reduce (the stale gradients in flight and the last update, which weight prediction
//! extrapolates, are not in the `Learner`'s checkpoint: it starts afresh). The `Learner`'s
//! checkpoint holds rank 0's optimizer state (burn-train 0.22.1's checkpointer writes one
//! optimizer file, of the rank that checkpoints), so ZeRO-1, model averaging (each worker's
//! own) and shard servers (each its own shard's) do not resume: refused, said so. Pipelines
//! are refused by name (a middle stage has no batches).
//!
//! Rank 0 shows the metrics, of the global batch: each step's outputs ([`GlobalOutput`]) are
//! gathered and rank 0's event processor sees one output of every rank's samples; the other
//! ranks process no events. Rank 0 writes the `Learner`'s checkpoints (its own format and
//! directory), decides early stopping, and every rank stops together when any rank's
//! interrupter stops. Resume is the `Learner`'s: per epoch (`.checkpoint(epoch)`), every rank
//! reading rank 0's files (a directory every rank sees); the one stack's exact mid-epoch
//! resume is the [`crate::session`] API's.
//!
//! The training data: [`LearnerStrategy::train_loader`] (or [`LearnerStrategy::shard`] under
//! a loader of the program's own) cuts a burn `Dataset` by rank
//! ([`ShardedDataset`]: PyTorch's `DistributedSampler`, reshuffled per epoch with the same
//! seed on every rank, the last samples repeated so that every rank has as many), and the
//! strategy sets its epoch before each epoch. Every rank must give as many training batches
//! per epoch (a shard of the same length and batch size does); validation batches may differ.
//!
//! burn's own `ExecutionStrategy::DistributedDataParallel` trains on the devices of one
//! process; this strategy trains one device per Flotilla rank (a process, on any machine):
//! start one rank per device (`flotilla launch -n N`), each with its own device.

mod elastic;
mod engine;
mod fit;
pub mod global_output;
mod rounds;
mod source;
mod stack;
mod state;
mod supervised;
mod way;

use std::any::Any;
use std::sync::{Arc, Mutex, PoisonError};

use burn::data::dataset::Dataset;
use burn::prelude::*;
use burn::train::{LearnerModel, TrainingStrategy};
use flotilla_group::ProcessGroup;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use flotilla_train::TrainConfig;

use crate::error::{DistError, Result};
use crate::sharded_dataset::{EpochHandle, ShardedDataset, StridedDataset};
use engine::BatchMaker;
use source::TrainData;

pub use global_output::{GlobalOutput, Piece};

/// What a rank of a parameter-server job shows of the `Learner`'s run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PsPart {
    /// The root server: it validates the whole model (the whole validation set), writes the
    /// checkpoints and decides early stopping.
    root: bool,
    /// The first worker: its event processor shows the training metrics of its own batches.
    first_worker: bool,
}

impl PsPart {
    /// Rank `rank`'s part in the job of `settings`; `None` for an all-reduce job.
    fn of(settings: &TrainConfig, rank: usize) -> Result<Option<Self>> {
        if settings.topology.arch == flotilla_cluster::Arch::Allreduce {
            return Ok(None);
        }
        let topology = settings.topology().map_err(DistError::from)?;
        let first_worker = topology.workers().next().map(|r| r.rank);
        Ok(Some(Self {
            root: rank == topology.root(),
            first_worker: first_worker == Some(rank),
        }))
    }
}

/// Whether the job of `settings` is an elastic job of generations (of peers: an elastic
/// server's workers are fixed ranks that rejoin).
pub(super) fn elastic(settings: &TrainConfig) -> bool {
    settings.elasticity() == Some(flotilla_train::config::Elasticity::Generations)
}

/// burn-train's `Learner` on every rank of a Flotilla job (see the [module](self) docs).
pub struct LearnerStrategy {
    /// The job's group; `None` when the one stack's run joins (and holds) it.
    group: Option<Arc<dyn ProcessGroup>>,
    rank: usize,
    world: usize,
    device: Device,
    bucket_bytes: usize,
    seed: u64,
    zero: u8,
    /// The job's settings, for a run of the one stack ([`LearnerStrategy::join`]'s).
    settings: TrainConfig,
    /// The rank the launcher gave (`None`: assigned at the rendezvous).
    launcher_rank: Option<usize>,
    /// Whether the one stack's run trains (async all-reduce, parameter servers), not the
    /// strategy's own loop.
    through_run: bool,
    /// This rank's part in a parameter-server job (`None`: an all-reduce job).
    ps: Option<PsPart>,
    epochs: Mutex<Vec<EpochHandle>>,
    /// The training set and batcher [`LearnerStrategy::train_loader`] registered (a
    /// [`TrainData`] of the `Learner`'s input type).
    train_data: Mutex<Option<Box<dyn Any + Send + Sync>>>,
}

impl std::fmt::Debug for LearnerStrategy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LearnerStrategy")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("device", &self.device)
            .field("zero", &self.zero)
            .field("through_run", &self.through_run)
            .finish_non_exhaustive()
    }
}

impl LearnerStrategy {
    /// A strategy over `group`, training on `device` (an autodiff device), sync all-reduce.
    pub fn new(group: Arc<dyn ProcessGroup>, device: Device) -> Self {
        let (rank, world) = (group.rank(), group.size());
        Self::of(Some(group), (rank, world), device)
    }

    fn of(
        group: Option<Arc<dyn ProcessGroup>>,
        (rank, world): (usize, usize),
        device: Device,
    ) -> Self {
        let settings = TrainConfig::default();
        Self {
            rank,
            world,
            group,
            device,
            bucket_bytes: settings.bucket_bytes(),
            seed: 0,
            zero: 0,
            launcher_rank: None,
            through_run: false,
            ps: None,
            settings,
            epochs: Mutex::new(Vec::new()),
            train_data: Mutex::new(None),
        }
    }

    /// Joins the job this process was started in ([`crate::init`]: `flotilla launch -n N --
    /// PROGRAM` or torchrun's variables) and trains on the job's device (`model.device`,
    /// `flex` by default; `cuda` or `wgpu` without an index: the local rank's GPU), with
    /// autodiff ([`LearnerStrategy::device`]), the job's way of training (sync all-reduce,
    /// ZeRO-1, async all-reduce, parameter servers), fusion bucket size (`comm.bucket_mb`)
    /// and seed (`model.seed`, the shuffle's). Under async all-reduce and parameter servers
    /// the one stack's run joins the job when the `Learner` starts; the rank is then the
    /// launcher's (`RANK`).
    pub fn join() -> Result<Self> {
        let settings = flotilla_train::program::settings()?;
        let through_run = way::through_run(&settings)?;
        let launcher_rank = flotilla_train::program::launcher_rank()?;
        let local = flotilla_train::gpu::on_local_gpu(&settings)?;
        let device = flotilla_engine::device_by_name(&local.model.device)?.autodiff();
        let mut strategy = if through_run {
            let world = settings.effective_world_size()?;
            // An elastic job's ranks are its generations' (the run learns them).
            let rank = launcher_rank.or(elastic(&settings).then_some(0));
            let rank = rank.ok_or_else(|| {
                DistError::Loaders(
                    "a Learner under async all-reduce or parameter servers takes its rank \
                     from the launcher (RANK): start it with flotilla launch or torchrun"
                        .into(),
                )
            })?;
            let mut strategy = Self::of(None, (rank, world), device);
            strategy.ps = PsPart::of(&settings, rank)?;
            strategy
        } else {
            Self::new(
                flotilla_train::program::join(&settings, launcher_rank)?,
                device,
            )
        };
        strategy.bucket_bytes = settings.bucket_bytes();
        strategy.seed = settings.model.seed;
        strategy.zero = settings.allreduce.zero;
        strategy.launcher_rank = launcher_rank;
        strategy.through_run = through_run;
        strategy.settings = settings;
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
        self.rank
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// The job's process group; `None` under async all-reduce and parameter servers, where
    /// the one stack's run joins the job when the `Learner` starts.
    pub fn group(&self) -> Option<&Arc<dyn ProcessGroup>> {
        self.group.as_ref()
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

    /// The training loader of `dataset` and `batcher` at the job's batch size (`batch_size`,
    /// per rank) on this rank's device: over this rank's part ([`LearnerStrategy::shard`]).
    /// Under async all-reduce and parameter servers the one stack's run draws the batches
    /// (sample indices, sharded and reshuffled as a job's data) and the `Learner`'s input is
    /// made of them by the same batcher: a training loader the program builds itself is
    /// refused there.
    pub fn train_loader<D, B, I, O>(&self, dataset: D, batcher: B) -> Result<Arc<dyn DataLoader<O>>>
    where
        D: Dataset<I> + 'static,
        B: Batcher<I, O> + Clone + 'static,
        I: Send + Sync + Clone + std::fmt::Debug + 'static,
        O: Send + Clone + std::fmt::Debug + 'static,
    {
        let dataset = Arc::new(dataset);
        let (items, batch) = (dataset.clone(), batcher.clone());
        let make: BatchMaker<O> = Arc::new(move |indices: &[usize], device: &Device| {
            let got: std::result::Result<Vec<I>, _> =
                indices.iter().map(|&i| items.get(i)).collect();
            got.map(|items| batch.batch(items, device))
                .map_err(|e| e.to_string())
        });
        let data = TrainData {
            make,
            len: dataset.len(),
        };
        *self
            .train_data
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(Box::new(data));
        let batch_size = self.settings.data.batch_size;
        Ok(DataLoaderBuilder::new(batcher)
            .batch_size(batch_size)
            .num_workers(1)
            .set_device(self.device.clone())
            .build(self.shard(dataset)?))
    }

    /// What [`LearnerStrategy::train_loader`] registered, for a `Learner` of input `I`.
    fn train_data<I: 'static>(&self) -> Result<TrainData<I>> {
        let held = self
            .train_data
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match held.as_ref().and_then(|d| d.downcast_ref::<TrainData<I>>()) {
            Some(d) => Ok(d.clone()),
            None => Err(DistError::Loaders(
                "under async all-reduce and parameter servers the run draws the Learner's \
                 batches: build the \
                 training loader with LearnerStrategy::train_loader(dataset, batcher)"
                    .into(),
            )),
        }
    }

    /// This rank's part of a validation set, in order and not padded: samples `rank`,
    /// `rank + N`, ... (ranks differ by at most one sample), so that every sample is
    /// evaluated once, by one rank, and the metrics rank 0 shows are those of the whole set.
    /// Under parameter servers the root server validates the whole set (the model is
    /// there), and the other ranks' parts are empty; in an elastic job every process holds
    /// the whole set, and the rank 0 of the generation under way validates it.
    pub fn shard_in_order<D>(&self, dataset: D) -> StridedDataset<D> {
        if elastic(&self.settings) {
            return StridedDataset::new(dataset, 0, 1);
        }
        match self.ps {
            Some(PsPart { root: true, .. }) => StridedDataset::new(dataset, 0, 1),
            Some(_) => StridedDataset::none_of(dataset),
            None => StridedDataset::new(dataset, self.rank(), self.world_size()),
        }
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

    /// Orders every dataset [`LearnerStrategy::shard`] made for the `Learner`'s epoch `epoch`
    /// (1-based, as burn counts them): the sampler's epoch `epoch − 1`, the order the one
    /// stack's run gives its 0-based epoch of the same number (the strategy sets it before each
    /// epoch; a program's own loop over the same loaders calls it).
    pub fn set_epoch(&self, epoch: usize) {
        for handle in self
            .epochs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
        {
            handle.set(epoch.saturating_sub(1) as u64);
        }
    }
}
