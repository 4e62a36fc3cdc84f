//! [`LearnerStrategy`]'s own training loop: burn-train's epoch loops (as its single-device
//! strategy runs them), with the gradients averaged over the ranks, each step's outputs
//! gathered for rank 0's metrics, and every decision to stop agreed by all ranks.

use burn::data::dataloader::Progress;
use burn::data::dataset::DatasetError;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::prelude::*;
use burn::train::train::WorkerFailure;
use burn::train::{
    EventProcessorTraining, InferenceStep, Learner, LearnerEvent, LearnerModel,
    SupervisedTrainingEventProcessor, TrainLoader, TrainStep, TrainingComponents, TrainingError,
    TrainingItem, ValidLoader,
};

use std::sync::Arc;

use flotilla_group::ProcessGroup;

use super::LearnerStrategy;
use super::global_output::{GlobalOutput, gather};
use crate::data_parallel::DataParallel;
use crate::error::{DistError, Result};
use crate::param_shards::ParamShards;

/// The `Learner` trained by the strategy's own loop (sync all-reduce, ZeRO-0 or 1); its
/// model and event processor.
pub(super) fn fit<M>(
    strategy: &LearnerStrategy,
    components: TrainingComponents<M>,
    mut learner: Learner<M>,
    (train, valid): (&TrainLoader<M>, &ValidLoader<M>),
    starting_epoch: usize,
) -> (M, SupervisedTrainingEventProcessor<M>)
where
    M: LearnerModel,
    <M as TrainStep>::Output: GlobalOutput,
    <M as InferenceStep>::Output: GlobalOutput,
{
    let Some(group) = strategy.group.clone() else {
        let message = "the strategy has no process group".to_string();
        fail(&components, strategy.rank, message);
        return (learner.model(), components.event_processor);
    };
    let mut fit = Fit::new(strategy, components, Some(group));
    if let Err(e) = fit.run(&mut learner, train, valid, starting_epoch) {
        fail(&fit.c, strategy.rank, e.to_string());
    }
    (learner.model(), fit.c.event_processor)
}

/// Fails the `Learner`'s run with `message`, naming this rank.
pub(super) fn fail<M: LearnerModel>(c: &TrainingComponents<M>, rank: usize, message: String) {
    tracing::error!(target: "flotilla::burn", "rank {rank}: {message}");
    c.interrupter
        .fail(TrainingError::Workers(vec![WorkerFailure {
            device_id: rank,
            message: format!("Flotilla rank {rank}: {message}"),
        }]));
}

/// One optimizer step of the `Learner` with `grads` averaged over the ranks: on every
/// parameter, or (ZeRO-1) on this rank's share, the others then taken from their owners.
fn apply<M: LearnerModel>(
    learner: &mut Learner<M>,
    dp: &mut DataParallel,
    shards: Option<&ParamShards>,
    grads: GradientsParams,
) -> Result<()> {
    let grads = dp.average(grads, &learner.model())?;
    learner.lr_step();
    match shards {
        None => learner.optimizer_step(grads),
        Some(shards) => {
            learner.optimizer_step(shards.own_grads(grads, &learner.model())?);
            let model = shards.gather(learner.model())?;
            learner.load_model(model.into_record());
        }
    }
    Ok(())
}

/// The next batch as the ranks agreed on it.
struct Next<I> {
    /// This rank's batch, if it has one.
    item: Option<I>,
    /// Whether any rank has one (the loop goes on).
    any: bool,
}

/// One `fit`: the strategy, burn's training components, the group the ranks agree over
/// (`None`: this rank decides alone, as a parameter server's ranks do, whose group is the
/// run's), where gathered outputs are built, and which of the `Learner`'s events this rank's
/// event processor sees.
pub(super) struct Fit<'a, M: LearnerModel> {
    pub(super) strategy: &'a LearnerStrategy,
    pub(super) c: TrainingComponents<M>,
    pub(super) group: Option<Arc<dyn ProcessGroup>>,
    pub(super) outputs_on: Device,
    /// Whether this rank shows the training split's events (rank 0 of a group; under
    /// parameter servers the first worker, of its own batches).
    pub(super) shows_train: bool,
    /// Whether this rank validates for the metrics, writes the checkpoints and decides early
    /// stopping (rank 0: a group's, or a parameter server's root).
    pub(super) shows_valid: bool,
}

