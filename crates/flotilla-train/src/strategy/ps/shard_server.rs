//! The server that owns (a shard of) the model, as a state machine: the root (flat server,
//! shard 0 of a sharded flat topology, or the global server) or another shard server.
//!
//! - Sync: a round waits for one push from every active child, sums them in child order
//!   ([`flotilla_ps::Accumulator`]), applies one optimizer step and sends the new
//!   version to every child. A lost child, or silence past the deadline, ends the run naming
//!   it.
//! - Async: each admitted push is applied on arrival and answered to its sender alone; a
//!   lost child is logged and training goes on with the others.
//!
//! As a [`Strategy`], the root's rounds are the run's progress: the run loop evaluates between
//! rounds (the root gathers the other shards first) and stops it at `target_accuracy` or
//! after its rounds; the root then tells every child and shard server to stop. Its reply to
//! a round's pushes waits until the loop has decided to go on. A shard server stops when
//! the root says so.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use flotilla_engine::{Engine, EvalStats, ModelState};
use flotilla_tcp::CommError;

use super::members::{JobWorkers, Members, min_children};
use super::rejoins::Rejoins;
use super::serve::{ServerMachine, serve_one};
use super::server::{Model, PushCheck, RootOutcome, ShardPlan, gather, list, reject};
use super::{PsContext, deadlines};
use super::{send, send_bytes};
use flotilla_cluster::RoleKind;
use flotilla_ps::PsMessage;
use flotilla_ps::{Accumulator, Admission, Inbox, Mean, Refusal};

use super::job::{Announcement, Place};

mod elastic;
use crate::batches::Batches;
use crate::checkpoint::CheckpointState;
use crate::error::{Result, TrainError};
use crate::plan::Counting;
use crate::strategy::{Cx, Evaluation, Resume, Setup, Step, Strategy};

/// Root or shard server state.
pub struct ShardServer {
    /// The whole model (the root evaluates and checkpoints it); this server updates its
    /// shard of it.
    engine: Box<dyn Engine>,
    shard: ShardPlan,
    is_root: bool,
    /// Rank of the root (shard 0).
    root: usize,
    /// Its children and who of them takes part (`members.rs`).
    members: Members,
    /// An elastic hierarchical job's root: its workers, by local server.
    job_workers: Option<JobWorkers>,
    sync: bool,
    model: Model,
    admission: Admission,
    averaging: bool,
    total_rounds: u64,
    base_lr: f64,
    timeout: Duration,
    acc: Accumulator,
    rounds: u64,
    updates: u64,
    max_staleness: u64,
    staleness_sum: u64,
    round_started: Instant,
    /// The timeline span of the round in progress (closed when the round ends).
    round_span: tracing::Span,
    wait: Duration,
    stop_reason: Option<String>,
    /// A shard server asked by the root for its shard (and, `true`, its optimizer state) at
    /// a version it has not reached.
    gather_wait: Option<(u64, bool)>,
    /// A shard server that lost children expects the root's stop before this instant (the
    /// root is stopping everyone); `(lost child, deadline)`.
    awaiting_stop: Option<(usize, Instant)>,
    first_update: Option<Instant>,
    /// The root's channel to the other shard servers (gathering for evaluation).
    shard_inbox: Option<Inbox>,
    /// This server's channel to its children (and a shard server's to the root).
    inbox: Inbox,
    /// The root's answer to a round's pushes, sent when the run goes on: the children.
    held_reply: Option<Vec<usize>>,
    /// A round finished in the last event: its mean loss and samples.
    round_done: Option<(f32, u64)>,
    /// The round so far: its updates' sample-weighted loss sum and samples (an async round
    /// is one update per child).
    round_sum: (f64, u64),
    /// The root gathered the shards and stopped everyone.
    finished: Option<RootOutcome>,
    /// A push reported a NaN or infinite loss (it is refused): the run loop judges it.
    bad_loss: Option<f32>,
    /// Scale each update's learning rate by `1 / (1 + staleness)`.
    staleness_lr: bool,
    /// Lost children taken back (replaced workers that rejoined), and the pushes accepted
    /// from each replacement.
    rejoins: Rejoins,
    /// What it says when it starts.
    announcement: Announcement,
    /// How the run counts its rounds.
    counting: Counting,
    /// See [`super::job::Place::resync_from`].
    resync_from: Option<usize>,
    /// The most samples each child can claim in a push, in the order of `children`.
    max_samples: Vec<u64>,
}

