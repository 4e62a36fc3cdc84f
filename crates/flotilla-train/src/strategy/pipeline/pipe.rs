//! [`Pipeline`]: one rank's stage of a pipeline-parallel model, driven as plainly as a
//! PyTorch loop (`forward`, `backward`, `step`) or one batch at a time by its schedule
//! (`train_batch`).
//!
//! # Ranks
//!
//! A world of `S × D` ranks runs `D` replicas of an `S`-stage pipeline: rank `r` is stage
//! `r % S` of replica `r / S`. Activations and gradients go point to point between the stages
//! of one replica (a skip tensor straight from its producer to its consumer); the `D` replicas
//! of a stage average their gradients in their own sub-group before each step, while the
//! other stages may still be draining.

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use flotilla_engine::{
    EvalStats, ModelSpec, OptimizerSpec, Shape, Stage, StageCut, StageEngine, StageSeed,
};
use flotilla_tcp::ProcessGroup;

use crate::error::{Result, TrainError};

mod replicas;
use crate::strategy::allreduce::dropout_seed;
use crate::strategy::pipeline::initial_shard::StageShard;
use crate::strategy::pipeline::wire::{self, Direction, MAX_CROSSINGS, MAX_MICRO_BATCHES};
use crate::strategy::pipeline::zero::{self, ReplicaShard};
use crate::strategy::pipeline::zero3::ReplicaParams;
use crate::strategy::pipeline::{Action, Schedule, micro_batches};

/// How a pipeline runs.
#[derive(Debug, Clone, PartialEq)]
pub struct PipelineOptions {
    /// Micro-batches per batch (M).
    pub micro_batches: usize,
    /// The micro-batch schedule of [`Pipeline::train_batch`].
    pub schedule: Schedule,
    /// Replicas of every stage (D); the world has `stages × data_parallel` ranks.
    pub data_parallel: usize,
    /// Learning rate of [`Pipeline::step`] (change it with [`Pipeline::set_lr`]).
    pub lr: f64,
    /// The optimizer every stage runs on its own parameters.
    pub optimizer: OptimizerSpec,
    /// The engine's device (`flex`, `libtorch`).
    pub device: String,
    /// Seed of the initial parameters (the same on every rank: a stage starts from the whole
    /// model's values for its layers).
    pub seed: u64,
    /// Clip the gradient to this global norm (over every stage's parameters) before each
    /// step (`allreduce.clip_grad_norm`).
    pub clip_grad_norm: Option<f64>,
    /// ZeRO stage among a stage's replicas (`allreduce.zero`): 0; 1 to shard each stage's
    /// optimizer state among its `data_parallel` replicas (`zero.rs`; the same parameters,
    /// bit for bit); 2 to reduce-scatter the gradient too, each replica keeping its shard of
    /// the average only; 3 to shard the parameters too, each group gathered for each use
    /// (`zero3.rs`).
    pub zero: u8,
    /// Under ZeRO-3, at most this many bytes of parameters (4 per value) in a group a
    /// replica gathers at once (a spec stage cut where only the main activation crosses,
    /// `comm.bucket_mb`); `0`: the whole stage at once.
    pub group_bytes: usize,
    /// Under ZeRO-3, whether the next group's all-gather runs while a group computes
    /// (`allreduce.prefetch`; the same values either way).
    pub prefetch: bool,
    /// Under ZeRO-1, the directory each replica's shard of the optimizer state is offloaded
    /// under (`allreduce.offload`); none: in memory.
    pub offload: Option<std::path::PathBuf>,
}

