//! What every strategy is given by the run ([`Cx`]: the process group, the config, the
//! data sets, the log and the front end) and what it is built from ([`Setup`]).

use std::sync::Arc;

use flotilla_cluster::Topology;
use flotilla_comm::ProcessGroup;
use flotilla_data::ImageDataset;
use flotilla_engine::{Engine, EvalStats, ModelSpec};

use crate::config::TrainConfig;
use crate::error::{Result, TrainError};
use crate::fault::Fault;
use crate::observe::Observer;
use crate::runlog::RunLog;

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

/// What a strategy is built from besides the run's context: the model and the job's shape.
pub struct Setup<'a> {
    /// The model spec (resolved).
    pub spec: &'a ModelSpec,
    /// The job's topology (each rank's role, parents and children).
    pub topology: &'a Topology,
    /// Samples in the training set (a parameter-server job counts its rounds in them).
    pub samples: usize,
}