impl ShardServer {
    /// This rank's server in the job of `setup`: the root (a flat server, shard 0 of a
    /// sharded flat topology, or the global server) or another shard server, with the
    /// staleness policy of [`super::staleness::for_job`].
    pub fn build(cx: &mut Cx<'_>, setup: &Setup<'_>) -> Result<Self> {
        let place = Place::of(cx, setup)?;
        let policy = super::staleness::for_job(cx.config, setup.topology, cx.rank).own;
        if let Some(note) = &policy.note {
            cx.log(note)?;
        }
        let engine = setup.engine(cx.config, &policy.optimizer)?;
        let n = engine.num_params();
        let shard = match place.role.kind {
            RoleKind::ShardServer { shard } => ShardPlan {
                index: shard,
                ranges: setup.topology.shard_ranges(n),
                servers: setup
                    .topology
                    .servers()
                    .filter(|r| matches!(r.kind, RoleKind::ShardServer { .. }))
                    .map(|r| r.rank)
                    .collect(),
            },
            _ => ShardPlan::whole(n),
        };
        let elastic = (
            min_children(cx.config, setup.topology, cx.rank),
            JobWorkers::of(cx.config, setup.topology, cx.rank),
        );
        Self::new(cx, &place, (engine, shard), (policy.staleness_lr, elastic))
    }

    /// A server of `place`'s children holding the shard `shard` of `engine`'s parameters,
    /// scaling each update's learning rate by `1 / (1 + staleness)` when `staleness_lr`,
    /// elastic down to `min` children (and, the root of an elastic hierarchical job,
    /// counting the job's workers in `job`).
    fn new(
        cx: &mut Cx<'_>,
        place: &Place,
        (engine, shard): (Box<dyn Engine>, ShardPlan),
        (staleness_lr, (min, job)): (bool, (Option<usize>, Option<JobWorkers>)),
    ) -> Result<Self> {
        let (children, sync) = (&place.role.children, place.sync);
        let is_root = shard.index == 0;
        let clip = cx.config.allreduce.clip_grad_norm;
        let model = Model::new(&*engine, shard.range())?.clipping(clip)?;
        let n = model.len();
        let members = Members::new(children, sync, min);
        let shard_inbox = (is_root && shard.servers.len() > 1)
            .then(|| Inbox::listen(cx.comm, &shard.servers[1..]));
        let admission = if sync {
            Admission::Sync
        } else {
            Admission::Async {
                max_staleness: cx.config.topology.max_staleness,
            }
        };
        let total = engine.num_params();
        let announcement = place.announcement.clone().then(format!(
            "{} ({}) holding parameters {:?} of {}, children [{}], {} rounds",
            if is_root {
                "root server"
            } else {
                "shard server"
            },
            if sync { "sync" } else { "async" },
            shard.range(),
            total,
            list(members.active()),
            place.rounds
        ));
        let mut peers = children.to_vec();
        if !is_root {
            peers.push(shard.servers[0]);
        }
        let inbox = Inbox::listen(cx.comm, &peers);
        Ok(Self {
            engine,
            announcement,
            counting: place.counting((1, 0)),
            resync_from: place.resync_from,
            max_samples: place.max_samples.clone(),
            inbox,
            held_reply: None,
            round_done: None,
            round_sum: (0.0, 0),
            finished: None,
            bad_loss: None,
            staleness_lr,
            rejoins: Rejoins::default(),
            root: shard.servers[0],
            is_root,
            members,
            job_workers: job,
            sync,
            model,
            admission,
            averaging: cx.config.topology.local_steps > 1,
            total_rounds: place.rounds,
            base_lr: cx.config.base_lr(),
            timeout: children_deadline(cx, place),
            acc: Accumulator::new(n, sync),
            rounds: 0,
            updates: 0,
            max_staleness: 0,
            staleness_sum: 0,
            round_started: Instant::now(),
            round_span: round_span(1),
            wait: Duration::ZERO,
            stop_reason: None,
            gather_wait: None,
            awaiting_stop: None,
            first_update: None,
            shard_inbox,
            shard,
        })
    }

