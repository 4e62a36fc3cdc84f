//! An elastic run between two generations ([`crate::elastic`]): the vote after each step
//! whether the membership changes, and the move to the next generation — the strategy
//! takes the new group and agrees on its state with the members (rank 0's, the most steps),
//! the batches are cut among the new members from the same global batch, and every member
//! checks that all hold the same parameters before training on.

use std::sync::Arc;

use flotilla_tcp::{ProcessGroup, StallWatcher};

use super::{Run, elastic_position};
use crate::batches::Batches;
use crate::error::Result;
use crate::observe::Observer;
use crate::plan::Counting;

/// What the members of an elastic run agreed after a step.
pub(super) enum Vote {
    /// Train on.
    On,
    /// Stop after this step (a member proposed it, [`Run::propose_stop`]): the reason.
    Stop(String),
    /// Leave the generation: a member heard of a change (why).
    Regroup(String),
    /// Leave the generation: the vote failed, a member lost (why).
    Lost(String),
}

impl Run {
    /// After a step of an elastic run: whether any member proposed to stop, or heard of a
    /// change (or its exchange failed: the generation is lost), so that all stop, or leave
    /// the generation, after this step. A stop agreed wins over a change: the run's end
    /// takes a lost member as any collective does.
    pub(super) fn ballot(&mut self) -> Vote {
        let Some(e) = self.elastic.as_ref() else {
            return Vote::On;
        };
        let flag = |b: bool| if b { 1.0 } else { 0.0 };
        let mut flags = [flag(e.changing()), flag(self.proposed_stop.is_some())];
        match self.parts.comm.all_reduce_sum(&mut flags) {
            Ok(()) if flags[1] > 0.0 => Vote::Stop(match &self.proposed_stop {
                Some(reason) => reason.clone(),
                None => "another member stopped the run".into(),
            }),
            Ok(()) if flags[0] > 0.0 => Vote::Regroup("the membership changes".into()),
            Ok(()) => Vote::On,
            Err(e) => Vote::Lost(e.to_string()),
        }
    }

    /// Leaves the current generation (`why`) and trains on in the next one; an error only
    /// when the lighthouse refuses this process (a stale generation, fewer members than the
    /// minimum) or the strategy cannot change its members.
    pub(super) fn regroup(&mut self, observer: &mut dyn Observer, why: &str) -> Result<()> {
        // Left without stopping it collectively (that waits for every member, a lost one
        // too): it ends on its own.
        drop(self.watcher.take());
        loop {
            // Read again after a generation lost while starting: its state (and count) may
            // be rank 0's of that generation by then. Steps counted but not in the model yet
            // (an async peer's in flight) are redone.
            let progress = self.state.progress();
            let step = self
                .role
                .applied_until()
                .map_or(progress, |a| a.min(progress));
            let Some(e) = self.elastic.as_mut() else {
                return Ok(());
            };
            let left = e.generation.number;
            let redo = match progress - step {
                0 => String::new(),
                n => format!(" ({n} in flight, redone from step {step})"),
            };
            let note = format!(
                "left generation {left} after step {progress}{redo}: {why}; joining the next"
            );
            observer.message(&note);
            self.parts.log.line(&note)?;
            let comm = e.next(step)?;
            match self.take_generation(comm, observer) {
                Ok(()) => return Ok(()),
                Err(err) if crate::elastic::survivable(&err) => {
                    let note = format!("the generation was lost while starting: {err}");
                    observer.message(&note);
                    self.parts.log.line(&note)?;
                }
                Err(err) => return Err(err),
            }
        }
    }

    /// Trains on in the generation of `comm`: the strategy's state agreed with rank 0's, the
    /// count and batches where rank 0 stands, the parameters checked equal on every member.
    fn take_generation(
        &mut self,
        comm: Arc<dyn ProcessGroup>,
        observer: &mut dyn Observer,
    ) -> Result<()> {
        let (rank, world) = (comm.rank(), comm.size());
        self.parts.comm = comm;
        self.parts.rank = rank;
        self.parts.config.topology.world_size = world;
        let started = {
            let mut cx = self.parts.cx(observer);
            self.role.regroup(&mut cx)?;
            // Before the strategy's start, as a run's start makes them: each sub-group of a
            // generation is numbered in the order its members make it (a joiner's too).
            if let Some(policy) = self.role.stall_policy(cx.config) {
                let everyone: Vec<usize> = (0..world).collect();
                let channel = cx.comm.group(&everyone)?;
                self.watcher = Some(StallWatcher::start(cx.comm.clone(), channel, policy)?);
            }
            self.role.start(&mut cx)
        };
        let Some(e) = self.elastic.as_mut() else {
            return Ok(());
        };
        e.started(started.is_ok(), rank);
        started?;
        let (global, step) = (e.global_batch, e.generation.step);
        self.state.resume_at(step);
        let train = Arc::clone(&self.parts.data.train);
        let at = elastic_position(&train, global, step);
        let seed = self.parts.config.model.seed;
        // The data's shards: one per member, or per replica (a pipeline's).
        let shard = match self.role.counting() {
            Counting::Epochs { shards, index } => (shards, index),
            Counting::Rounds { .. } => (world, rank),
        };
        let micro = self.parts.config.allreduce.accumulation_steps as usize;
        self.batches = Batches::sliced(train, shard, seed, (global, micro), at)?;
        self.plan.workers = shard.0;
        self.generation_line(observer)
    }

    /// Says (and checks: collective) which generation this process trains in: its members,
    /// this process's rank, the step it starts from and the parameters' hash, the same on
    /// every member.
    pub(super) fn generation_line(&mut self, observer: &mut dyn Observer) -> Result<()> {
        if self.elastic.is_none() {
            return Ok(());
        }
        self.agree_epoch_end()?;
        let rank = self.parts.comm.rank();
        let hash = self.role.generation_hash(&mut self.parts.cx(observer))?;
        let step = self.state.progress();
        let line = match &self.elastic {
            Some(e) => e.generation_line(rank, step, hash),
            None => return Ok(()),
        };
        observer.message(&line);
        self.parts.log.line(&line)
    }
}
