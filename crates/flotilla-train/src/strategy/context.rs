//! What every strategy is given by the run ([`Cx`]: the process group, the config, the test
//! set, the log and the front end) and what it is built from ([`Setup`]: the model spec and
//! the job's shape, from which it builds the engine it owns).

use std::sync::Arc;

use flotilla_cluster::Topology;
use flotilla_data::Samples;
use flotilla_engine::{
    BurnEngine, Engine, ModelSpec, OptimizerSpec, ShardSink, StageCut, StageEngine,
};
use flotilla_tcp::ProcessGroup;

use crate::config::TrainConfig;
use crate::error::Result;
use crate::fault::Fault;
use crate::observe::Observer;
use crate::runlog::RunLog;

/// What every strategy is given by the run: the group, the config, the test set, the
/// schedule's length, the log, the front end and a test fault. A strategy's model is its own
/// (given at construction), never the context's.
pub struct Cx<'a> {
    /// The process group (collectives and tagged point-to-point messages).
    pub comm: &'a Arc<dyn ProcessGroup>,
    /// The run configuration.
    pub config: &'a TrainConfig,
    /// The test set (a text's validation windows).
    pub test: &'a dyn Samples,
    /// This process's rank.
    pub rank: usize,
    /// Units of progress the run will take (steps, or server rounds): the length of the
    /// learning-rate schedule.
    pub rounds: u64,
    /// This rank's log.
    pub log: &'a mut RunLog,
    /// The front end.
    pub observer: &'a mut dyn Observer,
    /// A fault to inject (tests).
    pub fault: Option<Fault>,
}

impl Cx<'_> {
    /// Writes a line to the run log and the front end.
    pub fn log(&mut self, line: &str) -> Result<()> {
        self.observer.message(line);
        self.log.line(line)
    }

    /// Writes a line to the run log only (per-round timings).
    pub fn log_quiet(&mut self, line: &str) -> Result<()> {
        self.log.line(line)
    }

    /// The learning rate at `step` (0-based) of the run's schedule.
    pub fn lr_at(&self, step: u64) -> f64 {
        let s = &self.config.schedule;
        s.lr_schedule.lr_at_floor(
            self.config.base_lr(),
            step,
            self.rounds,
            s.warmup_steps,
            s.min_lr_ratio,
        )
    }
}

/// What a model takes and gives, as the job's data is checked against it before any step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelIo {
    /// One sample's shape: `[C, H, W]` (an image) or `[T]` (a window of token ids).
    pub input: Vec<usize>,
    /// The vocabulary of its token ids, if it takes tokens (`None`: real-valued input).
    pub vocab: Option<usize>,
    /// The classes its logits are over (per position), when known before it runs (a spec's
    /// from its layers, a user's module's from the logits of one sample).
    pub classes: Option<usize>,
    /// Labels per sample: 1 for a classifier, `T` for a sequence model.
    pub labels_per_sample: usize,
}

/// What a run trains, built the same way on every rank as the whole model's [`Engine`]: a
/// spec's model ([`ModelSpec`]: a YAML or built-in model), or a user's own burn module
/// (`flotilla_burn`'s, over [`flotilla_engine::ModuleEngine`]). The one model abstraction
/// every strategy is built over.
pub trait ModelSource {
    /// The model's name (logs, checkpoints).
    fn name(&self) -> &str;

    /// What the ranks must agree on about the model, in the job's hash (a spec's canonical
    /// text; a module's parameter names and shapes): ranks of different models are refused
    /// at the rendezvous.
    fn fingerprint(&self) -> Result<String>;

    /// What one sample in and out looks like.
    fn io(&self) -> Result<ModelIo>;

    /// The model as a spec, when it is one: a pipeline cuts its stages from it.
    fn spec(&self) -> Option<&ModelSpec> {
        None
    }

    /// The whole model on the named device, its initial parameters drawn from `seed`,
    /// trained by `optimizer`.
    fn engine(&self, optimizer: &OptimizerSpec, device: &str, seed: u64)
    -> Result<Box<dyn Engine>>;

