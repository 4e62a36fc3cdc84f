//! A run's plan, made before its loop starts: how a strategy counts its progress
//! ([`Counting`]: optimizer steps over epochs of its data, or parameter-server rounds) and what
//! the loop is told ([`LoopPlan`]: how much progress, when to evaluate, where a resumed run
//! stood).

use std::time::Instant;

/// How a strategy counts its progress, and which part of the training data it trains on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counting {
    /// Optimizer steps over epochs of the training data, which `shards` ranks (or pipeline
    /// replicas) train on side by side; this rank on shard `index` (all-reduce peers,
    /// pipeline stages).
    Epochs {
        /// Shards of the data trained on side by side.
        shards: usize,
        /// This rank's shard.
        index: usize,
    },
    /// Parameter-server rounds, `total` of them: each worker takes `local_steps` batches of
    /// its shard a round; this rank trains on `shard` (`(workers, index)`; a server's
    /// `(1, 0)` draws nothing); the root evaluates every `every` rounds.
    Rounds {
        /// Rounds the run takes.
        total: u64,
        /// Evaluate every this many rounds (0: only at the end).
        every: u64,
        /// Rounds that take one epoch of the training data (every worker's batches).
        per_epoch: u64,
        /// Batches a worker takes per round.
        local_steps: usize,
        /// This rank's shard of the data, `(shards, index)`.
        shard: (usize, usize),
    },
}

impl Counting {
    /// Shards of the data trained on side by side: ranks (or replicas) whose batches make
    /// one global batch (for a parameter-server rank: of its own shard).
    pub fn shards(&self) -> usize {
        match *self {
            Counting::Epochs { shards, .. } => shards,
            Counting::Rounds { shard, .. } => shard.0,
        }
    }
}

/// How the run's progress is reported and evaluated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cadence {
    /// In epochs of the role's data: a line per epoch, evaluation every `every` epochs and
    /// at the end (data-parallel peers).
    Epochs {
        /// Evaluate every this many epochs (0: only at the end).
        every: u32,
    },
    /// In rounds: evaluation every `every` rounds (parameter-server root).
    Rounds {
        /// Evaluate every this many rounds (0: only at the end).
        every: u64,
    },
}

/// What the loop needs to know besides the role.
pub struct LoopPlan {
    /// Units of progress to take (steps or rounds), for roles that stop themselves.
    pub total: u64,
    /// Units of progress that take one epoch of the training data (this rank's steps over
    /// its shard; a parameter server's rounds over every worker's).
    pub per_epoch: u64,
    /// Reporting and evaluation cadence.
    pub cadence: Cadence,
    /// Progress already made before this run (a resumed run's step).
    pub resumed_at: u64,
    /// The model's name and the cluster hash (for checkpoints).
    pub model: String,
    /// The cluster config hash.
    pub config_hash: u64,
    /// When the process started (for wall times).
    pub started: Instant,
    /// Ranks (or pipeline replicas) whose batches make one global batch, for the samples per
    /// second of an epoch.
    pub workers: usize,
    /// The momentum the root runs and the one suggested for its staleness, when its updates
    /// are stale (a parameter server with async levels), for the advice of
    /// [`crate::divergence`].
    pub async_momentum: Option<(f64, f64)>,
}