/// One rank's part of a pipeline (see the module documentation).
pub struct Pipeline {
    stage: Box<dyn StageEngine>,
    cut: StageCut,
    opts: PipelineOptions,
    world: Arc<dyn ProcessGroup>,
    replica: usize,
    /// World-group rank of each stage of this replica.
    peers: Vec<usize>,
    /// The replicas of this stage (when `data_parallel > 1`).
    replicas: Option<Arc<dyn ProcessGroup>>,
    /// The micro-batches of the batch in progress (rows of the batch).
    rows: Vec<Range<usize>>,
    /// The size of the batch that [`Pipeline::forward`] started and [`Pipeline::backward`]
    /// has not finished.
    open: Option<usize>,
    /// Time spent computing (the stage's forwards, backwards and optimizer steps), as
    /// opposed to waiting for other stages.
    compute: std::time::Duration,
    /// The seed of the next batch's dropout masks ([`Pipeline::set_dropout_seed`]).
    dropout_seed: Option<u64>,
    /// This replica's share of the step's samples, when replicas' batches differ
    /// ([`Pipeline::set_share`]); `None`: equal batches, the gradients' plain mean.
    share: Option<f32>,
    /// ZeRO-1, 2 and 3: this replica's part of its stage's optimizer (`None`: the stage's own
    /// optimizer steps, as without ZeRO or with one replica).
    zero: Option<ReplicaShard>,
    /// ZeRO-3: this replica's shard of its stage's parameters (the stage holds none between
    /// uses).
    params: Option<ReplicaParams>,
}

impl std::fmt::Debug for Pipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pipeline")
            .field("stage", &self.stage.index())
            .field("layers", &self.stage.layers())
            .field("replica", &self.replica)
            .field("options", &self.opts)
            .finish()
    }
}

impl Pipeline {
    /// Builds this rank's stage of `cut` (a cut of `spec`); collective over `world`,
    /// which must have `stages × data_parallel` ranks that all pass the same spec, cut and
    /// options (checked: a rank that differs is named).
    pub fn new(
        spec: &ModelSpec,
        cut: StageCut,
        opts: PipelineOptions,
        world: Arc<dyn ProcessGroup>,
    ) -> Result<Self> {
        check_shape(&cut, &opts, world.size())?;
        let (index, replica) = (world.rank() % cut.stages(), world.rank() / cut.stages());
        let (o, d) = (&opts, opts.data_parallel);
        if o.zero == 3 && d > 1 {
            // Sharded from the start: no replica holds its whole stage.
            let mut shard = StageShard::new(d, replica);
            let stage = Stage::new_released(
                spec,
                (&cut, index),
                &o.optimizer,
                (&o.device, o.seed),
                o.group_bytes,
                &mut shard,
            )?;
            let drawn = Some(shard.finish()?);
            return Self::start((Box::new(stage), drawn), cut, &spec.to_yaml(), opts, world);
        }
        let stage = Stage::new(spec, &cut, index, &o.optimizer, &o.device, o.seed)?;
        Self::of(Box::new(stage), cut, &spec.to_yaml(), opts, world)
    }

    /// This rank's part of a pipeline whose stage is built already: `stage` (this rank's
    /// stage of `cut`: a spec's layers or a user's module), `model` what every rank must
    /// agree on about the whole model (a spec's text, a program's modules). Collective over
    /// `world`, as [`Pipeline::new`].
    pub fn of(
        stage: Box<dyn StageEngine>,
        cut: StageCut,
        model: &str,
        opts: PipelineOptions,
        world: Arc<dyn ProcessGroup>,
    ) -> Result<Self> {
        Self::start((stage, None), cut, model, opts, world)
    }

