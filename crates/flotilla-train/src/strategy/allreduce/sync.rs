//! Synchronous data parallel training over a ring all-reduce, with fusion buckets.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use flotilla_engine::collective::Reducer;
use flotilla_engine::{BatchRef, Engine, EvalStats, ModelState, ParamLayout};
use flotilla_tcp::{PendingAllReduce, ProcessGroup, StallPolicy};

use super::zero::by_param::ParamZero;
use super::zero::initial::InitialShard;
use super::zero::{Zero, wire_len};
use crate::batches::Batches;
use crate::bucket::BucketPlan;
use crate::checkpoint::{self, CheckpointState};
use crate::config::TrainConfig;
use crate::error::{Result, TrainError};
use crate::plan::Counting;
use crate::strategy::accumulate::MicroBatches;
use crate::strategy::{Cx, Evaluation, Resume, Setup, Step, Strategy};
use flotilla_engine::ShardSink;

/// What one step produced.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepStats {
    /// This rank's mean loss on its batch.
    pub local_loss: f32,
    /// The mean loss over every rank's batch (the global batch).
    pub global_loss: f32,
}

/// Sync data parallel: every rank computes gradients on its own batch, the gradients are
/// summed by ring all-reduces, one per bucket ([`BucketPlan`]: the engine's backward groups,
/// last layers first), averaged, and every rank applies the same optimizer step.
///
/// With `overlap`, backward runs group by group ([`Engine::forward_backward_streaming`]) and
/// a bucket's all-reduce starts as soon as its group's gradients exist, while backward of
/// the earlier layers goes on (PyTorch DDP's reducer). Without, one backward pass finishes
/// first and the buckets start as they are copied out. Both reduce the same buffers, so the
/// results are bitwise equal.
///
/// The mean loss rides along as one extra value at the end of the last bucket to become
/// ready (it is started when the engine returns the loss), so logging the global loss costs
/// no extra collective.
///
/// With `allreduce.zero: 1` or `2` the optimizer step is sharded (`Zero`): each rank
/// steps its shard of every bucket with 1/N of the optimizer state and the parameters are
/// all-gathered; stage 2 reduce-scatters the buckets instead of all-reducing them; stage 3
/// keeps only the shard of the parameters too, gathered group by group in each pass
/// (`zero/stage3.rs`).
pub struct SyncAllReduce {
    comm: Arc<dyn ProcessGroup>,
    /// The whole model.
    engine: Box<dyn Engine>,
    layout: ParamLayout,
    plan: BucketPlan,
    overlap: bool,
    /// One reusable buffer per bucket; the last one has a slot more for the loss.
    buffers: Vec<Vec<f32>>,
    /// The averaged flat gradient handed to the optimizer (zero 0; empty with ZeRO, whose
    /// ranks keep only their shard's).
    flat: Vec<f32>,
    /// The sharded optimizer step of ZeRO stages 1 and 2 (`None`: zero 0, or by parameter).
    zero: Option<Zero>,
    /// ZeRO stage 1 by whole parameter, for an engine with an optimizer of its own.
    by_param: Option<ParamZero>,
    /// A step's micro-batches (`allreduce.accumulation_steps`): summed before the last, or
    /// each reduced (`allreduce.reduce_each_micro_batch`).
    accumulator: MicroBatches,
    /// Clip the averaged gradient to this global norm (`allreduce.clip_grad_norm`).
    clip_grad_norm: Option<f64>,
}

