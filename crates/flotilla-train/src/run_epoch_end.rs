//! Where a run stands at the end of an epoch, for a caller that closes each epoch between two
//! steps with collectives of its own (burn's `Learner` on an elastic job's members: the model
//! made whole, validated on rank 0, a vote). After a step that ends an epoch (or the run) the
//! epoch end is **open**; [`Run::prepare_model`] makes it **prepared** (a second call does
//! nothing), and [`Run::vote`] closes it. A vote lost with a member leaves it open: the members
//! close it again in the next generation (its rank 0 validates, the lost one may not have). A
//! generation's members agree where they stand at its start, so that a process that joins
//! at an open epoch end takes part in its closing, as the members do, and one that joins
//! after the vote does not.

use flotilla_tcp::ReduceOp;

use super::Run;
use crate::error::Result;

/// How far the end of an epoch has been closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum EpochEnd {
    /// A step ended an epoch (or the run); nothing done since.
    Open = 1,
    /// The model was made whole for it ([`Run::prepare_model`]).
    Prepared = 2,
}

impl EpochEnd {
    fn from_code(code: u64) -> Option<Self> {
        match code {
            1 => Some(Self::Open),
            2 => Some(Self::Prepared),
            _ => None,
        }
    }
}

impl Run {
    /// Whether the run stands at the end of an epoch (or of the run) that its caller has not
    /// closed with [`Run::vote`]: from the step that ended it to the vote (one lost with a
    /// member leaves it open) or the next step. A process that joined an elastic job there
    /// learns it from the members.
    pub fn at_epoch_end(&self) -> bool {
        self.epoch_end().is_some()
    }

    /// The epoch end the run stands at, if one is open at its current step.
    pub(super) fn epoch_end(&self) -> Option<EpochEnd> {
        self.epoch_end
            .filter(|(step, _)| *step == self.state.progress())
            .map(|(_, phase)| phase)
    }

    /// After a step that `progressed`: an epoch end opens when it used up its epoch's
    /// batches or ended the run.
    pub(super) fn mark_epoch_end(&mut self, progressed: bool) {
        let ended = self.batches.epoch_done() || self.state.progress() >= self.plan.total;
        self.epoch_end = (progressed && ended).then(|| (self.state.progress(), EpochEnd::Open));
    }

    /// Moves the open epoch end to `phase`.
    pub(super) fn advance_epoch_end(&mut self, phase: EpochEnd) {
        if let Some(now) = self.epoch_end() {
            self.epoch_end = Some((self.state.progress(), now.max(phase)));
        }
    }

    /// Closes the epoch end (a vote taken, a step begun).
    pub(super) fn close_epoch_end(&mut self) {
        self.epoch_end = None;
    }

    /// Agrees with the generation's members where the epoch end stands (collective at a
    /// generation's start): the furthest any member got, none for a process that joins.
    pub(super) fn agree_epoch_end(&mut self) -> Result<()> {
        let mut code = [self.epoch_end().map_or(0, |phase| phase as u64)];
        self.parts.comm.all_reduce_u64(&mut code, ReduceOp::Max)?;
        self.epoch_end = EpochEnd::from_code(code[0]).map(|phase| (self.state.progress(), phase));
        Ok(())
    }
}