    /// Continues a checkpoint of round `rounds` (its parameters are already in the engine):
    /// rounds, updates and the parameter version start where that run stood, so that the
    /// learning-rate schedule and the versions workers push against go on from there. (An
    /// async round is one update per child.)
    fn resume_at(&mut self, rounds: u64) -> Result<()> {
        let per_round = if self.sync {
            1
        } else {
            self.members.children().len().max(1) as u64
        };
        let clip = self.model.clip();
        self.model = Model::new(&*self.engine, self.shard.range())?.clipping(clip)?;
        self.rounds = rounds;
        self.updates = rounds * per_round;
        self.model.set_version(self.updates);
        self.round_span = round_span(rounds + 1);
        Ok(())
    }

    /// The parameter version this server holds.
    pub fn version(&self) -> u64 {
        self.model.version()
    }

    /// Children still taking part.
    pub fn active(&self) -> &BTreeSet<usize> {
        self.members.active()
    }

    /// Updates applied so far.
    pub fn updates(&self) -> u64 {
        self.updates
    }

    /// Sends the root this shard server's shard and, with `state`, its optimizer state.
    fn send_shard(&self, cx: &mut PsContext<'_>, state: bool) -> Result<()> {
        send_bytes(cx.comm, self.root, &self.model.encoded())?;
        if state {
            let bytes = self.engine.optimizer_state()?;
            send(cx.comm, self.root, &PsMessage::State { bytes })?;
        }
        Ok(())
    }

