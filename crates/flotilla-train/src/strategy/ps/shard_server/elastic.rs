//! An elastic flat parameter server's workers ([`crate::config::Elasticity::ServerWorkers`],
//! `flotilla launch -n MIN:MAX` with `arch: flat`, one server or `servers` shards): each
//! server keeps its workers' membership (every shard server the same workers, each on its
//! own: a worker lost is lost to all of them).
//!
//! - A worker lost (its connection closed) or, in a sync round, silent past the deadline is
//!   left out: the round closes with the pushes of the others (sample-weighted, as every
//!   round's mean is; a push the lost worker made before it went counts), and the rounds
//!   after it wait for the remaining workers only. Fewer than the minimum left: the job
//!   stops naming the workers left out.
//! - A push from a worker left out (a frozen one that woke up) is refused for good: the
//!   worker stops, and the launcher replaces it like a lost one.
//! - A replacement, started alone by the launcher, takes the rank's links back (the
//!   rendezvous' rejoin), pulls the current parameters and is taken into the round under
//!   way: its push, on the version it pulled, completes it.
//!
//! A worker's samples while it is out are not trained on until its replacement takes its
//! shard of the data again from the start of an epoch (the sync server's rounds go on
//! meanwhile). A lost server ends the job, which `--max-restarts` restarts from its
//! checkpoint.

use super::ShardServer;
use crate::config::{Elasticity, TrainConfig};
use crate::error::{Result, TrainError};
use crate::strategy::ps::PsContext;
use crate::strategy::ps::server::{ShardPlan, list, reject};
use flotilla_ps::Refusal;
use std::time::Duration;

/// The fewest children the server of `shard` keeps training with in an elastic job of
/// `config` (its minimum ranks less the servers); `None` in a fixed-size job.
pub(super) fn min_children(config: &TrainConfig, shard: &ShardPlan) -> Option<usize> {
    if config.elasticity() != Some(Elasticity::ServerWorkers) {
        return None;
    }
    let min = config.topology.min_world_size?;
    Some(min.saturating_sub(shard.servers.len()).max(1))
}

impl ShardServer {
    /// Whether `child` is one of this server's workers left out of an elastic job.
    pub(super) fn left_out(&self, child: usize) -> bool {
        self.min_children.is_some()
            && self.children.contains(&child)
            && !self.active.contains(&child)
    }

    /// Refuses a push of a worker left out, for good.
    pub(super) fn refuse_left_out(&mut self, cx: &mut PsContext<'_>, child: usize) -> Result<()> {
        let reason = format!(
            "rank {child} was left out of the job at round {} (lost or silent past the \
             deadline); a replacement takes its place",
            self.rounds
        );
        reject(cx, child, &Refusal::lasting(reason))
    }

    /// A sync round's deadline passed: the workers that did not push are left out — unless
    /// none pushed, the first time: with shard servers a worker may wait for another
    /// shard's answer (a worker frozen between its pushes to two shards leaves the rounds
    /// of the two one apart), so the server waits once more before it blames anyone.
    pub(super) fn silent_left_out(
        &mut self,
        cx: &mut PsContext<'_>,
        waited: Duration,
    ) -> Result<()> {
        if self.pending.len() == self.active.len() && !self.stalled {
            self.stalled = true;
            return cx.log(&format!(
                "no worker pushed round {} within {waited:?}; waiting once more (a worker may \
                 be waiting for another server)",
                self.rounds
            ));
        }
        let silent: Vec<usize> = self.pending.iter().copied().collect();
        self.leave_out(cx, &silent, &format!("silent for {waited:?}"))
    }

    /// Leaves `peers` (active children) out of the rounds (`why`): the job goes on with the
    /// others while it keeps its minimum, and a sync round waiting only for them closes.
    pub(super) fn leave_out(
        &mut self,
        cx: &mut PsContext<'_>,
        peers: &[usize],
        why: &str,
    ) -> Result<()> {
        let min = self.min_children.unwrap_or(1);
        let remaining = self.active.iter().filter(|p| !peers.contains(p)).count();
        if remaining < min && !self.is_root {
            // Workers leave a shard server when the root told them the job stops, maybe
            // before it told this server: that stop must arrive within the deadline (the
            // root names the workers if the job is below its minimum).
            self.expect_stop(peers.first().copied().unwrap_or(0));
            return Ok(());
        }
        for &peer in peers {
            self.active.remove(&peer);
            self.pending.remove(&peer);
            self.lost.push(peer);
        }
        let left: std::collections::BTreeSet<usize> = self.lost.iter().copied().collect();
        if self.active.len() < min {
            return Err(TrainError::Peer {
                peer: peers.first().copied().unwrap_or(0),
                message: format!(
                    "the job is down to {} worker(s), fewer than its minimum of {min}; left out: \
                     rank(s) {}",
                    self.active.len(),
                    list(&left)
                ),
            });
        }
        let who = match peers {
            [one] => format!("rank {one}"),
            many => format!(
                "rank(s) {}",
                many.iter()
                    .map(|p| p.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        cx.log(&format!(
            "{who} {why}: left out at round {}; {} training goes on with {} of {} workers",
            self.rounds,
            if self.sync { "sync" } else { "async" },
            self.active.len(),
            self.children.len()
        ))?;
        if self.sync && self.pending.is_empty() {
            let any = self.active.first().copied().unwrap_or(0);
            return self.close(cx, 0, any);
        }
        Ok(())
    }

    /// Takes `peer`'s replacement back into the round under way.
    pub(super) fn take_back(&mut self, cx: &mut PsContext<'_>, peer: usize) -> Result<()> {
        if !self.children.contains(&peer) {
            return Ok(());
        }
        self.lost.retain(|&p| p != peer);
        self.active.insert(peer);
        if self.sync {
            self.pending.insert(peer);
        }
        let r = self.rejoins.back(peer, self.model.version());
        cx.log(&format!(
            "rank {peer} rejoined (a replaced worker) at round {} version {}; {} training goes \
             on with {} of {} workers",
            self.rounds,
            r.version,
            if self.sync { "sync" } else { "async" },
            self.active.len(),
            self.children.len()
        ))
    }
}