    /// The model as an engine that runs it one backward group at a time: what ZeRO-3
    /// gathers one at a time and recomputation recomputes by (a spec's groups: at most
    /// `group_bytes`; a user's module's: its stage modules). With `sink` (ZeRO-3's fresh
    /// start), the whole model that never is whole on this rank: its parameters drawn from
    /// `seed` as [`ModelSource::engine`] draws them, one layer (or tensor) at a time, each
    /// handed to `sink` and released ([`BurnEngine::new_released`]); without, the whole model.
    /// `None`: this model does not run so (a user's module given without stage modules).
    fn grouped_engine(
        &self,
        optimizer: &OptimizerSpec,
        (device, seed): (&str, u64),
        group_bytes: usize,
        sink: Option<&mut dyn ShardSink>,
    ) -> Option<Result<Box<dyn Engine>>> {
        let _ = (optimizer, device, seed, group_bytes, sink);
        None
    }

    /// When the model is a program's own pipeline stages (one module per stage): what
    /// builds them ([`StageMaker`]). `None`: a spec (its pipeline is cut by the planner) or
    /// a module not cut into stages.
    fn stages(&self) -> Option<StageMaker> {
        None
    }
}

/// What builds a program's own pipeline stages: given `(index, optimizer, device, seed)`,
/// the cut and stage `index` of it on the named device, its initial parameters drawn from
/// `seed` as the whole model's. Owned, so that an elastic pipeline's member builds another
/// stage when the members change.
pub type StageMaker = Arc<
    dyn Fn(usize, &OptimizerSpec, &str, u64) -> Result<(StageCut, Box<dyn StageEngine>)>
        + Send
        + Sync,
>;

impl ModelSource for ModelSpec {
    fn name(&self) -> &str {
        &self.name
    }

    fn fingerprint(&self) -> Result<String> {
        Ok(self.to_yaml())
    }

    fn io(&self) -> Result<ModelIo> {
        Ok(ModelIo {
            input: self.input.clone(),
            vocab: self.token_vocab(),
            classes: Some(self.classes()?),
            labels_per_sample: self.labels_per_sample()?,
        })
    }

    fn spec(&self) -> Option<&ModelSpec> {
        Some(self)
    }

    fn engine(
        &self,
        optimizer: &OptimizerSpec,
        device: &str,
        seed: u64,
    ) -> Result<Box<dyn Engine>> {
        Ok(Box::new(BurnEngine::new(self, optimizer, device, seed)?))
    }

    fn grouped_engine(
        &self,
        optimizer: &OptimizerSpec,
        (device, seed): (&str, u64),
        group_bytes: usize,
        sink: Option<&mut dyn ShardSink>,
    ) -> Option<Result<Box<dyn Engine>>> {
        let engine = match sink {
            Some(sink) => {
                BurnEngine::new_released(self, optimizer, (device, seed), group_bytes, sink)
            }
            None => BurnEngine::new(self, optimizer, device, seed).and_then(|mut e| {
                e.set_backward_group_bytes(group_bytes)?;
                Ok(e)
            }),
        };
        Some(
            engine
                .map(|e| Box::new(e) as Box<dyn Engine>)
                .map_err(Into::into),
        )
    }
}

/// What a strategy is built from besides the run's context: the model and the job's shape.
pub struct Setup<'a> {
    /// What the run trains.
    pub model: &'a dyn ModelSource,
    /// The job's topology (each rank's role, parents and children).
    pub topology: &'a Topology,
    /// Samples in the training set (a parameter-server job counts its rounds in them).
    pub samples: usize,
    /// This process joins a running elastic job: its state comes from the members, which
    /// take part in no collective of a build (they are training).
    pub joining: bool,
}

impl Setup<'_> {
    /// The whole model as an engine of `config`'s device and seed, trained by `optimizer`
    /// (a server's may differ from the configured one), recomputing its forward in backward
    /// when `model.recompute`: what every strategy but a pipeline stage owns.
    pub fn engine(
        &self,
        config: &TrainConfig,
        optimizer: &OptimizerSpec,
    ) -> Result<Box<dyn Engine>> {
        let m = &config.model;
        // A program's module recomputes by its stage modules; a spec by its own segments.
        let grouped = (m.recompute && self.model.spec().is_none())
            .then(|| {
                self.model
                    .grouped_engine(optimizer, (&m.device, m.seed), 0, None)
            })
            .flatten();
        let mut engine = match grouped {
            Some(engine) => engine?,
            None => self.model.engine(optimizer, &m.device, m.seed)?,
        };
        if m.recompute {
            engine.set_recompute(true)?;
        }
        Ok(engine)
    }
}
