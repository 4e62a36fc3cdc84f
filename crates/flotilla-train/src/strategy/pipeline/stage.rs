//! A pipeline stage as a [`Strategy`] of the one run loop (`strategy: pipeline`): the cut is
//! planned on rank 0 (profiled, printed, refused when it does not fit) and sent to every
//! rank; each rank builds its [`Pipeline`] stage, trains its replica's batches with the
//! configured schedule, evaluates with the other stages, and joins the pipeline's
//! checkpoints.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use flotilla_engine::{EvalStats, ModelSpec, ModelState, StageCut};

use crate::batches::Batches;
use crate::checkpoint::CheckpointState;
use crate::config::{Elasticity, StagesSetting, TrainConfig};
use crate::error::{Result, TrainError};
use crate::plan::Counting;
use crate::strategy::allreduce::dropout_seed;
use crate::strategy::pipeline::source::StageSource;
use crate::strategy::pipeline::{Pipeline, PipelineOptions, elastic, plan, restore, state};
use crate::strategy::{Cx, Evaluation, Resume, Setup, Step, Strategy};

/// Rows of logits (samples, or a sequence model's positions) per forward when evaluating.
const EVAL_CHUNK: usize = 500;

/// Tag of rank 0's pipeline cut, sent to every other rank at start (point to point, so that
/// the wait can be as long as joining: planning measures the model first).
const PLAN_TAG: flotilla_tcp::Tag = flotilla_tcp::tags::RESERVED + 0x100;

/// One rank's stage of a pipeline job.
pub struct PipelineStage {
    pipe: Pipeline,
    /// Time spent in training steps (computing and waiting) after the first, for the idle
    /// fraction.
    training: std::time::Duration,
    /// The pipeline's compute time at the end of the first step: the first step warms up
    /// (allocations, first use of every kernel) and is left out of the figures.
    warmed_up: Option<std::time::Duration>,
    /// Bytes of the stage's layer outputs for one micro-batch (what backward keeps, as the
    /// partition estimates it).
    activation_bytes: u64,
    /// Whether the stage is a program's module (not a spec's layers).
    program: bool,
    /// In an elastic job: the model (to build another stage from) and what this rank's
    /// stage state holds ([`elastic`]).
    elastic: Option<(StageSource, elastic::Held)>,
}

impl PipelineStage {
    /// Plans the cut on rank 0 (printing the plan to its log) and builds this rank's stage;
    /// collective over the world. A plan that rank 0 refuses fails every rank with its reason.
    pub fn build(cx: &mut Cx<'_>, setup: &Setup<'_>) -> Result<Self> {
        let config = cx.config;
        let p = &config.pipeline;
        // A step's batch is `accumulation_steps` batches: as many times the micro-batches.
        let k = config.allreduce.accumulation_steps.max(1) as usize;
        let elastic = config.elasticity() == Some(Elasticity::Generations);
        let opts = PipelineOptions {
            micro_batches: p.micro_batches * k,
            schedule: p.schedule,
            // An elastic generation has as many replicas as its ranks make.
            data_parallel: match elastic {
                true => cx.comm.size() / p.num_stages().max(1),
                false => p.data_parallel,
            },
            lr: config.base_lr(),
            optimizer: config.optimizer.clone(),
            device: config.model.device.clone(),
            seed: config.model.seed,
            clip_grad_norm: config.allreduce.clip_grad_norm,
            zero: config.allreduce.zero,
            group_bytes: config.bucket_bytes(),
            prefetch: config.allreduce.prefetch,
            offload: config.allreduce.offload.clone(),
        };
        let samples = config.data.batch_size.div_ceil(p.micro_batches.max(1));
        let mut held = elastic::Held::default();
        let source = match (setup.model.spec(), setup.model.stages()) {
            (Some(spec), _) => Some(StageSource::Spec(spec.clone())),
            (None, Some(make)) => Some(StageSource::Program(make, setup.model.fingerprint()?)),
            (None, None) => None,
        };
        let pipe = match (setup.model.spec(), &source) {
            // A running elastic job's members build nothing collectively: the joiner takes
            // the cut and its stage's state from them.
            (spec, Some(source)) if elastic && setup.joining => {
                let world = cx.comm.clone();
                let own = opts.clone();
                let mut fresh = || match spec {
                    Some(spec) => StageCut::new(spec, agreed_cut(cx, spec)?).map_err(Into::into),
                    None => program_cut(cx, source, &own),
                };
                let (pipe, step, lineage) = elastic::join(world, source, opts, &mut fresh)?;
                (held.committed, held.at, held.lineage) = (step, step, lineage);
                pipe
            }
            (Some(spec), _) => {
                let ranges = agreed_cut(cx, spec)?;
                let cut = StageCut::new(spec, ranges)?;
                Pipeline::new(spec, cut, opts, cx.comm.clone())?
            }
            (None, _) => program_stage(cx, setup, opts)?,
        };
        // What backward keeps for one micro-batch: a spec stage's every layer output, a
        // program's stage outputs.
        let activation_bytes = match setup.model.spec() {
            Some(spec) => (spec.infer_io()?[pipe.stage().layers()].iter())
                .map(|(_, out)| 4 * (out.numel() * samples) as u64)
                .sum(),
            None => (pipe.stage().outputs().iter())
                .map(|s| 4 * (s.shape.numel() * samples) as u64)
                .sum(),
        };
        Ok(Self {
            pipe,
            training: std::time::Duration::ZERO,
            warmed_up: None,
            activation_bytes,
            program: setup.model.spec().is_none(),
            elastic: match source {
                Some(source) if elastic => Some((source, held)),
                _ => None,
            },
        })
    }

