//! The server that owns (a shard of) the model, as a state machine: the root (flat server,
//! shard 0 of a sharded flat topology, or the global server) or another shard server.
//!
//! - Sync: a round waits for one push from every active child, sums them in child order
//!   ([`super::aggregate::Accumulator`]), applies one optimizer step and sends the new
//!   version to every child. A lost child, or silence past the deadline, ends the run naming
//!   it.
//! - Async: each admitted push is applied on arrival and answered to its sender alone; a
//!   lost child is logged and training goes on with the others.
//!
//! The root evaluates every `eval_every` rounds (after gathering the other shards), stops at
//! `target_accuracy` or after its rounds, and tells every child and shard server to stop.
//! A shard server stops when the root says so.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use flotilla_comm::CommError;

use super::PsContext;
use super::aggregate::{Accumulator, Admission, Mean};
use super::inbox::Inbox;
use super::protocol::PsMessage;
use super::serve::ServerMachine;
use super::server::{Model, PushCheck, RootOutcome, ShardPlan, gather, list, reject};
use super::{send, send_bytes};
use crate::error::{Result, TrainError};

/// Root or shard server state.
pub struct RootServer {
    shard: ShardPlan,
    is_root: bool,
    /// Rank of the root (shard 0).
    root: usize,
    children: Vec<usize>,
    sync: bool,
    model: Model,
    admission: Admission,
    averaging: bool,
    total_rounds: u64,
    base_lr: f64,
    timeout: Duration,
    active: BTreeSet<usize>,
    /// Sync: the children yet to push in this round.
    pending: BTreeSet<usize>,
    acc: Accumulator,
    lost: Vec<usize>,
    rounds: u64,
    updates: u64,
    max_staleness: u64,
    staleness_sum: u64,
    round_started: Instant,
    wait: Duration,
    stop_reason: Option<String>,
    /// A shard server asked by the root for its shard at a version it has not reached.
    gather_wait: Option<u64>,
    /// A shard server that lost children expects the root's stop before this instant (the
    /// root is stopping everyone); `(lost child, deadline)`.
    awaiting_stop: Option<(usize, Instant)>,
    first_update: Option<Instant>,
    /// The root's channel to the other shard servers (gathering for evaluation).
    shard_inbox: Option<Inbox>,
}

impl RootServer {
    /// A server of `children` holding the shard `shard` of the engine's parameters.
    pub fn new(
        cx: &mut PsContext<'_>,
        children: &[usize],
        sync: bool,
        shard: ShardPlan,
    ) -> Result<Self> {
        let is_root = shard.index == 0;
        let model = Model::new(cx, shard.range())?;
        let n = model.len();
        let active: BTreeSet<usize> = children.iter().copied().collect();
        let shard_inbox = (is_root && shard.servers.len() > 1)
            .then(|| Inbox::listen(cx.comm, &shard.servers[1..]));
        let admission = if sync {
            Admission::Sync
        } else {
            Admission::Async {
                max_staleness: cx.config.topology.max_staleness,
            }
        };
        cx.log(&format!(
            "{} ({}) holding parameters {:?} of {}, children [{}], {} rounds",
            if is_root {
                "root server"
            } else {
                "shard server"
            },
            if sync { "sync" } else { "async" },
            shard.range(),
            cx.engine.num_params(),
            list(&active),
            cx.rounds
        ))?;
        Ok(Self {
            root: shard.servers[0],
            is_root,
            children: children.to_vec(),
            sync,
            model,
            admission,
            averaging: cx.config.topology.local_steps > 1,
            total_rounds: cx.rounds,
            base_lr: cx.config.base_lr(),
            timeout: Duration::from_secs_f64(cx.config.comm.timeout_s),
            pending: active.clone(),
            active,
            acc: Accumulator::new(n, sync),
            lost: Vec::new(),
            rounds: 0,
            updates: 0,
            max_staleness: 0,
            staleness_sum: 0,
            round_started: Instant::now(),
            wait: Duration::ZERO,
            stop_reason: None,
            gather_wait: None,
            awaiting_stop: None,
            first_update: None,
            shard_inbox,
            shard,
        })
    }

    /// The parameter version this server holds.
    pub fn version(&self) -> u64 {
        self.model.version()
    }

    /// Children still taking part.
    pub fn active(&self) -> &BTreeSet<usize> {
        &self.active
    }

    /// Updates applied so far.
    pub fn updates(&self) -> u64 {
        self.updates
    }

