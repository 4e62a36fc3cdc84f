//! A local server as a state machine: a server to its workers and a child of its parent.
//!
//! - Sync: one averaged push up per round of all children; the parent's reply starts the
//!   next round for everyone. Losing a child or the parent ends the run naming it — except
//!   in an elastic job (`flotilla launch -n MIN:MAX`), where a lost or silent worker is left
//!   out by the rules of `members.rs` (the round closes with the others' pushes, a left-out
//!   worker's pushes are refused for good, a replacement is taken back) and the parent is
//!   told who is out, to keep the job's minimum; a local server whose every worker is out
//!   ends the run naming them.
//! - Async: answers each child at once with the newest parameters it has, and pushes up the
//!   mean of what it gathered whenever its previous push has been answered. A lost child is
//!   logged and the others go on; a parent that leaves a push unanswered past the deadline
//!   ends the run naming it, even while the children keep pushing.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use flotilla_engine::ModelState;
use flotilla_tcp::CommError;

use super::job::{Announcement, Place};
use super::members::{Left, Members, min_children};
use super::rejoins::Rejoins;
use super::serve::{ServerMachine, serve_one};
use super::server::{Params, PushCheck, list, reject};
use super::{PsContext, Refusals, deadlines};
use super::{send, send_bytes};
use crate::batches::Batches;
use crate::checkpoint::CheckpointState;
use crate::error::{Result, TrainError};
use crate::plan::Counting;
use crate::strategy::{Cx, Evaluation, Resume, Setup, Step, Strategy};
use flotilla_ps::PsMessage;
use flotilla_ps::{Accumulator, Admission, Inbox, Mean, Refusal};

/// Local server state.
pub struct LocalServer {
    parent: usize,
    /// Its workers and who of them takes part (`members.rs`).
    members: Members,
    sync: bool,
    len: usize,
    admission: Admission,
    averaging: bool,
    /// The newest parameters from the parent.
    params: Option<Params>,
    /// Children that pulled before there was anything to give.
    early_pulls: Vec<usize>,
    acc: Accumulator,
    /// A pull or push up is waiting for the parent's answer, since then.
    outstanding: Option<Instant>,
    /// The parent's refusals of this server's pushes up in a row.
    refusals: Refusals,
    pushes_up: u64,
    round_started: Instant,
    stopped: Option<String>,
    inbox: Inbox,
    timeout: Duration,
    /// The loss and samples of the last push up, for the run loop.
    pushed: Option<(f32, u64)>,
    /// Children lost while the run went on (async), and lost children that came back.
    lost: u64,
    rejoined: u64,
    /// Children taken back (replaced workers that rejoined), and the pushes accepted from
    /// each replacement.
    rejoins: Rejoins,
    /// What it says when it starts.
    announcement: Announcement,
    /// How the run counts its rounds.
    counting: Counting,
    /// See [`super::job::Place::resync_from`].
    resync_from: Option<usize>,
    /// The most samples a child can claim in a push (each child is a worker).
    max_samples: u64,
    /// The most samples a push up claims: one push of every child. An async server that
    /// gathered more while its parent was busy says this many, so that its parent's check
    /// holds and one fast group cannot outweigh the others beyond its size.
    max_up: u64,
}

impl LocalServer {
    /// This rank's local server in the job of `setup`, between its parent and its workers.
    pub fn build(cx: &mut Cx<'_>, setup: &Setup<'_>) -> Result<Self> {
        let place = Place::of(cx, setup)?;
        let (parent, children, sync) = (
            place.role.parents.first().copied().unwrap_or(0),
            &place.role.children,
            place.sync,
        );
        let min = min_children(cx.config, setup.topology, cx.rank);
        // It holds no model of its own: the model is built once to count its parameters.
        let len = setup.engine(cx.config, &cx.config.optimizer)?.num_params();
        let mut peers = children.to_vec();
        peers.push(parent);
        Ok(Self {
            announcement: place.announcement.clone(),
            counting: place.counting((1, 0)),
            resync_from: place.resync_from,
            max_samples: place.max_samples.iter().copied().max().unwrap_or(0),
            max_up: place.max_samples.iter().sum(),
            inbox: Inbox::listen(cx.comm, &peers),
            timeout: deadlines::of(cx.config, deadlines::SERVER_ON_WORKERS),
            pushed: None,
            rejoins: Rejoins::default(),
            parent,
            members: Members::new(children, sync, min),
            sync,
            len,
            admission: if sync {
                Admission::Sync
            } else {
                Admission::Async {
                    max_staleness: cx.config.topology.max_staleness,
                }
            },
            averaging: cx.config.topology.local_steps > 1,
            params: None,
            early_pulls: Vec::new(),
            acc: Accumulator::new(len, sync),
            outstanding: None,
            refusals: Refusals::default(),
            pushes_up: 0,
            round_started: Instant::now(),
            stopped: None,
            lost: 0,
            rejoined: 0,
        })
    }