    /// A message from the root to a shard server: stop, or send the shard.
    fn on_root_message(&mut self, cx: &mut PsContext<'_>, msg: PsMessage) -> Result<()> {
        match msg {
            PsMessage::Stop { reason } => self.stop_reason = Some(reason),
            PsMessage::Gather { version, state } if self.model.version() >= version => {
                self.send_shard(cx, state)?;
            }
            PsMessage::Gather { version, state } => self.gather_wait = Some((version, state)),
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
        if self.members.left_out(child) {
            return reject(cx, child, &Members::refusal(child, self.rounds));
        }
        if let PsMessage::Push { loss, .. } = &msg
            && !loss.is_finite()
        {
            self.bad_loss = Some(*loss);
        }
        let check = PushCheck {
            admission: self.admission,
            current: self.model.version(),
            len: self.model.len(),
            averaging: self.averaging,
            sync_pending: self.sync.then_some(self.members.pending()),
            max_samples: self
                .members
                .children()
                .iter()
                .position(|&c| c == child)
                .map_or(0, |i| self.max_samples[i]),
        };
        let Some(staleness) = check.take(cx, &mut self.acc, child, msg)? else {
            return Ok(());
        };
        self.rejoins.accepted(child);
        if self.sync && !self.members.pushed(child) {
            return Ok(());
        }
        self.close(cx, staleness, child)
    }

    /// Applies the pushes taken (a sync round's, once every active child pushed; an async
    /// push, of `child`) and answers.
    fn close(&mut self, cx: &mut PsContext<'_>, staleness: u64, child: usize) -> Result<()> {
        let Some(mean) = self.acc.take() else {
            return Ok(());
        };
        let refused = self.update(cx, &mean, staleness)?;
        let targets: Vec<usize> = if self.sync {
            self.members.next_round()
        } else {
            vec![child]
        };
        if let Some(reason) = refused {
            // Nothing applied: the round's pushes (or the one push) are refused, and their
            // senders pull and push again on the same version.
            let refusal = Refusal::retry(reason);
            for &c in &targets {
                reject(cx, c, &refusal)?;
            }
            return Ok(());
        }
        if self.is_root && self.round_done.is_some() {
            // The run loop decides first whether there is another round.
            self.held_reply = Some(targets);
            return Ok(());
        }
        self.reply(cx, &targets)
    }

    fn reply(&mut self, cx: &mut PsContext<'_>, targets: &[usize]) -> Result<()> {
        let msg = self.model.encoded();
        for &c in targets {
            match send_bytes(cx.comm, c, &msg) {
                // A child lost between its push and the reply (a killed worker): as if the
                // inbox had said so, when the server goes on without it.
                Err(TrainError::Comm(e @ CommError::PeerLost { .. }))
                    if self.goes_on_without(c) =>
                {
                    ServerMachine::on_lost(self, cx, c, e)?
                }
                r => r?,
            }
        }
        Ok(())
    }

    /// Sends the reply held back at the end of a round (the run goes on).
    pub fn flush(&mut self, cx: &mut PsContext<'_>) -> Result<()> {
        match self.held_reply.take() {
            Some(targets) => self.reply(cx, &targets),
            None => Ok(()),
        }
    }

    /// Applies one mean push and does the round's bookkeeping (log, evaluation, stopping);
    /// or refuses it, changing nothing, and says why (its new parameters are not finite).
    fn update(
        &mut self,
        cx: &mut PsContext<'_>,
        mean: &Mean,
        staleness: u64,
    ) -> Result<Option<String>> {
        let lr_round = if self.sync {
            self.updates
        } else {
            self.updates / self.members.children().len() as u64
        };
        let schedule = &cx.config.schedule;
        let mut lr = schedule.lr_schedule.lr_at_floor(
            self.base_lr,
            lr_round,
            self.total_rounds,
            schedule.warmup_steps,
            schedule.min_lr_ratio,
        );
        if self.staleness_lr {
            lr /= 1.0 + staleness as f64;
        }
        let t = Instant::now();
        self.first_update.get_or_insert(t);
        let refused = self
            .model
            .apply(&mut *self.engine, mean, lr, self.averaging)?;
        if refused.is_some() {
            return Ok(refused);
        }
        let apply_s = t.elapsed();
        self.updates += 1;
        self.round_sum.0 += f64::from(mean.loss) * mean.samples as f64;
        self.round_sum.1 += mean.samples;
        self.max_staleness = self.max_staleness.max(staleness);
        self.staleness_sum += staleness;
        metrics::histogram!("flotilla_ps_staleness").record(staleness as f64);
        metrics::gauge!("flotilla_ps_version").set(self.model.version() as f64);
        if let Some((v, state)) = self.gather_wait
            && self.model.version() >= v
        {
            self.gather_wait = None;
            self.send_shard(cx, state)?;
        }
        let round_done = self.sync
            || self
                .updates
                .is_multiple_of(self.members.children().len() as u64);
        if round_done {
            self.end_round(cx, mean, apply_s)?;
        }
        Ok(None)
    }

    fn end_round(&mut self, cx: &mut PsContext<'_>, mean: &Mean, apply_s: Duration) -> Result<()> {
        self.rounds += 1;
        cx.log_quiet(&format!(
            "round {} v{} loss={:.4} pushes={} wait={:.1}ms apply={:.1}ms round={:.1}ms",
            self.rounds,
            self.model.version(),
            mean.loss,
            mean.pushes,
            self.wait.as_secs_f64() * 1e3,
            apply_s.as_secs_f64() * 1e3,
            self.round_started.elapsed().as_secs_f64() * 1e3
        ))?;
        metrics::histogram!("flotilla_ps_round_seconds")
            .record(self.round_started.elapsed().as_secs_f64());
        self.wait = Duration::ZERO;
        self.round_started = Instant::now();
        // Closing the old span ends the round in the timeline.
        self.round_span = round_span(self.rounds + 1);
        // Every update of the round counts: its samples in all, its loss weighted by them.
        let (loss_sum, samples) = std::mem::take(&mut self.round_sum);
        let loss = if samples > 0 {
            (loss_sum / samples as f64) as f32
        } else {
            mean.loss
        };
        self.round_done = Some((loss, samples));
        Ok(())
    }

    /// Makes the engine hold the whole model at this round (gathers the other shards) and,
    /// with `state`, every shard's optimizer state (for a checkpoint).
    fn gather_all(&mut self, cx: &mut PsContext<'_>, state: bool) -> Result<()> {
        if self.finished.is_some() {
            return Ok(());
        }
        let v = if self.sync { self.model.version() } else { 0 };
        gather(
            cx,
            &mut *self.engine,
            (&self.shard, self.shard_inbox.as_ref()),
            &mut self.model,
            (v, state),
        )
    }

    /// Stops every child (and, from the root, every shard server) and says how it went.
    pub fn finish(&mut self, cx: &mut PsContext<'_>) -> Result<RootOutcome> {
        if let Some(done) = &self.finished {
            return Ok(done.clone());
        }
        self.held_reply = None;
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
                &mut *self.engine,
                (&self.shard, self.shard_inbox.as_ref()),
                &mut self.model,
                (v, true),
            )?;
            for &rank in &self.shard.servers[1..] {
                let _ = send(cx.comm, rank, &stop);
            }
        }
        for &c in self.members.active() {
            // A child that already left cannot be told; that is not an error at the end.
            let _ = send(cx.comm, c, &stop);
        }
        cx.log(&format!("stopping: {reason}"))?;
        for r in self.rejoins.all() {
            cx.log(&r.to_string())?;
        }
        let updates = self.updates;
        let outcome = RootOutcome {
            rounds: self.rounds,
            updates,
            reason,
            lost: self.members.lost().to_vec(),
            max_staleness: self.max_staleness,
            mean_staleness: if updates > 0 {
                self.staleness_sum as f64 / updates as f64
            } else {
                0.0
            },
            busy_s: self.first_update.map_or(0.0, |t| t.elapsed().as_secs_f64()),
        };
        self.finished = Some(outcome.clone());
        Ok(outcome)
    }

    /// A shard server whose children leave is being stopped by the root: wait for that.
    pub(super) fn expect_stop(&mut self, child: usize) {
        self.awaiting_stop
            .get_or_insert((child, Instant::now() + self.timeout));
    }
}