    /// A message from the root to a shard server: stop, or send the shard.
    fn on_root_message(&mut self, cx: &mut PsContext<'_>, msg: PsMessage) -> Result<()> {
        match msg {
            PsMessage::Stop { reason } => self.stop_reason = Some(reason),
            PsMessage::Gather { version } if self.model.version() >= version => {
                send_bytes(cx.comm, self.root, &self.model.encoded())?;
            }
            PsMessage::Gather { version } => self.gather_wait = Some(version),
            other => {
                return Err(TrainError::Protocol {
                    peer: self.root,
                    message: format!(
                        "a shard server expects stop or gather from the root, got {}",
                        other.name()
                    ),
                });
            }
        }
        Ok(())
    }

    /// A child's push: admitted into the round (or refused, changing nothing); a complete
    /// round or an async push becomes an update.
    pub fn on_push(&mut self, cx: &mut PsContext<'_>, child: usize, msg: PsMessage) -> Result<()> {
        let check = PushCheck {
            admission: self.admission,
            current: self.model.version(),
            len: self.model.len(),
            averaging: self.averaging,
            sync_pending: self.sync.then_some(&self.pending),
        };
        let Some(staleness) = check.take(cx, &mut self.acc, child, msg)? else {
            return Ok(());
        };
        if self.sync {
            self.pending.remove(&child);
            if !self.pending.is_empty() {
                return Ok(());
            }
        }
        let Some(mean) = self.acc.take() else {
            return Ok(());
        };
        self.update(cx, &mean, staleness)?;
        if self.stop_reason.is_some() {
            return Ok(());
        }
        if self.sync {
            let msg = self.model.encoded();
            for &c in &self.active {
                send_bytes(cx.comm, c, &msg)?;
            }
            self.pending = self.active.clone();
        } else {
            send_bytes(cx.comm, child, &self.model.encoded())?;
        }
        Ok(())
    }

    /// Applies one mean push and does the round's bookkeeping (log, evaluation, stopping).
    fn update(&mut self, cx: &mut PsContext<'_>, mean: &Mean, staleness: u64) -> Result<()> {
        let lr_round = if self.sync {
            self.updates
        } else {
            self.updates / self.children.len() as u64
        };
        let schedule = &cx.config.schedule;
        let mut lr = schedule.lr_schedule.lr_at(
            self.base_lr,
            lr_round,
            self.total_rounds,
            schedule.warmup_steps,
        );
        if cx.config.topology.staleness_lr {
            lr /= 1.0 + staleness as f64;
        }
        let t = Instant::now();
        self.first_update.get_or_insert(t);
        self.model.apply(cx, mean, lr, self.averaging)?;
        let apply_s = t.elapsed();
        self.updates += 1;
        self.max_staleness = self.max_staleness.max(staleness);
        self.staleness_sum += staleness;
        if self.gather_wait.is_some_and(|v| self.model.version() >= v) {
            self.gather_wait = None;
            send_bytes(cx.comm, self.root, &self.model.encoded())?;
        }
        let round_done = self.sync || self.updates.is_multiple_of(self.children.len() as u64);
        if round_done {
            self.end_round(cx, mean, apply_s)?;
        }
        Ok(())
    }

    fn end_round(&mut self, cx: &mut PsContext<'_>, mean: &Mean, apply_s: Duration) -> Result<()> {
        self.rounds += 1;
        let rounds = self.rounds;
        cx.log_quiet(&format!(
            "round {rounds} v{} loss={:.4} pushes={} wait={:.1}ms apply={:.1}ms round={:.1}ms",
            self.model.version(),
            mean.loss,
            mean.pushes,
            self.wait.as_secs_f64() * 1e3,
            apply_s.as_secs_f64() * 1e3,
            self.round_started.elapsed().as_secs_f64() * 1e3
        ))?;
        if self.is_root {
            cx.observe_round(rounds, self.total_rounds, mean.loss);
        }
        self.wait = Duration::ZERO;
        self.round_started = Instant::now();
        if !self.is_root {
            return Ok(());
        }
        if rounds >= self.total_rounds {
            self.stop_reason = Some(format!("{rounds} rounds done"));
            return Ok(());
        }
        if cx.eval_every > 0 && rounds.is_multiple_of(cx.eval_every) {
            let v = if self.sync { self.model.version() } else { 0 };
            gather(
                cx,
                &self.shard,
                self.shard_inbox.as_ref(),
                &mut self.model,
                v,
            )?;
            let acc_now = cx.evaluate_and_log(rounds)?;
            if let Some(target) = cx.config.schedule.target_accuracy
                && acc_now >= target
            {
                self.stop_reason = Some(format!(
                    "test accuracy {acc_now:.4} reached target {target}"
                ));
            }
        }
        Ok(())
    }