    /// [`Pipeline::of`], the stage whole, or released under ZeRO-3 with this replica's
    /// shard of its initial parameters `drawn` ([`Stage::new_released`]).
    fn start(
        (stage, drawn): (Box<dyn StageEngine>, Option<Vec<f32>>),
        cut: StageCut,
        model: &str,
        opts: PipelineOptions,
        world: Arc<dyn ProcessGroup>,
    ) -> Result<Self> {
        let stages = cut.stages();
        check_shape(&cut, &opts, world.size())?;
        let index = world.rank() % stages;
        if stage.index() != index {
            return Err(TrainError::config(
                "pipeline",
                format!(
                    "rank {} runs stage {index} of {stages}, but was given stage {}",
                    world.rank(),
                    stage.index()
                ),
            ));
        }
        agree(&*world, model, &cut, &opts)?;
        let (replica, peers, replicas) = layout(&world, stages, opts.data_parallel)?;
        let mut stage = stage;
        let params = match (&replicas, opts.zero) {
            (Some(group), 3) => {
                stage.set_group_bytes(opts.group_bytes)?;
                let mut params = ReplicaParams::new(&*stage, group.clone(), opts.prefetch);
                match drawn {
                    Some(values) => params.take_drawn(&mut *stage, values)?,
                    None => params.take_shard(&mut *stage)?,
                }
                Some(params)
            }
            _ => None,
        };
        let zero = match (&replicas, opts.zero) {
            (Some(group), 1..) => {
                let groups = params.as_ref().map(ReplicaParams::group_ranges);
                let (total, d, r) = (stage.layout().total, group.size(), group.rank());
                Some(ReplicaShard::new(
                    &*stage,
                    zero::owned(total, groups.as_deref(), d, r),
                    &opts.optimizer,
                    &opts.device,
                    opts.offload.as_deref(),
                )?)
            }
            _ => None,
        };
        Ok(Self {
            stage,
            cut,
            opts,
            world,
            replica,
            peers,
            replicas,
            rows: Vec::new(),
            open: None,
            compute: std::time::Duration::ZERO,
            dropout_seed: None,
            share: None,
            zero,
            params,
        })
    }

    /// Takes `world` (an elastic job's next generation: `stages × D` ranks for any `D`) in
    /// place of the world it ran in, with `stage` in place of its stage when given (this
    /// rank's stage in `world` changed); collective over `world`, as [`Pipeline::of`]
    /// (`model` as there). Whatever a failed batch left in flight is dropped.
    pub fn rejoin(
        &mut self,
        world: Arc<dyn ProcessGroup>,
        stage: Option<Box<dyn StageEngine>>,
        model: &str,
    ) -> Result<()> {
        let stages = self.cut.stages();
        if self.opts.zero > 0 {
            return Err(self.usage(
                "a pipeline whose replicas shard their optimizer (ZeRO) rejoining a new world",
            ));
        }
        self.opts.data_parallel = world.size() / stages;
        check_shape(&self.cut, &self.opts, world.size())?;
        if let Some(stage) = stage {
            self.stage = stage;
        }
        if self.stage.index() != world.rank() % stages {
            return Err(self.usage(&format!(
                "rank {} of the new world runs stage {}",
                world.rank(),
                world.rank() % stages
            )));
        }
        self.stage.reset();
        agree(&*world, model, &self.cut, &self.opts)?;
        (self.replica, self.peers, self.replicas) =
            layout(&world, stages, self.opts.data_parallel)?;
        self.world = world;
        (self.rows, self.open) = (Vec::new(), None);
        Ok(())
    }

    /// This rank's stage.
    pub fn stage(&self) -> &dyn StageEngine {
        &*self.stage
    }

    /// This rank's stage index.
    pub fn stage_index(&self) -> usize {
        self.stage.index()
    }

    /// This rank's replica (which shard of the data it trains on).
    pub fn replica(&self) -> usize {
        self.replica
    }

    /// Whether this rank runs the first stage (it reads the inputs).
    pub fn is_first(&self) -> bool {
        self.stage.index() == 0
    }

    /// Whether this rank runs the last stage (it gives the logits and the loss).
    pub fn is_last(&self) -> bool {
        self.stage.is_last()
    }

    /// The cut this pipeline runs.
    pub fn cut(&self) -> &StageCut {
        &self.cut
    }

    /// The options this pipeline runs with.
    pub fn options(&self) -> &PipelineOptions {
        &self.opts
    }

    /// The group of this stage's replicas (when `data_parallel > 1`).
    pub fn replica_group(&self) -> Option<&Arc<dyn ProcessGroup>> {
        self.replicas.as_ref()
    }