impl SyncAllReduce {
    /// This rank's peer of the configured sync all-reduce: the whole model, its backward
    /// run in groups of about `comm.bucket_mb` (one bucket each, so that buckets start as
    /// groups finish), overlapping communication when `allreduce.overlap`.
    pub fn build(cx: &mut Cx<'_>, setup: &Setup<'_>) -> Result<Self> {
        let config = cx.config;
        let (mut engine, initial) = whole_or_released(cx, setup)?;
        engine.set_backward_group_bytes(config.bucket_bytes())?;
        if config.allreduce.sync_batch_norm {
            sync_batch_norm(&mut *engine, cx.comm)?;
        }
        let layout = engine.layout().clone();
        let plan = BucketPlan::from_groups(&layout, &engine.backward_groups())?;
        // On one rank there is nothing to shard: ZeRO is the unsharded path (same bits,
        // no second copy of the parameters nor gather buffers).
        let stage = if cx.comm.size() > 1 {
            config.allreduce.zero
        } else {
            0
        };
        let own = stage > 0 && engine.steps_own_optimizer();
        if own && stage > 1 {
            return Err(TrainError::config(
                "allreduce.zero",
                format!(
                    "a model stepped by an optimizer of its own (burn's Learner's) has its \
                     optimizer state sharded by whole parameter: ZeRO stage 1, not {stage}"
                ),
            ));
        }
        if own && config.allreduce.offload.is_some() {
            return Err(TrainError::config(
                "allreduce.offload",
                "a model stepped by an optimizer of its own (burn's Learner's) keeps its \
                 optimizer state in memory: drop the offload"
                    .to_string(),
            ));
        }
        let elastic = config.topology.min_world_size.is_some();
        let by_param = own.then(|| ParamZero::new(cx.comm.clone(), &layout, elastic));
        let zero = (stage > 0 && !own)
            .then(|| {
                let device = &config.model.device;
                let mut zero = Zero::new(
                    stage,
                    cx.comm.clone(),
                    &plan,
                    &layout,
                    &config.optimizer,
                    device,
                )?;
                zero.set_prefetch(config.allreduce.prefetch);
                if let Some(base) = &config.allreduce.offload {
                    zero.offload_optimizer(base)?;
                }
                if elastic {
                    zero.make_elastic(&config.optimizer, device);
                }
                if let Some(initial) = initial {
                    zero.keep_initial_shard(initial)?;
                }
                Ok::<_, TrainError>(zero)
            })
            .transpose()?;
        Ok(Self {
            flat: vec![0.0; if zero.is_some() { 0 } else { layout.total }],
            zero,
            by_param,
            comm: cx.comm.clone(),
            engine,
            layout,
            plan,
            overlap: config.allreduce.overlap,
            buffers: Vec::new(),
            accumulator: MicroBatches::new(config.allreduce.accumulation_steps as usize)
                .reducing_each(config.allreduce.reduce_each_micro_batch),
            clip_grad_norm: config.allreduce.clip_grad_norm,
        })
    }

    /// The bucket plan in use.
    pub fn plan(&self) -> &BucketPlan {
        &self.plan
    }

    /// The ZeRO part (tests).
    #[cfg(test)]
    pub(super) fn zero_mut(&mut self) -> Option<&mut Zero> {
        self.zero.as_mut()
    }
}

/// The peer's engine: whole, or under ZeRO stage 3 on more than one rank ZeRO-3's
/// ([`ModelSource::grouped_engine`]): released from the start, its shard of the initial
/// parameters kept as they are drawn ([`InitialShard`]; a resume loads the checkpoint's shard
/// in its place). A model that cannot be
/// sharded (a user's module without its blocks) is refused under stage 3.
fn whole_or_released(
    cx: &Cx<'_>,
    setup: &Setup<'_>,
) -> Result<(Box<dyn Engine>, Option<InitialShard>)> {
    let config = cx.config;
    let m = &config.model;
    if config.allreduce.zero != 3 || cx.comm.size() < 2 {
        return Ok((setup.engine(config, &config.optimizer)?, None));
    }
    let refused = || {
        TrainError::config(
            "allreduce.zero",
            format!(
                "ZeRO stage 3 runs a program's own module ({}) as its blocks, one gathered at \
                 a time: give them as its stage modules (flotilla_burn::UserModule::with_stages), \
                 or use zero 2 or less",
                setup.model.name()
            ),
        )
    };
    // Released from the start, fresh or resumed (a resume replaces the drawn shard with the
    // checkpoint's, `zero/shard_load.rs`).
    let mut initial = InitialShard::new(cx.comm.size(), cx.comm.rank());
    let mut engine = setup
        .model
        .grouped_engine(
            &config.optimizer,
            (&m.device, m.seed),
            config.bucket_bytes(),
            Some(&mut initial as &mut dyn ShardSink),
        )
        .ok_or_else(refused)??;
    engine.set_reshard_after_forward(config.allreduce.reshard_after_forward)?;
    Ok((engine, Some(initial)))
}

