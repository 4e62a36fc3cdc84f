//! An elastic flat parameter server's workers ([`crate::config::Elasticity::ServerWorkers`],
//! `flotilla launch -n MIN:MAX` with `arch: flat`, one server or `servers` shards): each
//! server keeps its workers' membership by the rules of `members.rs` (every shard server the
//! same workers, each on its own: a worker lost is lost to all of them); here, what a root
//! or shard server does when they apply.
//!
//! A worker's samples while it is out are not trained on until its replacement takes its
//! shard of the data again from the start of an epoch (the sync server's rounds go on
//! meanwhile). A lost server ends the job, which `--max-restarts` restarts from its
//! checkpoint.

use super::ShardServer;
use crate::error::Result;
use crate::strategy::ps::PsContext;
use crate::strategy::ps::members::Left;
use std::time::Duration;

impl ShardServer {
    /// A sync round's deadline passed: the workers that did not push are left out — unless
    /// none pushed, the first time: with shard servers a worker may wait for another
    /// shard's answer (a worker frozen between its pushes to two shards leaves the rounds
    /// of the two one apart), so the server waits once more before it blames anyone.
    pub(super) fn silent_left_out(
        &mut self,
        cx: &mut PsContext<'_>,
        waited: Duration,
    ) -> Result<()> {
        match self.members.silent() {
            None => cx.log(&format!(
                "no worker pushed round {} within {waited:?}; waiting once more (a worker may \
                 be waiting for another server)",
                self.rounds
            )),
            Some(silent) => self.leave_out(cx, &silent, &format!("silent for {waited:?}")),
        }
    }

    /// Leaves `peers` (active children) out of the rounds (`why`): the job goes on with the
    /// others while it keeps its minimum, and a sync round waiting only for them closes.
    pub(super) fn leave_out(
        &mut self,
        cx: &mut PsContext<'_>,
        peers: &[usize],
        why: &str,
    ) -> Result<()> {
        match self.members.leave_out(peers) {
            Left::BelowMinimum if !self.is_root => {
                // Workers leave a shard server when the root told them the job stops, maybe
                // before it told this server: that stop must arrive within the deadline (the
                // root names the workers if the job is below its minimum).
                self.expect_stop(peers.first().copied().unwrap_or(0));
                Ok(())
            }
            Left::BelowMinimum => Err(self.members.below_minimum(peers)),
            Left::Out(round_closes) => {
                cx.log(&self.members.left_line(peers, why, self.rounds))?;
                if round_closes {
                    let any = self.members.active().first().copied().unwrap_or(0);
                    return self.close(cx, 0, any);
                }
                Ok(())
            }
        }
    }
}