    /// Replaces this stage's buffers (batch norm's running statistics, which each replica's
    /// forwards update from its own samples) with their mean over the stage's replicas, as
    /// sync all-reduce peers average theirs: before an evaluation, a checkpoint, a model
    /// handed to the program. Collective over the replicas; free without buffers or replicas.
    pub fn average_buffers(&mut self) -> Result<()> {
        match &self.replicas {
            Some(group) => crate::strategy::allreduce::average_buffers(&**group, &mut *self.stage),
            None => Ok(()),
        }
    }

    /// This rank's stage, to read or replace its parameters and optimizer state (between
    /// batches).
    pub fn stage_mut(&mut self) -> &mut dyn StageEngine {
        &mut *self.stage
    }

    /// The world group the pipeline runs in.
    pub fn world(&self) -> &Arc<dyn ProcessGroup> {
        &self.world
    }

    /// Time this rank has spent computing since it was built: its stage's forwards,
    /// backwards and optimizer steps, not waiting for other stages or for its replicas. The
    /// rest of the time a stage trains is the pipeline's bubble (and communication).
    pub fn compute_time(&self) -> std::time::Duration {
        self.compute
    }

    /// Seeds the dropout masks of the following batches: micro-batch `mb`'s training forward
    /// on this stage draws from a seed made of `seed` and `mb`, so that a batch's masks depend
    /// on the seed alone (give each step and rank its own, as the run loop does). Until it is
    /// called, masks come from the backend's running RNG.
    pub fn set_dropout_seed(&mut self, seed: u64) {
        self.dropout_seed = Some(seed);
    }

    /// Weights this replica's gradient by `share` (its batch's samples over the step's, all
    /// replicas together) before the replicas sum them, for batches that differ in size
    /// (an elastic job's replicas share a fixed global batch); `None`: the plain mean.
    pub fn set_share(&mut self, share: Option<f32>) {
        self.share = share;
        if let Some(p) = &mut self.params {
            p.set_share(share);
        }
    }

    /// Sets the learning rate of the next steps.
    pub fn set_lr(&mut self, lr: f64) {
        self.opts.lr = lr;
    }

    /// How many labels one sample has: 1 for a classifier, `T` for a sequence model (one per
    /// position, row-major in a batch's labels), as [`flotilla_engine::Engine::labels_per_sample`].
    pub fn labels_per_sample(&self) -> usize {
        match self.cut.output {
            Shape::Seq { t, .. } => t,
            _ => 1,
        }
    }

    /// Trains on one batch with the configured schedule: `images` (read on the first stage;
    /// other stages may pass an empty slice) and `labels` (read on the last stage; every
    /// stage takes the batch size from them: [`Pipeline::labels_per_sample`] labels a
    /// sample). Micro-batches are cut by samples. Every stage steps its optimizer once.
    /// Returns the batch's mean loss (over samples, and over positions of a sequence model)
    /// on the last stage.
    pub fn train_batch(&mut self, images: &[f32], labels: &[i64]) -> Result<Option<f32>> {
        let (n, per) = (self.samples(labels)?, self.labels_per_sample());
        self.begin(images, n)?;
        let rows = self.rows.clone();
        let stages = self.cut.stages();
        let mut loss = 0.0;
        for action in self
            .opts
            .schedule
            .actions(stages, self.stage.index(), rows.len())
        {
            match action {
                Action::Forward(mb) => {
                    self.forward_mb(mb, rows[mb].clone(), images)?;
                }
                Action::Backward(mb) => {
                    let r = rows[mb].clone();
                    let weight = r.len() as f32 / n as f32;
                    let upstream = match self.is_last() {
                        true => Upstream::Labels(&labels[r.start * per..r.end * per], weight),
                        false => Upstream::Stage,
                    };
                    if let Some(l) = self.backward_mb(mb, upstream)? {
                        loss += l * weight;
                    }
                }
            }
        }
        self.step()?;
        Ok(self.is_last().then_some(loss))
    }