/// Makes `engine`'s batch norms take the statistics of every rank's batch, summed over a group
/// of their own (split from `comm`, so that they never wait behind a gradient bucket).
fn sync_batch_norm(engine: &mut dyn Engine, comm: &Arc<dyn ProcessGroup>) -> Result<()> {
    if engine.buffer_layout().total == 0 {
        return Err(TrainError::config(
            "allreduce.sync_batch_norm",
            "the model has no batch_norm layer to synchronize",
        ));
    }
    let group = comm.split(Some(0), 0)?.ok_or_else(|| {
        TrainError::config("allreduce.sync_batch_norm", "no group for the statistics")
    })?;
    engine.set_batch_norm_sync(Some(Arc::new(GroupReducer(group))))?;
    Ok(())
}

/// The engine's [`Reducer`] over a process group.
struct GroupReducer(Arc<dyn ProcessGroup>);

impl Reducer for GroupReducer {
    fn all_reduce_sum(&self, values: &mut [f32]) -> std::result::Result<(), String> {
        self.0.all_reduce_sum(values).map_err(|e| e.to_string())
    }

    fn world(&self) -> usize {
        self.0.size()
    }
}

impl Strategy for SyncAllReduce {
    fn name(&self) -> &'static str {
        "peer"
    }

    fn evaluation(&self) -> Evaluation {
        Evaluation::Collective
    }

    fn counting(&self) -> Counting {
        Counting::Epochs {
            shards: self.comm.size(),
            index: self.comm.rank(),
        }
    }

    fn describe(&self, config: &TrainConfig) -> Option<(String, String)> {
        let kept = self.zero.as_ref().is_some_and(Zero::shards_params)
            && !config.allreduce.reshard_after_forward;
        Some((
            format!("{} params", self.layout.total),
            format!(
                "{} buckets, strategy sync-allreduce{}{}{}",
                self.plan.buckets.len(),
                if self.overlap {
                    " (backward overlapped)"
                } else {
                    ""
                },
                match (config.allreduce.zero, &self.zero) {
                    (0, _) => String::new(),
                    (_, None) if self.by_param.is_some() => {
                        ", ZeRO stage 1 by whole parameter (the model's own optimizer)".into()
                    }
                    (z, Some(zero)) => match zero.offloaded_to() {
                        Some(dir) => format!(
                            ", ZeRO stage {z}, optimizer state in files under {}",
                            dir.display()
                        ),
                        None => format!(", ZeRO stage {z}"),
                    },
                    (z, None) => format!(", ZeRO stage {z} (one rank: nothing to shard)"),
                },
                if kept {
                    ", each block's parameters kept gathered from its forward to its backward"
                } else {
                    ""
                }
            ),
        ))
    }

    fn stall_policy(&self, config: &TrainConfig) -> Option<StallPolicy> {
        Some(config.allreduce.stall_policy())
    }

    fn writes_checkpoints(&self) -> bool {
        self.comm.rank() == 0
    }

    fn stops_itself(&self) -> bool {
        true
    }

    /// Rank 0's parameters and buffers to every rank; in an elastic ZeRO job, the optimizer
    /// state re-cut among the members (`zero/elastic.rs`; by parameter, `zero/by_param.rs`,
    /// also at a job's first start).
    fn start(&mut self, cx: &mut Cx<'_>) -> Result<()> {
        if let Some(by_param) = &mut self.by_param {
            super::synchronize_model(&*self.comm, &mut *self.engine)?;
            if let Some((from, step)) = by_param.recut(&mut *self.engine)? {
                cx.log(&format!(
                    "ZeRO: the optimizer state of step {step} re-cut by parameter from {from} to \
                     {} part(s)",
                    self.comm.size()
                ))?;
            }
            return Ok(());
        }
        if let Some(zero) = self.zero.as_ref().filter(|z| z.started_released()) {
            // Every rank drew the same model from the seed, one layer at a time.
            return zero.check_initial();
        }
        super::synchronize_initial_state(&*self.comm, &mut *self.engine)?;
        let Some(zero) = &mut self.zero else {
            return Ok(());
        };
        if let Some((from, step)) = zero.recut(&self.plan, &self.layout)? {
            cx.log(&format!(
                "ZeRO: the optimizer state of step {step} re-cut from {from} to {} shard(s), \
                 each held by two ranks",
                self.comm.size()
            ))?;
        }
        Ok(())
    }

    fn regroup(&mut self, cx: &mut Cx<'_>) -> Result<()> {
        if let Some(zero) = &mut self.zero {
            zero.regroup(cx.comm.clone());
        }
        if let Some(by_param) = &mut self.by_param {
            by_param.regroup(cx.comm.clone());
        }
        self.comm = cx.comm.clone();
        if cx.config.allreduce.sync_batch_norm {
            sync_batch_norm(&mut *self.engine, cx.comm)?;
        }
        // Buffers a failed step left with the old group's collectives.
        self.buffers.clear();
        Ok(())
    }

    /// `optimizer_state_bytes`: the optimizer state this rank holds (1/N of it with ZeRO);
    /// `gradient_bytes`: the averaged gradient it keeps for its optimizer step (the whole
    /// model's, or with ZeRO its shard's); `bucket_buffer_bytes`: its wire buffers (every
    /// bucket's when buckets are all-reduced, plus ZeRO's all-gather buffer; one bucket's
    /// with stage 2). Both measured from the buffers held.
    fn figures(&self, cx: &Cx<'_>) -> Vec<(&'static str, f64)> {
        let _ = cx;
        let bytes = match &self.zero {
            Some(zero) => zero.state_bytes(),
            None => self
                .engine
                .optimizer_state()
                .map_err(TrainError::from)
                .and_then(|s| Ok(flotilla_engine::optimizer_state_bytes(&s)?)),
        };
        let f32s = |n: usize| (n * std::mem::size_of::<f32>()) as f64;
        let buckets: usize = self.buffers.iter().map(Vec::capacity).sum();
        let (gradient, wire) = match &self.zero {
            Some(zero) => (
                zero.gradient_bytes() as f64,
                f32s(buckets) + zero.staging_bytes() as f64,
            ),
            None => (f32s(self.flat.capacity()), f32s(buckets)),
        };
        let mut figures = vec![("gradient_bytes", gradient), ("bucket_buffer_bytes", wire)];
        match bytes {
            Ok(b) => figures.push(("optimizer_state_bytes", b as f64)),
            Err(e) => tracing::warn!("optimizer_state_bytes: {e}"),
        }
        if let Some(zero) = self.zero.as_ref().filter(|z| z.shards_params()) {
            figures.push(("param_shard_bytes", zero.param_shard_bytes() as f64));
        }
        figures
    }

    fn save_checkpoint(
        &mut self,
        cx: &mut Cx<'_>,
        state: &CheckpointState,
    ) -> Result<Option<PathBuf>> {
        let output = cx.config.telemetry.output.clone();
        if let Some(zero) = self.zero.as_mut().filter(|z| z.shards_params()) {
            // Gathered one bucket at a time; the buffers averaged as an unsharded run's.
            super::average_buffers(&*self.comm, &mut *self.engine)?;
            return zero.save_sharded(&output, &*self.engine, &self.plan, state);
        }
        self.prepare_model(cx)?;
        if let Some(by_param) = &self.by_param {
            return by_param.save(&output, &mut *self.engine, state);
        }
        match &self.zero {
            Some(zero) => zero.save(&output, &*self.engine, &self.plan, state),
            None if self.comm.rank() == 0 => {
                checkpoint::save(&output, &*self.engine, state).map(Some)
            }
            None => Ok(None),
        }
    }

    /// Under ZeRO stage 3 gathered one bucket at a time and written as it comes, no rank
    /// holding the whole parameters; else rank 0 writes its model whole.
    fn save_model(&mut self, cx: &mut Cx<'_>, path: &Path) -> Result<Option<PathBuf>> {
        if let Some(zero) = self.zero.as_mut().filter(|z| z.shards_params()) {
            super::average_buffers(&*self.comm, &mut *self.engine)?;
            return zero.save_model(path, &*self.engine, &self.plan);
        }
        crate::strategy::interface::save_whole_model(self, cx, path)
    }

    fn restore(&mut self, cx: &mut Cx<'_>, from: &Resume) -> Result<Option<CheckpointState>> {
        let engine = &mut *self.engine;
        if let Some(by_param) = self.by_param.as_mut() {
            let state = from.share(cx, |dir| checkpoint::load(dir, engine))?;
            if let Some(s) = &state {
                by_param.resumed(engine, s.step)?;
            }
            return Ok(state);
        }
        let Some(zero) = self.zero.as_mut() else {
            return from.share(cx, |dir| checkpoint::load(dir, engine));
        };
        if zero.started_released() {
            // ZeRO-3: no rank holds the whole model; each loads its own shard.
            let state = from.share(cx, |dir| zero.check_checkpoint(dir, &*engine))?;
            if let Some(s) = &state {
                zero.load_released(from.dir(), engine, &self.plan, s)?;
                zero.resumed_at(s.step);
            }
            return Ok(state);
        }
        let mut source = None;
        let plan = &self.plan;
        let state = from.share(cx, |dir| {
            let (state, shards) = zero.read(dir, engine, plan)?;
            source = Some(shards);
            Ok(state)
        })?;
        zero.restore_shards(source, (engine.layout(), plan), state.is_some())?;
        if let Some(s) = &state {
            zero.resumed_at(s.step);
        }
        Ok(state)
    }

    fn model(&mut self) -> Option<&mut dyn ModelState> {
        Some(&mut *self.engine)
    }

    /// The peers' buffers (batch norm's running statistics) become their mean; under ZeRO
    /// stage 3 the parameters are gathered whole first (the next step releases them).
    fn prepare_model(&mut self, cx: &mut Cx<'_>) -> Result<()> {
        let _ = cx;
        if let Some(zero) = self.zero.as_mut().filter(|z| z.shards_params()) {
            zero.materialize(&mut *self.engine, &self.plan)?;
        }
        super::average_buffers(&*self.comm, &mut *self.engine)
    }

    /// Under ZeRO stage 3, group by group through the shards, a training batch at a time.
    fn evaluate(&mut self, cx: &mut Cx<'_>) -> Result<EvalStats> {
        if let Some(zero) = self.zero.as_mut().filter(|z| z.shards_params()) {
            super::average_buffers(&*self.comm, &mut *self.engine)?;
            let batch = cx.config.data.batch_size;
            return zero.evaluate(&mut *self.engine, &self.plan, cx.test, batch);
        }
        self.prepare_model(cx)?;
        crate::eval::distributed(&*self.engine, &*self.comm, cx.test)
    }

    /// Under ZeRO stage 3 the hash of the parameters gathered one bucket at a time (the
    /// same on every rank by construction, and the one an unsharded run's model gives).
    fn verify_identical(&mut self, cx: &mut Cx<'_>) -> Result<Option<u64>> {
        if let Some(zero) = self.zero.as_mut().filter(|z| z.shards_params()) {
            // The buffers become the peers' mean here too, as in an unsharded run.
            super::average_buffers(&*self.comm, &mut *self.engine)?;
            let hash = zero.param_hash(&self.plan)?;
            cx.log(&format!(
                "parameters of the {} shards gathered (xxh3 {hash:016x})",
                self.comm.size()
            ))?;
            return Ok(Some(hash));
        }
        self.prepare_model(cx)?;
        super::verify_identical(&*self.engine, &*self.comm, cx).map(Some)
    }

    fn step(&mut self, cx: &mut Cx<'_>, data: &mut Batches, done: u64) -> Result<Step> {
        let lr = cx.lr_at(done);
        let world = self.comm.size() as u64;
        let (samples, weight) = super::share_weight(data, world);
        let (_, batch) = {
            let _span = tracing::info_span!(target: "flotilla::train", "data").entered();
            data.next_batch()?
        };
        let seed = super::dropout_seed(cx.config.model.seed, self.comm.rank(), done);
        self.engine.set_dropout_seed(seed);
        let stats = if self.accumulator.reduce_each {
            self.step_reducing_each(batch, lr, weight)?
        } else {
            let last = match self.zero.as_mut().filter(|z| z.shards_params()) {
                // ZeRO-3: the earlier micro-batches through the shards, summed on this rank.
                Some(zero) => {
                    let (engine, plan) = (&mut *self.engine, &self.plan);
                    let lps = engine.labels_per_sample();
                    self.accumulator
                        .run_with(lps, &self.layout, batch, &mut |micro, each| {
                            zero.local_pass(engine, plan, micro, each)
                        })?
                }
                None => self
                    .accumulator
                    .run(&mut *self.engine, &self.layout, batch)?,
            };
            self.step_on(last, lr, weight)?
        };
        Ok(Step {
            progressed: true,
            loss: Some(stats.global_loss),
            samples,
            done: None,
        })
    }
}

