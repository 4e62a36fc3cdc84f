//! What can stop a rank's process outside training itself: its telemetry, its report.

use std::path::PathBuf;

use flotilla_train::TrainError;

impl RankError {
    /// Whether the job finished while this process stood by, which ends it as the job
    /// ended, not as a failure ([`flotilla_train::elastic::stood_by`]).
    pub fn stood_by(&self) -> bool {
        matches!(self, RankError::Train(e) if flotilla_train::elastic::stood_by(e))
    }
}

/// A rank's failure: the run's own ([`TrainError`]), or its telemetry's or report's.
#[derive(Debug, thiserror::Error)]
pub enum RankError {
    /// The run failed.
    #[error(transparent)]
    Train(#[from] TrainError),
    /// The threads the run's steps execute on could not be started.
    #[error("cannot start the rank's step threads: {0}")]
    Threads(String),
    /// A file of the rank's telemetry or report could not be read or written.
    #[error("cannot {what} {}", path.display())]
    File {
        /// What was done (`write`, `read`, `create the directory`).
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// Why it failed.
        #[source]
        source: std::io::Error,
    },
    /// `summary.json` could not be made or parsed.
    #[error("summary {}: {detail}", path.display())]
    Summary {
        /// The summary's path.
        path: PathBuf,
        /// What is wrong with it.
        detail: String,
    },
    /// A plot could not be drawn.
    #[error("drawing {}: {detail}", path.display())]
    Plot {
        /// The plot's file.
        path: PathBuf,
        /// What plotters said.
        detail: String,
    },
    /// The rank's telemetry (tracing subscriber, timeline, metrics recorder) could not start.
    #[error("telemetry: {0}")]
    Telemetry(String),
}

/// A rank's result.
pub type Result<T, E = RankError> = std::result::Result<T, E>;

impl RankError {
    /// A failed file operation.
    pub fn file(what: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::File {
            what,
            path: path.into(),
            source,
        }
    }
}
