//! What can go wrong in a data-parallel run of a user's model.

use flotilla_engine::EngineError;
use flotilla_group::CommError;

/// An error of [`crate::DataParallel`] and the other modes of this crate.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    /// The process group failed (a lost rank, a deadline, a protocol error).
    #[error(transparent)]
    Comm(#[from] CommError),
    /// The job's settings are wrong, joining it failed (the error names the key or rank), or
    /// its run failed.
    #[error(transparent)]
    Settings(Box<flotilla_train::TrainError>),
    /// A run of [`crate::train`] failed outside training itself (its telemetry, its
    /// report).
    #[error(transparent)]
    Run(Box<flotilla_rank::RankError>),
    /// A data set could not be set up (a sharded data set's rank outside its world).
    #[error(transparent)]
    Data(#[from] flotilla_data::DataError),
    /// Reading or writing the model's tensors failed.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The ranks' models do not have the same parameter tensors (names, shapes, order), so
    /// their gradients cannot be summed position by position.
    #[error("the ranks' models differ: {0}")]
    ModelsDiffer(String),
    /// The optimizer state broadcast by rank 0 could not be saved or loaded.
    #[error("optimizer state: {0}")]
    Optimizer(String),
    /// A step's output from another rank could not be read or combined.
    #[error("a step's output of the ranks: {0}")]
    Output(String),
    /// The ranks' data loaders disagree (one ran out of batches before the others).
    #[error("the ranks' data loaders disagree: {0}")]
    Loaders(String),
    /// A synchronized batch norm's sum over the ranks failed.
    #[error("synchronized batch norm: {0}")]
    BatchNormSync(String),
    /// The members of an elastic job change ([`crate::elastic::ElasticRun::commit`]):
    /// returned to the training closure after the same step on every member, which
    /// returns it, and [`crate::elastic::run`] goes on in the next generation.
    #[error("the job's members change: return this error from the training closure")]
    MembershipChanged,
    /// The program's own error, from inside an elastic run's training closure
    /// ([`DistError::program`]): it ends the run as it is.
    #[error(transparent)]
    Program(Box<dyn std::error::Error + Send + Sync + 'static>),
    /// Writing a checkpoint failed.
    #[error("writing {path}: {source}")]
    Write {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

impl DistError {
    /// The program's own error `e` (an `anyhow::Error`, an I/O error, ...) as this crate's,
    /// to return it from a closure that returns [`Result`]: `.map_err(DistError::program)?`.
    pub fn program(e: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>) -> Self {
        Self::Program(e.into())
    }

    /// Whether this says that an elastic job finished while this process stood by (its
    /// generations had no whole pipeline replica with a place for it): nothing is left for
    /// it to do, and a program ends as the job did, with success
    /// ([`flotilla_train::elastic::stood_by`]).
    pub fn stood_by(&self) -> bool {
        match self {
            Self::Settings(e) => flotilla_train::elastic::stood_by(e),
            Self::Comm(CommError::Rendezvous(flotilla_group::RendezvousError::StoodBy {
                ..
            })) => true,
            _ => false,
        }
    }
}

/// The result type of this crate.
pub type Result<T, E = DistError> = std::result::Result<T, E>;

impl From<flotilla_train::TrainError> for DistError {
    fn from(e: flotilla_train::TrainError) -> Self {
        Self::Settings(Box::new(e))
    }
}

impl From<flotilla_rank::RankError> for DistError {
    fn from(e: flotilla_rank::RankError) -> Self {
        match e {
            flotilla_rank::RankError::Train(e) => Self::Settings(Box::new(e)),
            other => Self::Run(Box::new(other)),
        }
    }
}

#[cfg(test)]
mod tests {
    use flotilla_group::RendezvousError;

    use super::*;

    #[test]
    fn a_job_that_finished_while_this_process_stood_by_is_told_from_failures() {
        let stood_by = || CommError::Rendezvous(RendezvousError::StoodBy { generation: 3 });
        let run = DistError::from(flotilla_train::TrainError::Comm(stood_by()));
        assert!(run.stood_by(), "{run}");
        assert!(DistError::Comm(stood_by()).stood_by());
        let refused = CommError::Config("no such setting".into());
        assert!(!DistError::from(flotilla_train::TrainError::Comm(refused)).stood_by());
        assert!(!DistError::Loaders("short".into()).stood_by());
    }
}