impl SyncAllReduce {
    /// One training step on this rank's batch at learning rate `lr`, its gradient and loss
    /// scaled by `weight` (its share of the global batch times the ranks; 1: equal shares).
    fn step_on(&mut self, batch: BatchRef<'_>, lr: f64, weight: f32) -> Result<StepStats> {
        self.release_params()?;
        let (local_loss, reduced_loss) = self.reduce(batch, weight)?;
        self.apply(local_loss, reduced_loss, lr)
    }

    /// A step whose micro-batches are each reduced as their backward gives the gradients
    /// (`allreduce.reduce_each_micro_batch`; see `accumulate.rs`), in order, into the
    /// averaged gradient or this rank's shard of it; then one optimizer step.
    fn step_reducing_each(
        &mut self,
        batch: BatchRef<'_>,
        lr: f64,
        weight: f32,
    ) -> Result<StepStats> {
        self.release_params()?;
        let lps = self.engine.labels_per_sample();
        let micro = self.accumulator.cut(lps, batch)?;
        // Nothing is summed on the rank: every loss slot is its micro-batch's alone.
        self.accumulator.sum.clear();
        self.accumulator.loss = 0.0;
        let (mut local_loss, mut reduced_loss) = (0.0, 0.0);
        for (j, batch) in micro.into_iter().enumerate() {
            self.accumulator.reduced = j;
            // Each loss slot holds its micro-batch's loss over `k`: their sum is the mean.
            let (local, reduced) = self.reduce(batch, weight)?;
            local_loss += local;
            reduced_loss += reduced;
        }
        self.accumulator.reduced = 0;
        let k = self.accumulator.steps as f32;
        self.apply(local_loss / k, reduced_loss, lr)
    }