    /// Stops every child (and, from the root, every shard server) and says how it went.
    pub fn finish(mut self, cx: &mut PsContext<'_>) -> Result<RootOutcome> {
        let reason = self.stop_reason.clone().unwrap_or_default();
        let stop = PsMessage::Stop {
            reason: reason.clone(),
        };
        if self.is_root {
            // The other shards, for the checkpoint, while their servers still run; then
            // everyone is told to stop, the shard servers first.
            let v = if self.sync { self.model.version() } else { 0 };
            gather(
                cx,
                &self.shard,
                self.shard_inbox.as_ref(),
                &mut self.model,
                v,
            )?;
            for &rank in &self.shard.servers[1..] {
                let _ = send(cx.comm, rank, &stop);
            }
        }
        for &c in &self.active {
            // A child that already left cannot be told; that is not an error at the end.
            let _ = send(cx.comm, c, &stop);
        }
        cx.log(&format!("stopping: {reason}"))?;
        let updates = self.updates;
        Ok(RootOutcome {
            rounds: self.rounds,
            updates,
            reason,
            lost: self.lost,
            max_staleness: self.max_staleness,
            mean_staleness: if updates > 0 {
                self.staleness_sum as f64 / updates as f64
            } else {
                0.0
            },
            busy_s: self.first_update.map_or(0.0, |t| t.elapsed().as_secs_f64()),
        })
    }

    /// A shard server whose children leave is being stopped by the root: wait for that.
    fn expect_stop(&mut self, child: usize) {
        self.awaiting_stop
            .get_or_insert((child, Instant::now() + self.timeout));
    }
}

impl ServerMachine for RootServer {
    fn peers(&self) -> Vec<usize> {
        let mut peers = self.children.clone();
        if !self.is_root {
            peers.push(self.root);
        }
        peers
    }

    fn on_message(&mut self, cx: &mut PsContext<'_>, from: usize, msg: PsMessage) -> Result<()> {
        if from == self.root && !self.is_root {
            return self.on_root_message(cx, msg);
        }
        if let Some((child, by)) = self.awaiting_stop
            && Instant::now() >= by
        {
            return Err(lost_child(child, self.rounds));
        }
        match msg {
            PsMessage::Pull => send_bytes(cx.comm, from, &self.model.encoded()),
            msg @ PsMessage::Push { .. } => self.on_push(cx, from, msg),
            other => Err(TrainError::Protocol {
                peer: from,
                message: format!("a server expects pull or push, got {}", other.name()),
            }),
        }
    }

    fn on_malformed(&mut self, cx: &mut PsContext<'_>, from: usize, e: TrainError) -> Result<()> {
        if from == self.root && !self.is_root {
            return Err(TrainError::Peer {
                peer: from,
                message: e.to_string(),
            });
        }
        reject(cx, from, &e.to_string())
    }

    fn on_lost(&mut self, cx: &mut PsContext<'_>, peer: usize, e: CommError) -> Result<()> {
        if peer == self.root && !self.is_root {
            return Err(TrainError::Peer {
                peer,
                message: format!("root server rank {peer} lost: {e}"),
            });
        }
        if !self.active.contains(&peer) {
            return Ok(());
        }
        if self.sync {
            // A shard server may see a worker leave because the root has just told everyone
            // to stop: that stop must then arrive soon.
            if !self.is_root {
                self.expect_stop(peer);
                return Ok(());
            }
            return Err(TrainError::Peer {
                peer,
                message: format!("rank {peer} lost during sync round {}: {e}", self.rounds),
            });
        }
        self.active.remove(&peer);
        self.pending.remove(&peer);
        self.lost.push(peer);
        cx.log(&format!(
            "rank {peer} lost ({e}); async training continues with {} of {} children",
            self.active.len(),
            self.children.len()
        ))?;
        if self.active.is_empty() {
            if !self.is_root {
                self.expect_stop(peer);
                return Ok(());
            }
            return Err(TrainError::Peer {
                peer,
                message: "every child of this server is lost".into(),
            });
        }
        Ok(())
    }

    fn on_deadline(&mut self, _cx: &mut PsContext<'_>, waited: Duration) -> Result<()> {
        if let Some((child, _)) = self.awaiting_stop {
            return Err(lost_child(child, self.rounds));
        }
        let silent = if self.sync {
            &self.pending
        } else {
            &self.active
        };
        Err(TrainError::Peer {
            peer: silent.first().copied().unwrap_or(0),
            message: format!(
                "{} server at round {}: no message from rank(s) {} within {waited:?}",
                if self.sync { "sync" } else { "async" },
                self.rounds,
                list(silent),
            ),
        })
    }

    fn note_wait(&mut self, waited: Duration) {
        self.wait += waited;
    }

    fn done(&self) -> bool {
        self.stop_reason.is_some()
    }
}

fn lost_child(child: usize, rounds: u64) -> TrainError {
    TrainError::Peer {
        peer: child,
        message: format!(
            "rank {child} lost at round {rounds} and the root did not stop the run in time"
        ),
    }
}