    /// Runs the forward pass of a batch of `n` samples through the pipeline (all its
    /// micro-batches) and returns the logits (`n × classes`) on the last stage. `images` is
    /// read on the first stage only. Follow with [`Pipeline::backward`]. This loop runs the
    /// GPipe order (every forward, then every backward); [`Pipeline::train_batch`] runs the
    /// configured schedule.
    pub fn forward(&mut self, images: &[f32], n: usize) -> Result<Option<Vec<f32>>> {
        self.begin(images, n)?;
        let mut logits = Vec::new();
        for (mb, r) in self.rows.clone().into_iter().enumerate() {
            if let Some(out) = self.forward_mb(mb, r, images)? {
                logits.extend(out);
            }
        }
        self.open = Some(n);
        Ok(self.is_last().then_some(logits))
    }

    /// Runs the backward pass of the batch of the last [`Pipeline::forward`]: the last stage
    /// passes the gradient of the loss with respect to the logits (`n × classes`, e.g. from
    /// [`flotilla_engine::cross_entropy`]); other stages pass `None`. Gradients accumulate
    /// until [`Pipeline::step`].
    pub fn backward(&mut self, grad_logits: Option<&[f32]>) -> Result<()> {
        let Some(n) = self.open.take() else {
            return Err(self.usage("backward without a forward"));
        };
        let classes = self.cut.classes;
        for (mb, r) in self.rows.clone().into_iter().enumerate() {
            let upstream = match (self.is_last(), grad_logits) {
                (false, _) => Upstream::Stage,
                (true, Some(g)) if g.len() == n * classes => {
                    Upstream::Grad(g[r.start * classes..r.end * classes].to_vec())
                }
                (true, g) => {
                    return Err(self.usage(&format!(
                        "the last stage's backward needs the logits' gradient ({} values), got {}",
                        n * classes,
                        g.map_or(0, <[f32]>::len)
                    )));
                }
            };
            self.backward_mb(mb, upstream)?;
        }
        Ok(())
    }

    /// Evaluates the model on a data set in chunks of `chunk` samples, each stage's running
    /// statistics first averaged over its replicas ([`Pipeline::average_buffers`]);
    /// collective over the world (replica 0 runs the forwards, every rank gets the result). A sequence model's
    /// loss and accuracy are over positions, as the whole model's.
    pub fn evaluate(&mut self, images: &[f32], labels: &[i64], chunk: usize) -> Result<EvalStats> {
        self.average_buffers()?;
        let mut stats = EvalStats::default();
        // Under ZeRO-3 every replica runs the forwards: each group's gather takes them all.
        if self.replica == 0 || self.params.is_some() {
            let (n, per) = (self.samples(labels)?, self.labels_per_sample());
            let chunk = chunk.max(1);
            for (i, start) in (0..n).step_by(chunk).enumerate() {
                let r = start..(start + chunk).min(n);
                if let Some(logits) = self.eval_chunk(i, r.clone(), images)? {
                    let s = EvalStats::from_logits(&logits, &labels[r.start * per..r.end * per]);
                    stats.loss_sum += s.loss_sum;
                    stats.correct += s.correct;
                    stats.count += s.count;
                }
            }
        }
        self.share_stats(stats)
    }

    fn usage(&self, what: &str) -> TrainError {
        TrainError::Config {
            source_name: format!("pipeline stage {}", self.stage.index()),
            message: what.to_string(),
        }
    }

    /// The samples of a batch of `labels` ([`Pipeline::labels_per_sample`] each).
    fn samples(&self, labels: &[i64]) -> Result<usize> {
        let per = self.labels_per_sample();
        match labels.len() % per {
            0 => Ok(labels.len() / per),
            _ => Err(self.usage(&format!(
                "{} labels are not whole samples of {per} labels (one per position)",
                labels.len()
            ))),
        }
    }

    /// Checks a batch and cuts it into micro-batches.
    fn begin(&mut self, images: &[f32], n: usize) -> Result<()> {
        if self.open.is_some() {
            return Err(self.usage("forward while the previous batch waits for backward"));
        }
        let m = self.opts.micro_batches;
        if n < m {
            return Err(self.usage(&format!(
                "a batch of {n} samples cannot be cut into {m} micro-batches"
            )));
        }
        let per = self.cut.input.numel();
        if self.is_first() && images.len() != n * per {
            return Err(self.usage(&format!(
                "{n} samples need {} input values, got {}",
                n * per,
                images.len()
            )));
        }
        self.rows = micro_batches(n, m);
        Ok(())
    }