    /// The pipeline this role runs.
    pub fn pipeline(&mut self) -> &mut Pipeline {
        &mut self.pipe
    }
}

/// This rank's stage of a program's own stage modules. The program cuts the model: the configured number of stages must be its
/// number of modules, and a cut by layers (`stages: [[a, b], ...]`, `split_points`) is
/// refused.
fn program_stage(cx: &mut Cx<'_>, setup: &Setup<'_>, opts: PipelineOptions) -> Result<Pipeline> {
    let p = &cx.config.pipeline;
    let name = setup.model.name();
    let stages = match (&p.split_points, &p.stages) {
        (None, StagesSetting::Count(n)) => *n,
        _ => {
            return Err(TrainError::config(
                "pipeline.stages",
                format!(
                    "`{name}` is cut into stages by its program: give their number \
                     (`stages: N`), not layer ranges or split points"
                ),
            ));
        }
    };
    let Some(make) = setup.model.stages() else {
        return Err(TrainError::config(
            "topology.arch",
            format!(
                "a pipeline trains a model spec or a program's stage modules, and `{name}` is \
                 one module: give its stages to flotilla_burn::UserModule::with_stages"
            ),
        ));
    };
    let (cut, stage) = make(
        cx.rank % stages.max(1),
        &opts.optimizer,
        &opts.device,
        opts.seed,
    )?;
    if cut.stages() != stages {
        return Err(TrainError::config(
            "pipeline.stages",
            format!(
                "`{name}` has {} stage modules, the config {stages} stages",
                cut.stages()
            ),
        ));
    }
    let fingerprint = setup.model.fingerprint()?;
    Pipeline::of(stage, cut, &fingerprint, opts, cx.comm.clone())
}

/// The cut of a program's stage modules, for an elastic pipeline's first generation of
/// joiners only (every member new): the program's own, of the configured number of stages.
fn program_cut(cx: &Cx<'_>, source: &StageSource, opts: &PipelineOptions) -> Result<StageCut> {
    let stages = match cx.config.pipeline.stages {
        StagesSetting::Count(n) => n,
        _ => 0,
    };
    source.cut((0..stages).map(|s| s..s + 1).collect(), opts)
}