    /// ZeRO-3: lets go of the parameters a whole-model operation gathered between steps.
    fn release_params(&mut self) -> Result<()> {
        match self.zero.as_mut().filter(|z| z.shards_params()) {
            Some(zero) => zero.release(&mut *self.engine),
            None => Ok(()),
        }
    }

    /// Forward and backward on `batch` and its reduction into the averaged gradient (or this
    /// rank's shard of it): this rank's loss and the loss slot's mean.
    fn reduce(&mut self, batch: BatchRef<'_>, weight: f32) -> Result<(f32, f32)> {
        match self.zero.as_mut().filter(|z| z.scatters()) {
            Some(zero) => super::scatter::reduce_scatter_step(
                zero,
                &*self.comm,
                &mut *self.engine,
                (&self.plan, &self.layout),
                (batch, &self.accumulator),
                (self.overlap, weight),
            ),
            None => self.all_reduce_step(batch, weight),
        }
    }

    /// The optimizer step on the averaged gradient (clipped first when configured); the
    /// global loss (ZeRO: told by the rank whose shard holds the loss slot).
    fn apply(&mut self, local_loss: f32, reduced_loss: f32, lr: f64) -> Result<StepStats> {
        if let Some(max) = self.clip_grad_norm {
            let (grads, sharded) = match &mut self.zero {
                Some(zero) => (zero.grad_mut(), true),
                None => (self.flat.as_mut_slice(), false),
            };
            super::clip::clip(grads, max, sharded, &self.plan, &*self.comm)?;
        }
        let engine = &mut *self.engine;
        let global_loss = match (&mut self.zero, &mut self.by_param) {
            (Some(zero), _) if zero.shards_params() => {
                zero.step_sharded(reduced_loss, lr, &self.plan)?
            }
            (Some(zero), _) => zero.step(engine, reduced_loss, lr)?,
            (None, Some(by_param)) => {
                by_param.step(engine, &self.flat, lr)?;
                reduced_loss
            }
            (None, None) => {
                engine.apply_grads(&self.flat, lr)?;
                reduced_loss
            }
        };
        Ok(StepStats {
            local_loss,
            global_loss,
        })
    }