    /// Forward of micro-batch `mb` (rows `rows` of the batch); the logits on the last stage.
    fn forward_mb(
        &mut self,
        mb: usize,
        rows: Range<usize>,
        images: &[f32],
    ) -> Result<Option<Vec<f32>>> {
        let n = rows.len();
        let inputs = self.stage_inputs(Direction::Forward, mb, rows, images)?;
        let refs: Vec<&[f32]> = inputs.iter().map(Vec::as_slice).collect();
        if let Some(seed) = self.dropout_seed {
            // The same mixing as a step's seed, with the micro-batch in the place of the rank.
            self.stage.set_dropout_seed(dropout_seed(seed, mb, 0));
        }
        let started = Instant::now();
        let outputs = match &mut self.params {
            Some(p) => {
                p.release(&mut *self.stage)?;
                let out = self.stage.forward_sharded(mb, n, &refs, p);
                out.map_err(|e| p.error_of(e))?
            }
            None => self.stage.forward(mb, n, &refs)?,
        };
        self.compute += started.elapsed();
        self.send_forward(Direction::Forward, mb, outputs)
    }

    /// Sends a stage's outputs downstream, or gives them back on the last stage.
    fn send_forward(
        &self,
        dir: Direction,
        mb: usize,
        outputs: Vec<Vec<f32>>,
    ) -> Result<Option<Vec<f32>>> {
        if self.is_last() {
            return Ok(outputs.into_iter().next());
        }
        let s = self.stage.index();
        for (c, values) in self.cut.outputs(s).into_iter().zip(outputs) {
            let to = self.cut.crossings[c].to;
            self.send(self.peers[to], wire::tag(dir, c, mb), &values)?;
        }
        Ok(None)
    }

    /// Backward of micro-batch `mb`; the micro-batch's loss on the last stage (when the
    /// pipeline computes it).
    fn backward_mb(&mut self, mb: usize, upstream: Upstream<'_>) -> Result<Option<f32>> {
        let s = self.stage.index();
        // Waiting for the outputs' gradients is not compute time.
        let received = match upstream {
            Upstream::Stage => {
                let outputs = self.cut.outputs(s);
                let n = self.rows.get(mb).map_or(0, |r| r.len());
                self.receive(Direction::Backward, &outputs, mb, n)?
            }
            _ => Vec::new(),
        };
        let started = Instant::now();
        let (loss, grad_inputs) = match (upstream, &mut self.params) {
            (upstream, Some(p)) => {
                let seed = match upstream {
                    Upstream::Labels(labels, weight) => StageSeed::Loss { labels, weight },
                    Upstream::Grad(g) => StageSeed::Grads(vec![g]),
                    Upstream::Stage => StageSeed::Grads(received),
                };
                let back = self.stage.backward_sharded(mb, seed, p);
                back.map_err(|e| p.error_of(e))?
            }
            (Upstream::Labels(labels, weight), None) => {
                let (loss, g) = self.stage.backward_loss(mb, labels, weight)?;
                (Some(loss), g)
            }
            (Upstream::Grad(g), None) => (None, self.stage.backward(mb, vec![g])?),
            (Upstream::Stage, None) => (None, self.stage.backward(mb, received)?),
        };
        self.compute += started.elapsed();
        if s > 0 {
            for (c, g) in self.cut.inputs(s).into_iter().zip(grad_inputs) {
                let from = self.cut.crossings[c].from;
                self.send(self.peers[from], wire::tag(Direction::Backward, c, mb), &g)?;
            }
        }
        Ok(loss)
    }

    /// A forward's inputs: rows of the batch on the first stage, else the input crossings
    /// of micro-batch (or evaluation chunk) `mb` from the stages that produce them.
    fn stage_inputs(
        &self,
        dir: Direction,
        mb: usize,
        rows: Range<usize>,
        images: &[f32],
    ) -> Result<Vec<Vec<f32>>> {
        match self.stage.index() {
            0 => {
                let per = self.cut.input.numel();
                Ok(vec![images[rows.start * per..rows.end * per].to_vec()])
            }
            s => self.receive(dir, &self.cut.inputs(s), mb, rows.len()),
        }
    }