    /// How long a push or pull up may stay unanswered (`deadlines.rs`): longer than the
    /// parent waits for its slowest child, so a parent stuck waiting for another rank fails
    /// first and tells this server which rank is at fault; only a parent that is itself
    /// silent lets this deadline fire.
    fn parent_timeout(&self) -> Duration {
        self.timeout
            .mul_f64(deadlines::LOCAL_ON_GLOBAL / deadlines::SERVER_ON_WORKERS)
    }

    /// How many times it pushed up.
    pub fn pushes_up(&self) -> u64 {
        self.pushes_up
    }

    /// Why it stopped, once it has.
    pub fn stop_reason(&self) -> Option<&str> {
        self.stopped.as_deref()
    }

    fn push_up(&mut self, cx: &mut PsContext<'_>, version: u64, mean: Mean) -> Result<()> {
        // The staleness the mean already carries relative to the version it is pushed at.
        let staleness = (version as f64 - mean.base_version).round().max(0.0) as u32;
        let (loss, samples) = (mean.loss, mean.samples);
        send(
            cx.comm,
            self.parent,
            &PsMessage::Push {
                version,
                staleness,
                samples: mean.samples.min(self.max_up).min(u32::MAX as u64) as u32,
                loss: mean.loss,
                delta: self.averaging,
                values: mean.values,
            },
        )?;
        self.outstanding = Some(Instant::now());
        self.pushes_up += 1;
        self.pushed = Some((loss, samples));
        Ok(())
    }

    /// New parameters from the parent.
    fn on_params(&mut self, cx: &mut PsContext<'_>, version: u64, values: Vec<f32>) -> Result<()> {
        self.outstanding = None;
        let first = self.params.is_none();
        let p = Params { version, values };
        if self.sync || first {
            // Sync: the new round starts for everyone. Async: answer the children that
            // pulled before there was anything to give.
            let msg = p.encoded();
            let round = self.members.next_round();
            let targets: Vec<usize> = if self.sync && !first {
                round
            } else {
                std::mem::take(&mut self.early_pulls)
            };
            for c in targets {
                send_bytes(cx.comm, c, &msg)?;
            }
            cx.log_quiet(&format!(
                "v{version} from rank {}; round {:.1}ms",
                self.parent,
                self.round_started.elapsed().as_secs_f64() * 1e3
            ))?;
            self.round_started = Instant::now();
        }
        self.params = Some(p);
        if !self.sync
            && let Some(mean) = self.acc.take()
        {
            self.push_up(cx, version, mean)?;
        }
        Ok(())
    }

    fn on_parent(&mut self, cx: &mut PsContext<'_>, msg: PsMessage) -> Result<()> {
        match msg {
            PsMessage::Params { version, values } => {
                self.refusals.params();
                self.on_params(cx, version, values)
            }
            PsMessage::Stop { reason } => {
                let stop = PsMessage::Stop {
                    reason: reason.clone(),
                };
                for &c in self.members.active() {
                    let _ = send(cx.comm, c, &stop);
                }
                cx.log(&format!(
                    "stop from rank {} ({reason}); pushed up {} times",
                    self.parent, self.pushes_up
                ))?;
                for r in self.rejoins.all() {
                    cx.log(&r.to_string())?;
                }
                self.stopped = Some(reason);
                Ok(())
            }
            PsMessage::Reject { reason, retry } => {
                self.refusals.refused(self.parent, reason.clone(), retry)?;
                cx.log(&format!(
                    "push rejected by rank {}: {reason}; pulling again",
                    self.parent
                ))?;
                send(cx.comm, self.parent, &PsMessage::Pull)?;
                self.outstanding = Some(Instant::now());
                Ok(())
            }
            other => Err(TrainError::Protocol {
                peer: self.parent,
                message: format!(
                    "a local server expects params, stop or reject from its parent, got {}",
                    other.name()
                ),
            }),
        }
    }

