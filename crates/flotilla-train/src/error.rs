//! The training layer's error type.

use std::path::PathBuf;

/// Everything that can stop a training run.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The run configuration is invalid.
    #[error("{source_name}: {message}")]
    Config {
        /// Where the config came from (a path, `<defaults>`, `--flag`).
        source_name: String,
        /// What is wrong.
        message: String,
    },
    /// The tensor engine failed.
    #[error(transparent)]
    Engine(#[from] flotilla_engine::EngineError),
    /// Communication with other ranks failed.
    #[error(transparent)]
    Comm(#[from] flotilla_tcp::CommError),
    /// The data set could not be read.
    #[error(transparent)]
    Data(#[from] flotilla_data::DataError),
    /// A peer sent something that breaks the protocol (malformed or unexpected message).
    #[error("protocol error with rank {peer}: {message}")]
    Protocol {
        /// The sender.
        peer: usize,
        /// What was wrong.
        message: String,
    },
    /// A parameter-server round could not complete because of a named peer (missing,
    /// lost, or silent past its deadline).
    #[error("{message}")]
    Peer {
        /// The rank at fault.
        peer: usize,
        /// What happened.
        message: String,
    },
    /// A parameter server refused this rank's push for a reason no retry changes, or refused
    /// [`crate::strategy::ps::MAX_REFUSED_IN_A_ROW`] retries in a row.
    #[error("rank {parent} refused this rank's push {how}: {reason}")]
    PushRefused {
        /// The server that refused it.
        parent: usize,
        /// `for good`, or how many times in a row.
        how: String,
        /// The server's reason (the last one's).
        reason: String,
    },
    /// A local server's push up stayed unanswered past the deadline.
    #[error("local server: no answer from rank {peer} within {after:?}")]
    ParentSilent {
        /// The parent.
        peer: usize,
        /// The deadline.
        after: std::time::Duration,
    },
    /// An elastic ZeRO job's new generation cannot put its optimizer state together: the
    /// ranks that held some shard (its own and the one before it) all left.
    #[error("ZeRO: the optimizer state cannot be put together: {0}")]
    ShardsLost(String),
    /// Ranks ended with different parameters (a broken invariant, never expected).
    #[error("parameters differ across ranks after training: {0}")]
    Divergence(String),
    /// Training diverged (NaN or infinite loss) or is not learning, and
    /// `abort_on_divergence` says to stop (see [`crate::divergence`]).
    #[error("{verdict}; {advice}")]
    NotLearning {
        /// What the check found.
        verdict: crate::divergence::Verdict,
        /// What to change.
        advice: String,
    },
    /// A checkpoint could not be written or read.
    #[error("checkpoint {path}: {message}")]
    Checkpoint {
        /// The file or directory concerned.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// A preset name (`flotilla compare --strategies`) that [`crate::presets::PRESETS`] does not have.
    #[error("unknown strategy `{name}` (known: {known})")]
    UnknownPreset {
        /// The name given.
        name: String,
        /// The known names, comma-separated.
        known: String,
    },
    /// An I/O error with the path it concerned. The message carries the reason itself (not as
    /// a `source`), so an error chain printed whole does not say it twice.
    #[error("{path}: {error}")]
    Io {
        /// The file or directory concerned.
        path: PathBuf,
        /// The underlying error.
        error: std::io::Error,
    },
}

impl TrainError {
    /// Wraps an I/O error with the path it concerned.
    pub fn io(path: impl Into<PathBuf>, error: std::io::Error) -> Self {
        TrainError::Io {
            path: path.into(),
            error,
        }
    }

    /// Whether this is a wait that reached its deadline (a silent peer), rather than a lost
    /// or misbehaving one: a rank that only waited too long for its parent must not fail
    /// that parent, which is itself waiting for the rank at fault and will name it.
    pub fn is_deadline(&self) -> bool {
        use flotilla_tcp::CommError;
        matches!(
            self,
            TrainError::Comm(
                CommError::Deadline { .. } | CommError::Timeout { .. } | CommError::Stalled { .. }
            ) | TrainError::ParentSilent { .. }
        )
    }

    /// The rank this error points at, if another rank is at fault.
    pub fn blamed_rank(&self) -> Option<usize> {
        match self {
            TrainError::Comm(e) => e.blamed_rank(),
            TrainError::Protocol { peer, .. }
            | TrainError::Peer { peer, .. }
            | TrainError::ParentSilent { peer, .. } => Some(*peer),
            _ => None,
        }
    }

    /// A config error.
    pub fn config(source_name: impl Into<String>, message: impl Into<String>) -> Self {
        TrainError::Config {
            source_name: source_name.into(),
            message: message.into(),
        }
    }
}

/// The training layer's result type.
pub type Result<T, E = TrainError> = std::result::Result<T, E>;