    fn eval_chunk(
        &mut self,
        chunk: usize,
        rows: Range<usize>,
        images: &[f32],
    ) -> Result<Option<Vec<f32>>> {
        let n = rows.len();
        let inputs = self.stage_inputs(Direction::Eval, chunk, rows, images)?;
        let refs: Vec<&[f32]> = inputs.iter().map(Vec::as_slice).collect();
        let outputs = match &mut self.params {
            Some(p) => {
                p.release(&mut *self.stage)?;
                let out = self.stage.forward_eval_sharded(n, &refs, p);
                out.map_err(|e| p.error_of(e))?
            }
            None => self.stage.forward_eval(n, &refs)?,
        };
        self.send_forward(Direction::Eval, chunk, outputs)
    }

    /// Gives every rank the evaluation totals of the last stage of replica 0.
    fn share_stats(&self, stats: EvalStats) -> Result<EvalStats> {
        let root = self.cut.stages() - 1;
        let mut bytes = [
            stats.loss_sum.to_le_bytes(),
            (stats.correct as u64).to_le_bytes(),
            (stats.count as u64).to_le_bytes(),
        ]
        .concat();
        let len = bytes.len();
        self.world.broadcast_bytes(&mut bytes, root, len)?;
        let field = |i: usize| -> Result<[u8; 8]> {
            bytes
                .get(i * 8..i * 8 + 8)
                .and_then(|b| <[u8; 8]>::try_from(b).ok())
                .ok_or_else(|| TrainError::Protocol {
                    peer: self.world.world_rank(root),
                    message: format!("evaluation totals of {} bytes", bytes.len()),
                })
        };
        Ok(EvalStats {
            loss_sum: f64::from_le_bytes(field(0)?),
            correct: u64::from_le_bytes(field(1)?) as usize,
            count: u64::from_le_bytes(field(2)?) as usize,
        })
    }

    fn send(&self, peer: usize, tag: flotilla_tcp::Tag, values: &[f32]) -> Result<()> {
        let _span = tracing::info_span!(target: "flotilla::pipeline", "send", peer, tag).entered();
        Ok(self.world.send(peer, tag, wire::encode(values))?)
    }

    /// Receives crossings `crossings` of micro-batch `mb` (`n` samples) going `dir`: from
    /// their producers going forward, from their consumers going backward.
    fn receive(
        &self,
        dir: Direction,
        crossings: &[usize],
        mb: usize,
        n: usize,
    ) -> Result<Vec<Vec<f32>>> {
        let mut out = Vec::with_capacity(crossings.len());
        for &c in crossings {
            let crossing = &self.cut.crossings[c];
            let stage = match dir {
                Direction::Backward => crossing.to,
                Direction::Forward | Direction::Eval | Direction::State => crossing.from,
            };
            let peer = self.peers[stage];
            let _span =
                tracing::info_span!(target: "flotilla::pipeline", "recv", peer, mb).entered();
            let deadline = Instant::now() + self.world.timeout();
            let bytes = self
                .world
                .recv(peer, wire::tag(dir, c, mb), deadline)
                .map_err(|e| self.lost(stage, &crossing.name, mb, dir, e))?;
            let expected = n * crossing.shape.numel();
            let values = wire::decode(&bytes, expected).ok_or_else(|| TrainError::Protocol {
                peer: self.world.world_rank(peer),
                message: format!(
                    "stage {stage} sent {} bytes for `{}` of micro-batch {mb}; {n} samples of {} are {} bytes",
                    bytes.len(),
                    crossing.name,
                    crossing.shape,
                    expected * 4
                ),
            })?;
            out.push(values);
        }
        Ok(out)
    }

