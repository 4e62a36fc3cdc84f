//! [`PipelineOptions`]: how many stages and micro-batches, which schedule; and where a rank
//! sits in the pipeline ([`Place`]).

use flotilla_comm::pipeline::Schedule;
use flotilla_comm::pipeline::wire::MAX_MICRO_BATCHES;
use flotilla_group::ProcessGroup;

use crate::error::{DistError, Result};

/// How a [`crate::Pipeline`] runs; every rank passes the same (checked).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PipelineOptions {
    /// Stages (S); the group has `S × D` ranks for `D` replicas of every stage.
    pub stages: usize,
    /// Micro-batches per batch (M).
    pub micro_batches: usize,
    /// The micro-batch schedule (1F1B unless set).
    pub schedule: Schedule,
}

/// Where a rank sits: rank `r` of `S × D` is stage `r % S` of replica `r / S`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Place {
    /// The stage this rank runs.
    pub stage: usize,
    /// Its replica (which shard of the data its first stage reads).
    pub replica: usize,
    /// Replicas of every stage (D).
    pub replicas: usize,
}

impl PipelineOptions {
    /// `stages` stages, `micro_batches` micro-batches per batch, the 1F1B schedule.
    pub fn new(stages: usize, micro_batches: usize) -> Self {
        Self {
            stages,
            micro_batches,
            schedule: Schedule::OneFOneB,
        }
    }

    /// `self` with `schedule`.
    pub fn with_schedule(mut self, schedule: Schedule) -> Self {
        self.schedule = schedule;
        self
    }

    /// Where this rank of `group` sits: which stage's module it builds and which shard of the
    /// data it reads. Fails if the stages do not divide the group or there are no
    /// micro-batches (or too many).
    pub fn place(&self, group: &dyn ProcessGroup) -> Result<Place> {
        let (s, world, m) = (self.stages, group.size(), self.micro_batches);
        if s == 0 || world % s != 0 {
            return Err(DistError::Pipeline(format!(
                "{s} stages do not divide the {world} ranks (each replica of the pipeline needs one rank per stage)"
            )));
        }
        if m == 0 || m > MAX_MICRO_BATCHES {
            return Err(DistError::Pipeline(format!(
                "micro_batches must be 1..={MAX_MICRO_BATCHES}, got {m}"
            )));
        }
        Ok(Place {
            stage: group.rank() % s,
            replica: group.rank() / s,
            replicas: world / s,
        })
    }

    /// One line every rank must agree on.
    pub(crate) fn describe(&self) -> String {
        format!(
            "stages {} micro_batches {} schedule {}",
            self.stages, self.micro_batches, self.schedule
        )
    }
}
