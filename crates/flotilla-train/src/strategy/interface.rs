//! The one interface every way of training implements (PyTorch Lightning's word for DDP- or
//! DeepSpeed-like ways): a [`Strategy`] is what one rank does in a job (a sync or async
//! all-reduce peer, a parameter-server worker, root, shard or local server, a pipeline
//! stage). The run loop ([`crate::runloop`]) drives any of them the same way and does data,
//! schedule, evaluation, checkpoints and progress reports once, for all of them.

use std::path::PathBuf;
use std::sync::Arc;

use flotilla_comm::ProcessGroup;
use flotilla_data::ImageDataset;
use flotilla_engine::{Engine, EvalStats, ModelState};

use crate::batches::Batches;
use crate::checkpoint::{self, CheckpointState};
use crate::config::TrainConfig;
use crate::error::{Result, TrainError};
use crate::fault::Fault;
use crate::observe::Observer;
use crate::runlog::RunLog;

/// Who evaluates a role's model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Evaluation {
    /// Every rank takes part in evaluating (sync data-parallel peers each evaluate their share
    /// of the test set and the sums are all-reduced; pipeline stages evaluate together), and
    /// every rank gets the result.
    Collective,
    /// This rank alone evaluates the whole test set (the root of a parameter server).
    Local,
    /// The role holds no model of its own to evaluate (workers, local and shard servers).
    None,
}

/// What one call of [`Strategy::step`] did.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Step {
    /// A unit of progress was completed (an optimizer step, a pushed round, a server
    /// round); `false` for server events that completed nothing (a pull answered).
    pub progressed: bool,
    /// The training loss of that unit, when the role knows it (global mean for peers).
    pub loss: Option<f32>,
    /// Samples trained on in that unit, over all ranks.
    pub samples: u64,
    /// The role has stopped (told to by its server); the reason.
    pub done: Option<String>,
}

/// What a rank's role is given: the group, the config, the engine, the data sets, the log.
pub struct Cx<'a> {
    /// The process group (collectives and tagged point-to-point messages).
    pub comm: &'a Arc<dyn ProcessGroup>,
    /// The run configuration.
    pub config: &'a TrainConfig,
    /// This process's whole-model engine; `None` for roles that hold their own part of the
    /// model (pipeline stages). See [`Cx::engine`].
    pub engine: Option<&'a mut dyn Engine>,
    /// The training set.
    pub train: &'a ImageDataset,
    /// The test set.
    pub test: &'a ImageDataset,
    /// This process's rank.
    pub rank: usize,
    /// Workers of a parameter-server topology (for data sharding), else the world size.
    pub num_workers: usize,
    /// Units of progress the run will take (steps, or server rounds).
    pub rounds: u64,
    /// Parameter servers: evaluate every this many rounds (0: only at the end).
    pub eval_every: u64,
    /// This rank's log.
    pub log: &'a mut RunLog,
    /// The front end.
    pub observer: &'a mut dyn Observer,
    /// A fault to inject (tests).
    pub fault: Option<Fault>,
    /// The newest evaluation.
    pub last_eval: Option<EvalStats>,
    /// The momentum the root runs and the one suggested for its staleness, when its updates are stale
    /// (a parameter server with async levels), for the advice of [`crate::divergence`].
    pub async_momentum: Option<(f64, f64)>,
}

impl Cx<'_> {
    /// This process's whole-model engine; an error for a role that has none.
    pub fn engine(&mut self) -> Result<&mut dyn Engine> {
        match self.engine.as_deref_mut() {
            Some(e) => Ok(e),
            None => Err(TrainError::config(
                "role",
                "this role holds no whole-model engine",
            )),
        }
    }

    /// This process's whole-model engine, to read; an error for a role that has none.
    pub fn engine_ref(&self) -> Result<&dyn Engine> {
        match self.engine.as_deref() {
            Some(e) => Ok(e),
            None => Err(TrainError::config(
                "role",
                "this role holds no whole-model engine",
            )),
        }
    }

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
        s.lr_schedule
            .lr_at(self.config.base_lr(), step, self.rounds, s.warmup_steps)
    }
}