    /// Forward and backward on `batch`, every bucket all-reduced (zero 0 and stage 1):
    /// this rank's loss and the global mean loss. `weight`: see [`Self::step_on`].
    fn all_reduce_step(&mut self, batch: BatchRef<'_>, weight: f32) -> Result<(f32, f32)> {
        let engine = &mut *self.engine;
        let count = self.plan.buckets.len();
        let last = count.saturating_sub(1);
        // A step that failed half-way may have left buffers with the communicator.
        self.buffers.resize_with(count, Vec::new);
        for (k, buffer) in self.buffers.iter_mut().enumerate() {
            buffer.resize(wire_len(&self.plan, k), 0.0);
        }
        let mut pending: Vec<Option<PendingAllReduce>> = (0..count).map(|_| None).collect();
        let local_loss = {
            let (plan, layout, buffers, comm) =
                (&self.plan, &self.layout, &mut self.buffers, &self.comm);
            let accumulator = &self.accumulator;
            let mut filled = vec![0usize; count];
            let pending = &mut pending;
            let mut on_grad = |i: usize, grad: &[f32]| {
                let k = plan.bucket_of(i);
                let bucket = &plan.buckets[k];
                let at = layout.params[i].offset - bucket.start;
                let dst = &mut buffers[k][at..at + grad.len()];
                accumulator.add_into(dst, grad, layout.params[i].offset);
                if weight != 1.0 {
                    dst.iter_mut().for_each(|v| *v *= weight);
                }
                filled[k] += 1;
                // The last bucket waits for the loss, known when the engine returns.
                if filled[k] == bucket.params.len() && k != last {
                    pending[k] = Some(comm.all_reduce_bucket(std::mem::take(&mut buffers[k]), k));
                }
                Ok(())
            };
            let loss = if self.overlap {
                engine.forward_backward_streaming(batch, &mut on_grad)?
            } else {
                let loss = engine.forward_backward(batch)?;
                engine.for_each_grad(&mut on_grad)?;
                loss
            };
            if let Some(buffer) = buffers.get_mut(last) {
                let n = plan.buckets[last].len();
                // The mean of the step's micro-batch losses.
                buffer[n] = accumulator.mean_loss(loss) * weight;
                pending[last] = Some(comm.all_reduce_bucket(std::mem::take(buffer), last));
            }
            loss
        };
        let global_loss = self.wait_buckets(pending)?.unwrap_or(local_loss);
        Ok((local_loss, global_loss))
    }