    /// A child's push: admitted (or refused, changing nothing), then pushed up when the
    /// round is complete (sync) or the parent is free (async).
    pub fn on_push(&mut self, cx: &mut PsContext<'_>, child: usize, msg: PsMessage) -> Result<()> {
        if self.members.left_out(child) {
            return reject(cx, child, &Members::refusal(child, self.pushes_up));
        }
        let Some(current) = self.params.as_ref().map(|p| p.version) else {
            return reject(cx, child, &Refusal::retry("no parameters yet: pull first"));
        };
        let check = PushCheck {
            admission: self.admission,
            current,
            len: self.len,
            averaging: self.averaging,
            sync_pending: self.sync.then_some(self.members.pending()),
            max_samples: self.max_samples,
        };
        if check.take(cx, &mut self.acc, child, msg)?.is_none() {
            return Ok(());
        }
        self.rejoins.accepted(child);
        if self.sync {
            if self.members.pushed(child)
                && let Some(mean) = self.acc.take()
            {
                self.push_up(cx, current, mean)?;
            }
            return Ok(());
        }
        if let Some(p) = &self.params {
            send_bytes(cx.comm, child, &p.encoded())?;
        }
        if self.outstanding.is_none()
            && let Some(mean) = self.acc.take()
        {
            self.push_up(cx, current, mean)?;
        }
        Ok(())
    }
}

impl LocalServer {
    /// A child's pull: answered with the newest parameters — except in a sync round already
    /// pushed up, which the parent's reply answers for every child taking part (a
    /// replacement taken back then would otherwise push on parameters already replaced).
    fn on_pull(&mut self, cx: &mut PsContext<'_>, from: usize) -> Result<()> {
        match &self.params {
            Some(_)
                if self.sync
                    && self.outstanding.is_some()
                    && self.members.active().contains(&from) =>
            {
                Ok(())
            }
            Some(p) => send_bytes(cx.comm, from, &p.encoded()),
            None => {
                self.early_pulls.push(from);
                Ok(())
            }
        }
    }

    /// Leaves `peers` (workers taking part) out of an elastic job's rounds (`why`), tells
    /// the parent, and pushes a sync round that waited only for them up.
    fn leave_out(&mut self, cx: &mut PsContext<'_>, peers: &[usize], why: &str) -> Result<()> {
        let Left::Out(round_closes) = self.members.leave_out(peers) else {
            let out = self.members.out_with(peers);
            return Err(TrainError::Peer {
                peer: peers.first().copied().unwrap_or(self.parent),
                message: format!(
                    "every worker of this local server is left out (rank(s) {}): it trains \
                     with one at least",
                    list(&out)
                ),
            });
        };
        self.lost += peers.len() as u64;
        cx.log(&self.members.left_line(peers, why, self.pushes_up))?;
        send(cx.comm, self.parent, &self.members.report())?;
        let current = self.params.as_ref().map(|p| p.version);
        if round_closes
            && let Some(version) = current
            && let Some(mean) = self.acc.take()
        {
            self.push_up(cx, version, mean)?;
        }
        Ok(())
    }
}

impl ServerMachine for LocalServer {
    fn peers(&self) -> Vec<usize> {
        let mut peers = self.members.children().to_vec();
        peers.push(self.parent);
        peers
    }

    fn on_start(&mut self, cx: &mut PsContext<'_>) -> Result<()> {
        cx.log(&format!(
            "local server ({}) under rank {} with children [{}]",
            if self.sync { "sync" } else { "async" },
            self.parent,
            list(self.members.active())
        ))?;
        send(cx.comm, self.parent, &PsMessage::Pull)?;
        self.outstanding = Some(Instant::now());
        Ok(())
    }

    fn on_message(&mut self, cx: &mut PsContext<'_>, from: usize, msg: PsMessage) -> Result<()> {
        if from == self.parent {
            return self.on_parent(cx, msg);
        }
        // Children that keep talking must not hide a parent that stopped answering.
        if let Some(since) = self.outstanding
            && since.elapsed() > self.parent_timeout()
        {
            return Err(TrainError::ParentSilent {
                peer: self.parent,
                after: self.parent_timeout(),
            });
        }
        match msg {
            PsMessage::Pull if self.members.left_out(from) => {
                reject(cx, from, &Members::refusal(from, self.pushes_up))
            }
            PsMessage::Pull => self.on_pull(cx, from),
            msg @ PsMessage::Push { .. } => self.on_push(cx, from, msg),
            other => Err(TrainError::Protocol {
                peer: from,
                message: format!("a server expects pull or push, got {}", other.name()),
            }),
        }
    }

    fn on_malformed(&mut self, cx: &mut PsContext<'_>, from: usize, e: TrainError) -> Result<()> {
        if from == self.parent {
            return Err(TrainError::Peer {
                peer: from,
                message: e.to_string(),
            });
        }
        reject(cx, from, &Refusal::lasting(e.to_string()))
    }

    /// An async or elastic local server goes on without a child that failed, as without a
    /// lost one.
    fn goes_on_without(&self, peer: usize) -> bool {
        (!self.sync || self.members.elastic()) && peer != self.parent
    }