impl ServerMachine for ShardServer {
    fn flush(&mut self, cx: &mut PsContext<'_>) -> Result<()> {
        ShardServer::flush(self, cx)
    }

    fn peers(&self) -> Vec<usize> {
        let mut peers = self.members.children().to_vec();
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
            PsMessage::Members { left_out } if self.job_workers.is_some() => {
                let Some(job) = &mut self.job_workers else {
                    return Ok(());
                };
                let line = job.report(from, &left_out)?;
                cx.log(&line)
            }
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
        reject(cx, from, &Refusal::lasting(e.to_string()))
    }

    /// An async server goes on without a child that failed, as without a lost one.
    fn goes_on_without(&self, peer: usize) -> bool {
        (!self.sync || self.members.elastic()) && (self.is_root || peer != self.root)
    }

    fn on_lost(&mut self, cx: &mut PsContext<'_>, peer: usize, e: CommError) -> Result<()> {
        if peer == self.root && !self.is_root {
            return Err(TrainError::Peer {
                peer,
                message: format!("root server rank {peer} lost: {e}"),
            });
        }
        if !self.members.active().contains(&peer) {
            return Ok(());
        }
        if self.members.elastic() {
            return self.leave_out(cx, &[peer], &format!("lost ({e})"));
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
        self.members.lose(peer);
        cx.log(&format!(
            "rank {peer} lost ({e}); async training continues with {} of {} children",
            self.members.active().len(),
            self.members.children().len()
        ))?;
        if self.members.active().is_empty() {
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

    fn on_back(&mut self, cx: &mut PsContext<'_>, peer: usize) -> Result<()> {
        if self.sync && !self.members.elastic() {
            return Ok(());
        }
        if !self.members.take_back(peer, true) {
            return Ok(());
        }
        let r = self.rejoins.back(peer, self.model.version());
        cx.log(&self.members.back_line(peer, self.rounds, r.version))
    }

    fn on_deadline(&mut self, cx: &mut PsContext<'_>, waited: Duration) -> Result<()> {
        if let Some((child, _)) = self.awaiting_stop {
            return Err(lost_child(child, self.rounds));
        }
        if self.members.elastic() && self.sync {
            return self.silent_left_out(cx, waited);
        }
        let silent = if self.sync {
            self.members.pending()
        } else {
            self.members.active()
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

/// How long a server waits for its children (`deadlines.rs`): longer for the global server
/// of a hierarchical job, whose children are local servers waiting on their workers.
fn children_deadline(cx: &Cx<'_>, place: &Place) -> Duration {
    let factor = match place.role.kind {
        RoleKind::GlobalServer => deadlines::GLOBAL_ON_LOCALS,
        _ => deadlines::SERVER_ON_WORKERS,
    };
    deadlines::of(cx.config, factor)
}

/// The timeline span of round `round`, from now until it is dropped.
fn round_span(round: u64) -> tracing::Span {
    tracing::info_span!(target: "flotilla::ps", "ps_round", round)
}

fn lost_child(child: usize, rounds: u64) -> TrainError {
    TrainError::Peer {
        peer: child,
        message: format!(
            "rank {child} lost at round {rounds} and the root did not stop the run in time"
        ),
    }
}

impl Strategy for ShardServer {
    fn name(&self) -> &'static str {
        if self.is_root { "root" } else { "shard-server" }
    }

    fn evaluation(&self) -> Evaluation {
        if self.is_root {
            Evaluation::Local
        } else {
            Evaluation::None
        }
    }

    fn counting(&self) -> Counting {
        self.counting
    }

    fn start(&mut self, cx: &mut Cx<'_>) -> Result<()> {
        self.announcement.log(cx)
    }

    fn writes_checkpoints(&self) -> bool {
        self.is_root
    }

    fn stops_itself(&self) -> bool {
        self.is_root
    }

    fn step(&mut self, cx: &mut Cx<'_>, _data: &mut Batches, _done: u64) -> Result<Step> {
        let served = self.flush(cx).and_then(|()| {
            let inbox = self.inbox.clone();
            let timeout = self.timeout;
            serve_one(self, cx, &inbox, timeout)
        });
        if let Err(e) = served {
            // Everyone this server talks to fails naming the same culprit.
            let mut down = self.members.children().to_vec();
            let mut up = Vec::new();
            if self.is_root {
                down.extend_from_slice(&self.shard.servers[1..]);
            } else {
                up.push(self.root);
            }
            return Err(super::abort_peers(cx.comm, &down, &up, e));
        }
        if let Some(reason) = &self.stop_reason
            && !self.is_root
        {
            // A shard server told to stop by the root.
            let reason = reason.clone();
            self.finish(cx)?;
            return Ok(Step {
                done: Some(reason),
                ..Step::default()
            });
        }
        Ok(match self.round_done.take() {
            Some((loss, samples)) => Step {
                progressed: true,
                loss: Some(loss),
                samples,
                done: None,
            },
            None => Step {
                loss: self.bad_loss.take(),
                ..Step::default()
            },
        })
    }

    /// The whole model and every shard's optimizer state at the root (before a checkpoint).
    fn prepare_model(&mut self, cx: &mut Cx<'_>) -> Result<()> {
        self.gather_all(cx, true)
    }

    fn model(&mut self) -> Option<&mut dyn ModelState> {
        Some(&mut *self.engine)
    }

    /// The root evaluates the whole model (the other shards gathered first).
    fn evaluate(&mut self, cx: &mut Cx<'_>) -> Result<EvalStats> {
        self.gather_all(cx, false)?;
        crate::eval::full(&*self.engine, cx.test)
    }

    /// The root loads the checkpoint and every server goes on from its round, a shard
    /// server from the root's parameters and its shard's optimizer state (the checkpoint
    /// holds every shard's, so it resumes at another number of shard servers too). A fresh
    /// start of several shard servers starts every shard from the root's initial parameters.
    fn restore(&mut self, cx: &mut Cx<'_>, from: &Resume) -> Result<Option<CheckpointState>> {
        let n = self.engine.num_params();
        let model = Some(&mut *self.engine as &mut dyn ModelState);
        let resync = (self.resync_from, true);
        let Some(state) = super::job::restore(cx, from, (model, n), resync)? else {
            if self.resync_from.is_some() && !from.rejoined() {
                self.resume_at(0)?;
            }
            return Ok(None);
        };
        self.resume_at(state.step)?;
        Ok(Some(state))
    }

    fn stop(&mut self, cx: &mut Cx<'_>, reason: &str) -> Result<()> {
        self.stop_reason = Some(reason.to_string());
        self.finish(cx).map(|_| ())
    }

    fn figures(&self, cx: &Cx<'_>) -> Vec<(&'static str, f64)> {
        let Some(o) = self.finished.as_ref().filter(|_| self.is_root) else {
            return Vec::new();
        };
        let received = cx.comm.stats().bytes_received as f64;
        vec![
            ("updates", o.updates as f64),
            ("rounds", o.rounds as f64),
            ("max_staleness", o.max_staleness as f64),
            ("mean_staleness", o.mean_staleness),
            ("lost_children", o.lost.len() as f64),
            ("rejoined_children", self.rejoins.all().len() as f64),
            ("bytes_per_round", received / o.rounds.max(1) as f64),
            (
                "updates_per_s",
                o.updates.saturating_sub(1) as f64 / o.busy_s.max(1e-9),
            ),
        ]
    }

    fn report(&self, cx: &Cx<'_>) -> Option<String> {
        let o = self.finished.as_ref()?;
        if !self.is_root {
            return None;
        }
        let received = cx.comm.stats().bytes_received;
        Some(format!(
            "root: {} updates in {} rounds ({}), staleness max {} mean {:.2}, lost children [{}], received {:.0} bytes/round, {:.1} updates/s",
            o.updates,
            o.rounds,
            o.reason,
            o.max_staleness,
            o.mean_staleness,
            o.lost
                .iter()
                .map(|r| r.to_string())
                .collect::<Vec<_>>()
                .join(", "),
            received as f64 / o.rounds.max(1) as f64,
            o.updates.saturating_sub(1) as f64 / o.busy_s.max(1e-9)
        ))
    }
}