    /// Waits for the buckets in order and scales their sums by `1/N` into the flat
    /// gradient (zero 0) or this rank's shard of it (stage 1: [`Zero::keep_shard`]);
    /// returns the global mean loss of the last bucket's slot.
    fn wait_buckets(&mut self, pending: Vec<Option<PendingAllReduce>>) -> Result<Option<f32>> {
        // The mean over the ranks and a step's micro-batches; the loss slot holds a mean
        // over the micro-batches already.
        let micro = self.accumulator.steps as f32;
        let scale = 1.0 / (self.comm.size() as f32 * micro);
        let last = self.plan.buckets.len().saturating_sub(1);
        let mut global_loss = None;
        for (k, p) in pending.into_iter().enumerate() {
            let Some(p) = p else {
                return Err(TrainError::Divergence(format!(
                    "the engine gave no gradient for some tensors of bucket {k}"
                )));
            };
            let summed = p.wait()?;
            let bucket = &self.plan.buckets[k];
            match &mut self.zero {
                Some(zero) => zero.keep_shard(k, &summed, scale, &self.accumulator),
                None => {
                    let flat = &mut self.flat[bucket.start..bucket.end];
                    self.accumulator.keep(flat, &summed, scale);
                }
            }
            if k == last {
                global_loss = Some(summed[bucket.len()] * scale * micro);
            }
            self.buffers[k] = summed;
        }
        Ok(global_loss)
    }
}