    fn on_lost(&mut self, cx: &mut PsContext<'_>, peer: usize, e: CommError) -> Result<()> {
        if peer != self.parent && self.members.elastic() {
            if !self.members.active().contains(&peer) {
                return Ok(());
            }
            return self.leave_out(cx, &[peer], &format!("lost ({e})"));
        }
        if peer == self.parent || self.sync {
            return Err(TrainError::Peer {
                peer,
                message: format!("rank {peer} lost: {e}"),
            });
        }
        if self.members.lose(peer) {
            self.lost += 1;
            cx.log(&format!(
                "rank {peer} lost ({e}); continuing with {} children",
                self.members.active().len()
            ))?;
        }
        if self.members.active().is_empty() {
            return Err(TrainError::Peer {
                peer,
                message: "every child of this local server is lost".into(),
            });
        }
        Ok(())
    }

    fn on_back(&mut self, cx: &mut PsContext<'_>, peer: usize) -> Result<()> {
        if self.sync && !self.members.elastic() {
            return Ok(());
        }
        // A sync round already pushed up is answered by the parent's reply; the replacement
        // waits for the next one.
        if !self.members.take_back(peer, self.outstanding.is_none()) {
            return Ok(());
        }
        self.rejoined += 1;
        let r = self
            .rejoins
            .back(peer, self.params.as_ref().map_or(0, |p| p.version));
        cx.log(&self.members.back_line(peer, self.pushes_up, r.version))?;
        if self.members.elastic() {
            send(cx.comm, self.parent, &self.members.report())?;
        }
        Ok(())
    }

    fn on_deadline(&mut self, cx: &mut PsContext<'_>, waited: Duration) -> Result<()> {
        if let Some(since) = self.outstanding {
            // A deadline on the parent: told down, not up (the parent is itself waiting
            // for the rank at fault, and its own deadline names it).
            return Err(TrainError::ParentSilent {
                peer: self.parent,
                after: since.elapsed().max(waited),
            });
        }
        if self.sync && self.members.elastic() {
            let silent: Vec<usize> = self.members.pending().iter().copied().collect();
            return self.leave_out(cx, &silent, &format!("silent for {waited:?}"));
        }
        let silent: BTreeSet<usize> = if self.sync {
            self.members.pending().clone()
        } else {
            self.members.active().clone()
        };
        Err(TrainError::Peer {
            peer: silent.first().copied().unwrap_or(self.parent),
            message: format!(
                "local server: no message from rank(s) {} within {waited:?}",
                list(&silent)
            ),
        })
    }

    fn done(&self) -> bool {
        self.stopped.is_some()
    }
}

impl Strategy for LocalServer {
    fn name(&self) -> &'static str {
        "local-server"
    }

    fn evaluation(&self) -> Evaluation {
        Evaluation::None
    }

    fn counting(&self) -> Counting {
        self.counting
    }

    fn model(&mut self) -> Option<&mut dyn ModelState> {
        None
    }

    fn restore(&mut self, cx: &mut Cx<'_>, from: &Resume) -> Result<Option<CheckpointState>> {
        super::job::restore(cx, from, (None, self.len), (self.resync_from, false))
    }

    /// How many children it lost while the run went on, and how many came back.
    fn figures(&self, _cx: &Cx<'_>) -> Vec<(&'static str, f64)> {
        vec![
            ("lost_children", self.lost as f64),
            ("rejoined_children", self.rejoined as f64),
        ]
    }

    fn start(&mut self, cx: &mut Cx<'_>) -> Result<()> {
        self.announcement.log(cx)?;
        self.on_start(cx)
    }

    fn step(&mut self, cx: &mut Cx<'_>, _data: &mut Batches, _done: u64) -> Result<Step> {
        let inbox = self.inbox.clone();
        let timeout = match self.outstanding {
            // The parent's answer is awaited until its own deadline has passed.
            Some(since) => self.parent_timeout().saturating_sub(since.elapsed()),
            None => self.timeout,
        };
        if let Err(e) = serve_one(self, cx, &inbox, timeout) {
            // Its parent and children fail naming the same culprit.
            return Err(super::abort_peers(
                cx.comm,
                self.members.children(),
                &[self.parent],
                e,
            ));
        }
        if let Some(reason) = &self.stopped {
            return Ok(Step {
                done: Some(reason.clone()),
                ..Step::default()
            });
        }
        Ok(match self.pushed.take() {
            Some((loss, samples)) => Step {
                progressed: true,
                loss: Some(loss),
                samples,
                done: None,
            },
            None => Step::default(),
        })
    }
}
