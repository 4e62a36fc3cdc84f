//! The one interface every way of training implements (PyTorch Lightning's word for DDP- or
//! DeepSpeed-like ways): a [`Strategy`] is what one rank does in a job (a sync or async
//! all-reduce peer, a parameter-server worker, root, shard or local server, a pipeline
//! stage). The run loop ([`crate::runloop`]) drives any of them the same way and does data,
//! schedule, evaluation, checkpoints and progress reports once, for all of them.

use std::path::{Path, PathBuf};

use flotilla_engine::{EvalStats, ModelState};
use flotilla_tcp::StallPolicy;

use super::context::Cx;
use super::resume::Resume;
use crate::batches::Batches;
use crate::checkpoint::{self, CheckpointState};
use crate::config::TrainConfig;
use crate::error::{Result, TrainError};
use crate::plan::Counting;

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

/// A way of training, as one rank takes part in it.
pub trait Strategy {
    /// `peer`, `stage`, `worker`, `root`, `shard-server` or `local-server`.
    fn name(&self) -> &'static str;

    /// Who evaluates this role's model.
    fn evaluation(&self) -> Evaluation;

    /// How the run counts this strategy's progress, and the part of the data it trains on.
    fn counting(&self) -> Counting;

    /// What the line that starts training says of the strategy of `config`, `(what, how)`:
    /// e.g. `("61706 params", "2 buckets, strategy sync-allreduce")`; `None` for strategies
    /// that say what they are when they start (parameter servers).
    fn describe(&self, config: &TrainConfig) -> Option<(String, String)> {
        let _ = config;
        None
    }

    /// How long the world group's collectives may stall before every rank stops, for
    /// strategies whose steps are collectives of the world (all-reduce peers): the run
    /// watches them from before [`Strategy::start`] to its end. `None`: not watched.
    fn stall_policy(&self, config: &TrainConfig) -> Option<StallPolicy> {
        let _ = config;
        None
    }

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

    /// Takes `cx.comm`, an elastic job's next generation, in place of the group it had
    /// (its model and optimizer state kept; [`Strategy::start`] then agrees on them with
    /// the new members). `Err` names what keeps this way of training from changing its
    /// members (the default).
    fn regroup(&mut self, cx: &mut Cx<'_>) -> Result<()> {
        let _ = cx;
        Err(crate::error::TrainError::config(
            "topology.min_world_size",
            format!("the `{}` role cannot change its members yet", self.name()),
        ))
    }

    /// The first step (the run's count) whose update is not in the model yet, for a role
    /// that applies steps after it counts them (an async all-reduce peer's oldest step in
    /// flight); `None`: every step counted is applied. An elastic job goes on from there, so
    /// that steps lost with a generation are redone.
    fn applied_until(&self) -> Option<u64> {
        None
    }

    /// One unit of work; `done` units of progress were completed before. Roles that train
    /// take their batches from `data`.
    fn step(&mut self, cx: &mut Cx<'_>, data: &mut Batches, done: u64) -> Result<Step>;

    /// Makes its model the whole current model (the root gathers the other shards; an
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

    /// The parameters this rank holds: its whole-model engine, or a pipeline stage's part of
    /// the model; `None` for a rank that holds none of its own (a local server passes its
    /// parent's on).
    fn model(&mut self) -> Option<&mut dyn ModelState>;

    /// Evaluates the model on the test set; called on every rank of a strategy whose
    /// [`Strategy::evaluation`] is not `None`, which evaluates its own model (after
    /// [`Strategy::prepare_model`], as it needs). A strategy that does not evaluate refuses.
    fn evaluate(&mut self, cx: &mut Cx<'_>) -> Result<EvalStats> {
        let _ = cx;
        Err(TrainError::config(
            "evaluation",
            format!("a {} does not evaluate", self.name()),
        ))
    }

    /// Checks at the end of a run that the ranks that should hold the same parameters do, and
    /// returns their hash (collective roles; `None` for others).
    fn verify_identical(&mut self, cx: &mut Cx<'_>) -> Result<Option<u64>> {
        if self.evaluation() != Evaluation::Collective {
            return Ok(None);
        }
        self.prepare_model(cx)?;
        let comm = cx.comm.clone();
        match self.model() {
            Some(model) => crate::eval::verify_identical(model, &*comm).map(Some),
            None => Ok(None),
        }
    }

    /// The parameters' hash an elastic generation's start logs, checked the same on every
    /// member (collective): by default this rank's model checked against every rank's.
    fn generation_hash(&mut self, cx: &mut Cx<'_>) -> Result<u64> {
        let comm = cx.comm.clone();
        let model = self.model().ok_or_else(|| {
            TrainError::config("topology.min_world_size", "this role holds no model")
        })?;
        crate::eval::verify_identical(model, &*comm)
    }

    /// Writes a checkpoint with `state`; called on every rank when one is due. By default
    /// every rank runs [`Strategy::prepare_model`], then the rank that
    /// [`Strategy::writes_checkpoints`] saves its model and returns the directory.
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
        match self.model() {
            Some(model) => checkpoint::save(&output, model, state).map(Some),
            None => Ok(None),
        }
    }

    /// Writes the whole model's parameters to `path` (safetensors under the model's own
    /// names: a checkpoint's `model.safetensors`), atomically; called on every rank after the
    /// same step. By default every rank runs [`Strategy::prepare_model`], then the rank that
    /// [`Strategy::writes_checkpoints`] writes its model and returns the file.
    fn save_model(&mut self, cx: &mut Cx<'_>, path: &Path) -> Result<Option<PathBuf>> {
        save_whole_model(self, cx, path)
    }

    /// Restores this rank from the checkpoint the run resumes from (`from`) and returns its
    /// state, which every rank learns (`None` for a fresh start); collective over the world,
    /// beside [`Strategy::save_checkpoint`]. By default rank 0 loads the checkpoint into its
    /// model (parameters and optimizer state), and [`Strategy::start`]'s initial broadcast
    /// hands them to every rank.
    fn restore(&mut self, cx: &mut Cx<'_>, from: &Resume) -> Result<Option<CheckpointState>> {
        let model = self.model();
        from.share(cx, |dir| match model {
            Some(model) => checkpoint::load(dir, model),
            None => checkpoint::read_state(dir),
        })
    }
}

/// [`Strategy::save_model`]'s default, for a strategy whose writing rank holds the whole
/// model once [`Strategy::prepare_model`] has run.
pub(crate) fn save_whole_model<S: Strategy + ?Sized>(
    strategy: &mut S,
    cx: &mut Cx<'_>,
    path: &Path,
) -> Result<Option<PathBuf>> {
    strategy.prepare_model(cx)?;
    if !strategy.writes_checkpoints() {
        return Ok(None);
    }
    match strategy.model() {
        Some(model) => crate::model_file::write(path, |tmp| Ok(model.save_weights(tmp)?)).map(Some),
        None => Ok(None),
    }
}