/// The stages' layer ranges: as configured when no profile is needed; else planned on rank 0
/// and broadcast (with rank 0's refusal, if it refuses), so that an automatic cut measured on
/// one machine is the same everywhere.
fn agreed_cut(cx: &mut Cx<'_>, spec: &ModelSpec) -> Result<Vec<std::ops::Range<usize>>> {
    if !plan::needs_profile(cx.config, spec) {
        // The same explicit cut on every rank (checked by `StageCut::new`, and by the
        // pipeline's agreement on every option).
        let ranges = plan::configured_cut(cx.config, spec).unwrap_or_default();
        if cx.rank == 0 {
            let layers: Vec<String> = ranges
                .iter()
                .map(|r| format!("{}-{}", r.start, r.end.saturating_sub(1)))
                .collect();
            cx.log(&format!(
                "pipeline: {} stages as configured, layers {}",
                ranges.len(),
                layers.join(" | ")
            ))?;
        }
        return Ok(ranges);
    }
    let bytes = if cx.rank == 0 {
        let planned = plan::plan(cx.config, spec);
        let message: std::result::Result<Vec<[usize; 2]>, String> = match &planned {
            Ok(p) => {
                for line in p.describe(cx.config).lines() {
                    cx.log(line)?;
                }
                Ok(p.ranges().iter().map(|r| [r.start, r.end]).collect())
            }
            Err(e) => Err(e.to_string()),
        };
        let bytes = serde_json::to_vec(&message).unwrap_or_default();
        // Also a refusal: tell the others why before failing, so that none waits for a cut.
        for peer in 1..cx.comm.size() {
            cx.comm.send(peer, PLAN_TAG, &bytes)?;
        }
        planned?;
        bytes
    } else {
        // Profiling takes rank 0 a while (longer than one collective's `timeout_s` on a busy
        // machine): the others wait for the cut as long as for joining the job.
        let wait =
            Duration::from_secs_f64(cx.config.comm.join_timeout_s.max(cx.config.comm.timeout_s));
        cx.comm.recv(0, PLAN_TAG, Instant::now() + wait)?
    };
    let message: std::result::Result<Vec<[usize; 2]>, String> = serde_json::from_slice(&bytes)
        .map_err(|e| TrainError::Protocol {
            peer: 0,
            message: format!("the pipeline's cut: {e}"),
        })?;
    match message {
        Ok(ranges) => Ok(ranges.into_iter().map(|[a, b]| a..b).collect()),
        Err(reason) => Err(TrainError::config(
            "pipeline",
            format!("rank 0 refused the plan: {reason}"),
        )),
    }
}