impl<'a, M> Fit<'a, M>
where
    M: LearnerModel,
    <M as TrainStep>::Output: GlobalOutput,
    <M as InferenceStep>::Output: GlobalOutput,
{
    pub(super) fn new(
        strategy: &'a LearnerStrategy,
        c: TrainingComponents<M>,
        group: Option<Arc<dyn ProcessGroup>>,
    ) -> Self {
        let rank0 = group.as_ref().map_or(strategy.rank, |g| g.rank()) == 0;
        Self {
            strategy,
            c,
            group,
            outputs_on: strategy.device.clone().inner(),
            shows_train: rank0,
            shows_valid: rank0,
        }
    }

    fn world(&self) -> usize {
        self.group.as_ref().map_or(1, |g| g.size())
    }

    /// Every rank's `mine` as one output on rank 0 (`None` elsewhere); without a group,
    /// `mine`.
    pub(super) fn global_output<O: GlobalOutput>(&self, mine: Option<O>) -> Result<Option<O>> {
        match &self.group {
            Some(group) => gather(group.as_ref(), mine, &self.outputs_on),
            None => Ok(mine),
        }
    }

    /// Sums `flags` over the ranks (without a group: this rank's).
    fn sum(&self, flags: &mut [f32]) -> Result<()> {
        if let Some(group) = &self.group {
            group.all_reduce_sum(flags)?;
        }
        Ok(())
    }

    fn run(
        &mut self,
        learner: &mut Learner<M>,
        train: &TrainLoader<M>,
        valid: &ValidLoader<M>,
        starting_epoch: usize,
    ) -> Result<()> {
        let group = self.group.clone().ok_or(DistError::Loaders(
            "the Learner's own loop needs the job's group".into(),
        ))?;
        let bucket_bytes = self.strategy.bucket_bytes;
        let mut dp = DataParallel::with_bucket_bytes(group, &learner.model(), bucket_bytes)?;
        // Rank 0's parameters (and buffers), ids numbered by position on every rank.
        let model = dp.broadcast_model(learner.model())?;
        learner.load_model(model.into_record());
        let shards = (self.strategy.zero == 1).then(|| ParamShards::new(&dp));
        if shards.is_some() && starting_epoch > 1 {
            return Err(DistError::Optimizer(
                "resuming under ZeRO-1: the Learner's checkpoint holds rank 0's share of the \
                 optimizer state only (burn-train 0.22.1's checkpointer writes one \
                 optimizer file, of the rank that checkpoints); resume without ZeRO"
                    .into(),
            ));
        }
        for epoch in starting_epoch..=self.c.num_epochs {
            self.strategy.set_epoch(epoch);
            let total_items = train.num_items() * self.world();
            self.train_event(LearnerEvent::StartSplit {
                epoch_number: epoch,
                total_items,
            });
            self.train_epoch(learner, (&mut dp, shards.as_ref()), train)?;
            self.train_event(LearnerEvent::EndSplit(epoch));
            if self.agree_stop(false)? {
                break;
            }
            if self.end_epoch(learner, valid, epoch)? {
                break;
            }
        }
        Ok(())
    }

    /// The end of a training epoch: validation, the epoch's events, rank 0's checkpoint and
    /// early stopping; whether to stop (agreed).
    pub(super) fn end_epoch(
        &mut self,
        learner: &Learner<M>,
        valid: &ValidLoader<M>,
        epoch: usize,
    ) -> Result<bool> {
        self.valid_epoch(learner, valid, epoch)?;
        self.train_event(LearnerEvent::EndEpoch(epoch));
        if self.shows_valid && (self.c.checkpointer.is_some() || self.c.early_stopping.is_some()) {
            let flushed = self.c.event_processor.flush();
            self.c.interrupter.fail_on_error(flushed);
        }
        if self.agree_stop(false)? {
            return Ok(true);
        }
        self.end_of_epoch(learner, epoch)
    }

    /// Rank 0's checkpoint and early-stopping decision, agreed: whether to stop.
    fn end_of_epoch(&mut self, learner: &Learner<M>, epoch: usize) -> Result<bool> {
        let mut early = false;
        if self.shows_valid {
            if let Some(checkpointer) = &mut self.c.checkpointer {
                checkpointer.checkpoint(learner, epoch, &self.c.event_store);
            }
            if let Some(early_stopping) = &mut self.c.early_stopping {
                early = early_stopping.should_stop(epoch, &self.c.event_store);
            }
        }
        self.agree_stop(early)
    }

    fn train_epoch(
        &mut self,
        learner: &mut Learner<M>,
        (dp, shards): (&mut DataParallel, Option<&ParamShards>),
        loader: &TrainLoader<M>,
    ) -> Result<()> {
        let mut iterator = loader.iter();
        let mut accumulator = GradientsAccumulator::new();
        let (mut iteration, mut accumulated) = (0, 0);
        loop {
            let next = self.agree_next(iterator.next(), true)?;
            let Some(item) = next.item else { break };
            iteration += 1;
            let progress = iterator.progress();
            let out = learner.train_step(item);
            let grads = match self.c.grad_accumulation {
                Some(k) => {
                    accumulator.accumulate(&learner.model(), out.grads);
                    accumulated += 1;
                    let due = accumulated >= k || progress.is_completed();
                    due.then(|| {
                        accumulated = 0;
                        accumulator.grads()
                    })
                }
                None => Some(out.grads),
            };
            if let Some(grads) = grads {
                apply(learner, dp, shards, grads)?;
            }
            if let Some(item) = self.global_output(Some(out.item))? {
                let progress = self.global(progress);
                let lr = Some(learner.lr_current());
                let item = TrainingItem::new(item, progress, Some(iteration), lr);
                self.train_event(LearnerEvent::ProcessedItem(item));
            }
        }
        Ok(())
    }

    fn valid_epoch(
        &mut self,
        learner: &Learner<M>,
        loader: &ValidLoader<M>,
        epoch: usize,
    ) -> Result<()> {
        let mine = loader.num_items() as f32;
        let mut total = [mine];
        self.sum(&mut total)?;
        self.valid_event(LearnerEvent::StartSplit {
            epoch_number: epoch,
            total_items: total[0] as usize,
        });
        let model = learner.model().valid();
        let mut iterator = loader.iter();
        let (mut iteration, mut done) = (0, false);
        loop {
            let item = if done { None } else { iterator.next() };
            done = item.is_none();
            let next = self.agree_next(item, false)?;
            if !next.any {
                break;
            }
            iteration += 1;
            let out = next.item.map(|item| InferenceStep::step(&model, item));
            if let Some(item) = self.global_output(out)? {
                let progress = self.global(iterator.progress());
                let item = TrainingItem::new(item, progress, Some(iteration), None);
                self.valid_event(LearnerEvent::ProcessedItem(item));
            }
        }
        self.valid_event(LearnerEvent::EndSplit(epoch));
        Ok(())
    }

    /// This rank's next batch, agreed with the other ranks: none when any rank's loader failed
    /// or any rank's interrupter stopped (then this rank's stops too); with `every_rank`, a
    /// rank without a batch while another has one is an error (a training step needs all).
    fn agree_next<I>(
        &mut self,
        item: Option<std::result::Result<I, DatasetError>>,
        every_rank: bool,
    ) -> Result<Next<I>> {
        let (item, failed) = match item {
            Some(Ok(item)) => (Some(item), None),
            Some(Err(e)) => (None, Some(e)),
            None => (None, None),
        };
        let stopping = self.c.interrupter.should_stop() || failed.is_some();
        let mut flags = [
            f32::from(u8::from(item.is_some())),
            f32::from(u8::from(stopping)),
        ];
        self.sum(&mut flags)?;
        if let Some(e) = failed {
            self.c.interrupter.fail(TrainingError::Dataset(e));
        }
        if flags[1] > 0.0 {
            self.stop_with_the_others();
            return Ok(Next {
                item: None,
                any: false,
            });
        }
        let (with, world) = (flags[0] as usize, self.world());
        if every_rank && with > 0 && with < world {
            return Err(DistError::Loaders(format!(
                "{with} of {world} ranks have another training batch (rank {} {}): every rank \
                 needs as many per epoch (LearnerStrategy::shard gives each as many samples)",
                self.strategy.rank,
                if item.is_some() {
                    "has one"
                } else {
                    "has none"
                },
            )));
        }
        Ok(Next {
            item,
            any: with > 0,
        })
    }

    /// Whether any rank stops: its interrupter stopped (then every rank's interrupter says
    /// so), or, `early`, rank 0's early stopping said to (every rank just ends, as burn's
    /// loop does).
    pub(super) fn agree_stop(&mut self, early: bool) -> Result<bool> {
        let interrupted = self.c.interrupter.should_stop();
        let mut flags = [f32::from(u8::from(interrupted)), f32::from(u8::from(early))];
        self.sum(&mut flags)?;
        if flags[0] > 0.0 {
            self.stop_with_the_others();
        }
        Ok(flags[0] > 0.0 || flags[1] > 0.0)
    }

    fn stop_with_the_others(&self) {
        if !self.c.interrupter.should_stop() {
            self.c
                .interrupter
                .stop(Some("another rank of the Flotilla job stopped"));
        }
    }

    /// A rank's loader progress as the global batch's (every rank as far).
    fn global(&self, p: Progress) -> Progress {
        let world = self.world();
        Progress {
            items_processed: p.items_processed * world,
            items_total: p.items_total * world,
            unit: p.unit,
        }
    }

    /// A training event to this rank's event processor, if it shows them; an epoch's end also
    /// to the rank that validates (its processor counts epochs by it).
    pub(super) fn train_event(&mut self, event: LearnerEvent<<M as TrainStep>::Output>) {
        let shown = match event {
            LearnerEvent::EndEpoch(_) => self.shows_train || self.shows_valid,
            _ => self.shows_train,
        };
        if shown {
            let done = self.c.event_processor.process_train(event);
            self.c.interrupter.fail_on_error(done);
        }
    }

    fn valid_event(&mut self, event: LearnerEvent<<M as InferenceStep>::Output>) {
        if self.shows_valid {
            let done = self.c.event_processor.process_valid(event);
            self.c.interrupter.fail_on_error(done);
        }
    }
}