/// One rank's part in a training job.
pub trait Strategy {
    /// `peer`, `worker`, `root`, `shard-server` or `local-server`.
    fn name(&self) -> &'static str;

    /// Who evaluates this role's model.
    fn evaluation(&self) -> Evaluation;

    /// Whether this rank writes the job's checkpoints.
    fn writes_checkpoints(&self) -> bool {
        false
    }

    /// Whether the run loop stops this role after the planned units of progress (peers, the
    /// root); other roles run until their server stops them.
    fn stops_itself(&self) -> bool {
        false
    }

    /// Agrees on the initial state with the other ranks (broadcast, first pull).
    fn start(&mut self, cx: &mut Cx<'_>) -> Result<()> {
        let _ = cx;
        Ok(())
    }

    /// One unit of work; `done` units of progress were completed before. Roles that train
    /// take their batches from `data`.
    fn step(&mut self, cx: &mut Cx<'_>, data: &mut Batches<'_>, done: u64) -> Result<Step>;

    /// Makes the engine hold the whole current model (the root gathers the other shards; an
    /// async peer applies the steps it has in flight). The default hooks call it on every rank
    /// that takes part, before evaluating, checking parameters and writing a checkpoint.
    fn prepare_model(&mut self, cx: &mut Cx<'_>) -> Result<()> {
        let _ = cx;
        Ok(())
    }

    /// The run loop ends the run (planned progress done, or target accuracy reached):
    /// servers tell everyone below them.
    fn stop(&mut self, cx: &mut Cx<'_>, reason: &str) -> Result<()> {
        let _ = (cx, reason);
        Ok(())
    }

    /// A last line for the log about how the role's run went, if it has one.
    fn report(&self, cx: &Cx<'_>) -> Option<String> {
        let _ = cx;
        None
    }

    /// The role's own figures for the run summary (e.g. a root's `updates_per_s`).
    fn figures(&self, cx: &Cx<'_>) -> Vec<(&'static str, f64)> {
        let _ = cx;
        Vec::new()
    }

    /// The parameters this role holds itself, when they are not the whole-model engine of
    /// [`Cx::engine`] (a pipeline stage's).
    fn own_model(&mut self) -> Option<&mut dyn ModelState> {
        None
    }

    /// Evaluates the model on the test set; called on every rank of a role whose
    /// [`Strategy::evaluation`] is not `None`. By default: the engine, split across the group
    /// (collective) or whole (local, after [`Strategy::prepare_model`]).
    fn evaluate(&mut self, cx: &mut Cx<'_>) -> Result<EvalStats> {
        match self.evaluation() {
            Evaluation::Collective => {
                self.prepare_model(cx)?;
                let (comm, test) = (cx.comm.clone(), cx.test);
                crate::eval::distributed(cx.engine()?, &*comm, test)
            }
            Evaluation::Local | Evaluation::None => {
                self.prepare_model(cx)?;
                let test = cx.test;
                crate::eval::full(cx.engine()?, test)
            }
        }
    }

    /// Checks at the end of a run that the ranks that should hold the same parameters do, and
    /// returns their hash (collective roles; `None` for others).
    fn verify_identical(&mut self, cx: &mut Cx<'_>) -> Result<Option<u64>> {
        if self.evaluation() != Evaluation::Collective {
            return Ok(None);
        }
        self.prepare_model(cx)?;
        let comm = cx.comm.clone();
        crate::eval::verify_identical(cx.engine()?, &*comm).map(Some)
    }

    /// Writes a checkpoint with `state`; called on every rank when one is due. By default
    /// every rank runs [`Strategy::prepare_model`], then the rank that
    /// [`Strategy::writes_checkpoints`] saves the engine and returns the directory.
    fn save_checkpoint(
        &mut self,
        cx: &mut Cx<'_>,
        state: &CheckpointState,
    ) -> Result<Option<PathBuf>> {
        self.prepare_model(cx)?;
        if !self.writes_checkpoints() {
            return Ok(None);
        }
        let output = cx.config.telemetry.output.clone();
        checkpoint::save(&output, cx.engine()?, state).map(Some)
    }
}