impl Strategy for PipelineStage {
    fn name(&self) -> &'static str {
        "stage"
    }

    fn evaluation(&self) -> Evaluation {
        Evaluation::Collective
    }

    fn counting(&self) -> Counting {
        Counting::Epochs {
            shards: self.pipe.options().data_parallel,
            index: self.pipe.replica(),
        }
    }

    fn describe(&self, config: &TrainConfig) -> Option<(String, String)> {
        let replicas = self.pipe.options().data_parallel;
        Some((
            format!(
                "{} stages × {replicas} replica(s)",
                self.pipe.cut().stages()
            ),
            format!(
                "strategy pipeline ({}, {} micro-batches){}",
                config.pipeline.schedule,
                config.pipeline.micro_batches,
                match (self.pipe.options(), replicas > 1) {
                    (o, true) if o.zero > 0 => match &o.offload {
                        Some(dir) => format!(
                            ", ZeRO stage {} among the replicas, optimizer state in files under {}",
                            o.zero,
                            dir.display()
                        ),
                        None => format!(", ZeRO stage {} among the replicas", o.zero),
                    },
                    _ => String::new(),
                }
            ),
        ))
    }

    fn writes_checkpoints(&self) -> bool {
        self.pipe.world().rank() == 0
    }

    fn stops_itself(&self) -> bool {
        true
    }

    fn step(&mut self, cx: &mut Cx<'_>, data: &mut Batches, done: u64) -> Result<Step> {
        self.pipe.set_lr(cx.lr_at(done));
        // This step's dropout masks: a function of the run's seed, the rank and the step, so
        // that a resumed stage draws the ones it would have.
        self.pipe
            .set_dropout_seed(dropout_seed(cx.config.model.seed, cx.rank, done));
        let n = data.batch_size();
        // An elastic job's replicas share a fixed global batch, possibly unequally: each
        // weighs its gradient and loss by its share of the samples.
        let global = data.global_batch().filter(|_| self.elastic.is_some());
        let share = global.map(|g| n as f32 / g.max(1) as f32);
        self.pipe.set_share(share);
        if let Some((_, held)) = &mut self.elastic {
            // Until this step finished everywhere, the state from before it.
            held.undo = Some(state::stage_parts(self.pipe.stage())?);
        }
        let (_, batch) = {
            let _span = tracing::info_span!(target: "flotilla::train", "data").entered();
            data.next_batch()?
        };
        let images = if self.pipe.is_first() {
            batch.images
        } else {
            &[]
        };
        let started = std::time::Instant::now();
        let loss = self.pipe.train_batch(images, batch.labels)?;
        if let Some((_, held)) = &mut self.elastic {
            held.at = done + 1;
        }
        match self.warmed_up {
            None => self.warmed_up = Some(self.pipe.compute_time()),
            Some(_) => self.training += started.elapsed(),
        }
        // The last stage of every replica knows its batch's loss; every rank learns the mean.
        let replicas = self.pipe.options().data_parallel;
        let mut sum = [loss.unwrap_or(0.0) * share.unwrap_or(1.0)];
        cx.comm.all_reduce_sum(&mut sum)?;
        if let Some((_, held)) = &mut self.elastic {
            (held.committed, held.undo) = (done + 1, None);
        }
        Ok(Step {
            progressed: true,
            loss: Some(match share {
                Some(_) => sum[0],
                None => sum[0] / replicas as f32,
            }),
            samples: global.unwrap_or(n * replicas) as u64,
            done: None,
        })
    }

    /// An elastic job's next generation: the members agree on each stage's state at the
    /// generation's step, and this rank runs stage `rank % S` of replica `rank / S`
    /// (`pipeline/elastic.rs`).
    fn regroup(&mut self, cx: &mut Cx<'_>) -> Result<()> {
        let Some((source, held)) = &mut self.elastic else {
            return Err(TrainError::config(
                "topology.min_world_size",
                "a fixed-size pipeline cannot change its members",
            ));
        };
        self.pipe.set_lr(cx.config.base_lr());
        let cut = self.pipe.cut().clone();
        let entering = elastic::Entering {
            source,
            opts: self.pipe.options(),
            held: Some((held, self.pipe.stage())),
        };
        let mut known = || Ok(cut.clone());
        let entered = elastic::enter(&**cx.comm, &entering, Some(&cut), &mut known)?;
        if let Some(parts) = &entered.reload {
            state::load_parts(self.pipe.stage_mut(), parts)?;
        }
        self.pipe
            .rejoin(cx.comm.clone(), entered.stage, &source.model())?;
        *held = elastic::Held {
            committed: entered.step,
            at: entered.step,
            undo: None,
            lineage: entered.lineage,
        };
        Ok(())
    }

    /// The hash of the whole model, the same on every rank: each stage's replicas checked
    /// equal, then replica 0's stages' hashes in stage order, hashed.
    fn generation_hash(&mut self, cx: &mut Cx<'_>) -> Result<u64> {
        let mine = self.verify_identical(cx)?.unwrap_or_default();
        let all = cx.comm.all_gather_u64(mine)?;
        let stages = self.pipe.cut().stages().min(all.len());
        let bytes: Vec<u8> = all[..stages].iter().flat_map(|h| h.to_le_bytes()).collect();
        Ok(xxhash_rust::xxh3::xxh3_64(&bytes))
    }

    fn model(&mut self) -> Option<&mut dyn ModelState> {
        Some(self.pipe.stage_mut())
    }

    fn evaluate(&mut self, cx: &mut Cx<'_>) -> Result<EvalStats> {
        let all: Vec<usize> = (0..cx.test.len()).collect();
        let (mut images, mut labels) = (Vec::new(), Vec::new());
        cx.test.fill(&all, &mut images, &mut labels)?;
        if !self.pipe.is_first() {
            images.clear();
        }
        // About EVAL_CHUNK rows of logits a chunk (a sequence model's positions each a row),
        // and never fewer samples than a training batch.
        let per = self.pipe.labels_per_sample().max(1);
        let chunk = (EVAL_CHUNK / per).max(cx.config.data.batch_size);
        self.pipe.evaluate(&images, &labels, chunk)
    }

    fn verify_identical(&mut self, cx: &mut Cx<'_>) -> Result<Option<u64>> {
        let _ = cx;
        // A ZeRO-3 stage's hash comes one group at a time: no replica holds its stage.
        let hash = self.pipe.param_hash()?;
        let Some(group) = self.pipe.replica_group().cloned() else {
            return Ok(Some(hash));
        };
        match crate::eval::differing_hashes(&*group, hash, "has")? {
            None => Ok(Some(hash)),
            Some(which) => Err(TrainError::Divergence(which)),
        }
    }

    fn save_checkpoint(
        &mut self,
        cx: &mut Cx<'_>,
        state: &CheckpointState,
    ) -> Result<Option<PathBuf>> {
        self.pipe.average_buffers()?;
        state::save(&mut self.pipe, &cx.config.telemetry.output, state)
    }

    /// Each stage's running statistics averaged over its replicas, as before a checkpoint.
    fn prepare_model(&mut self, cx: &mut Cx<'_>) -> Result<()> {
        let _ = cx;
        self.pipe.average_buffers()
    }

    fn save_model(&mut self, cx: &mut Cx<'_>, path: &Path) -> Result<Option<PathBuf>> {
        let _ = cx;
        self.pipe.average_buffers()?;
        self.pipe.gather_stage()?;
        state::save_model(&self.pipe, path)
    }

    /// Every rank loads its stage's weights and optimizer state from the checkpoint, read
    /// itself where it sees rank 0's, else sent by rank 0 (`restore.rs`).
    fn restore(&mut self, cx: &mut Cx<'_>, from: &Resume) -> Result<Option<CheckpointState>> {
        // Every rank learns the state first: the stages' files follow (`restore.rs`).
        let resumed = from.share(cx, restore::read_state)?;
        if resumed.is_some() {
            restore::restore(&mut self.pipe, from.dir(), &cx.config.telemetry.output)?;
        }
        if let (Some((_, held)), Some(s)) = (&mut self.elastic, &resumed) {
            (held.committed, held.at) = (s.step, s.step);
        }
        Ok(resumed)
    }

    fn report(&self, cx: &Cx<'_>) -> Option<String> {
        let _ = cx;
        let s = self.pipe.stage();
        let runs = match self.program {
            true => format!("the program's module {}", s.index()),
            false => format!("layers {}..{}", s.layers().start, s.layers().end),
        };
        Some(format!(
            "stage {} of replica {}: {runs}, {} parameters, at most {} micro-batches in flight",
            s.index(),
            self.pipe.replica(),
            s.num_params(),
            s.peak_in_flight()
        ))
    }

    fn figures(&self, cx: &Cx<'_>) -> Vec<(&'static str, f64)> {
        let _ = cx;
        let compute = self.pipe.compute_time() - self.warmed_up.unwrap_or_default();
        let training = self.training.as_secs_f64();
        let peak = self.pipe.stage().peak_in_flight();
        let mut figures = vec![
            ("stage", self.pipe.stage_index() as f64),
            ("peak_in_flight", peak as f64),
            (
                "peak_activation_mib",
                (self.activation_bytes * peak as u64) as f64 / (1u64 << 20) as f64,
            ),
            ("compute_s", compute.as_secs_f64()),
            ("training_s", training),
            // The share of training time this stage waited (bubble and communication).
            (
                "idle_fraction",
                1.0 - compute.as_secs_f64() / training.max(1e-9),
            ),
        ];
        // The optimizer state this rank holds (its stage's; with ZeRO its shard of it).
        match self.pipe.optimizer_state_bytes() {
            Ok(b) => figures.push(("optimizer_state_bytes", b as f64)),
            Err(e) => tracing::warn!("optimizer_state_bytes: {e}"),
        }
        figures
    }
}