    /// A receive that failed, with the stage, tensor and micro-batch it waited for.
    fn lost(
        &self,
        stage: usize,
        name: &str,
        mb: usize,
        dir: Direction,
        e: flotilla_tcp::CommError,
    ) -> TrainError {
        let what = match dir {
            Direction::Backward => "gradient of",
            Direction::Forward | Direction::Eval | Direction::State => "activation",
        };
        TrainError::Peer {
            peer: self.world.world_rank(self.peers[stage]),
            message: format!(
                "pipeline stage {} waited for the {what} `{name}` of micro-batch {mb} from stage {stage} (rank {}): {e}",
                self.stage.index(),
                self.world.world_rank(self.peers[stage]),
            ),
        }
    }
}

/// Where a backward pass gets the gradient of a stage's outputs.
enum Upstream<'a> {
    /// The last stage computes the loss against these labels, weighted.
    Labels(&'a [i64], f32),
    /// The last stage was given the logits' gradient.
    Grad(Vec<f32>),
    /// A stage receives its outputs' gradients from the stages that consumed them.
    Stage,
}

/// A rank's place in a pipeline's world: its replica, the world ranks of its replica's
/// stages, and the group of its stage's replicas (when there are several).
type Place = (usize, Vec<usize>, Option<Arc<dyn ProcessGroup>>);

/// Where rank `world.rank()` stands in a world of `stages × d` ranks.
fn layout(world: &Arc<dyn ProcessGroup>, stages: usize, d: usize) -> Result<Place> {
    let (replica, index) = (world.rank() / stages, world.rank() % stages);
    let peers = (0..stages).map(|s| replica * stages + s).collect();
    let replicas = match d {
        1 => None,
        d => {
            let members: Vec<usize> = (0..d).map(|r| r * stages + index).collect();
            Some(world.group(&members)?)
        }
    };
    Ok((replica, peers, replicas))
}

fn check_shape(cut: &StageCut, opts: &PipelineOptions, world: usize) -> Result<()> {
    let err = |message: String| {
        Err(TrainError::Config {
            source_name: "pipeline".into(),
            message,
        })
    };
    let (s, d) = (cut.stages(), opts.data_parallel);
    if d == 0 || s * d != world {
        return err(format!(
            "{s} stages × data_parallel {d} need {} ranks, but the world has {world}",
            s * d
        ));
    }
    if opts.zero > 3 {
        return err(format!(
            "ZeRO stage {} among a stage's replicas: a pipeline runs stages 0 to 3",
            opts.zero
        ));
    }
    if opts.micro_batches == 0 || opts.micro_batches > MAX_MICRO_BATCHES {
        return err(format!(
            "micro_batches must be 1..={MAX_MICRO_BATCHES}, got {}",
            opts.micro_batches
        ));
    }
    if cut.crossings.len() > MAX_CROSSINGS {
        return err(format!(
            "{} tensors cross stage boundaries; at most {MAX_CROSSINGS} can",
            cut.crossings.len()
        ));
    }
    Ok(())
}

/// Checks that every rank runs the same spec, cut and options; names a rank that does not.
fn agree(
    world: &dyn ProcessGroup,
    model: &str,
    cut: &StageCut,
    opts: &PipelineOptions,
) -> Result<()> {
    // Everything but the device, which may differ between hosts.
    let shared = (
        opts.micro_batches,
        opts.schedule,
        opts.data_parallel,
        opts.lr,
        &opts.optimizer,
        opts.seed,
        opts.zero,
        opts.group_bytes,
    );
    let text = format!("{model}|{:?}|{:?}|{shared:?}", cut.ranges, cut.crossings);
    let mine = xxhash_rust::xxh3::xxh3_64(text.as_bytes());
    let all = world.all_gather_u64(mine)?;
    match all.iter().position(|&h| h != all[0]) {
        None => Ok(()),
        Some(r) => Err(TrainError::Peer {
            peer: world.world_rank(r),
            message: format!(
                "rank {} runs a different model, split or pipeline options than rank {} (check that every rank has the same config)",
                world.world_rank(r),
                world.world_rank(0)
            ),
        }),
    }
}
