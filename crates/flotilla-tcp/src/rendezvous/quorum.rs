//! The membership of an elastic job as the lighthouse keeps it ([`super::lighthouse`]): a
//! state machine without I/O. It takes what the connections say (an enlistment, a mesh
//! ready or failed, a connection closed) and the clock, and says what to send.
//!
//! A generation is a set of processes (named by their slots) in rank order. It forms when
//! every member of the previous generation still connected has enlisted again (or at the
//! agreement deadline, without those that did not), with the processes waiting to join;
//! the first generation waits for the job's maximum until the join deadline. Rank 0 of a
//! new generation is a member that holds the most steps (the one every other member takes
//! its state from); the other members keep their order, joiners come last. The members
//! build their mesh, say `Ready`, and the lighthouse says `Go`. Fewer than the minimum at a
//! deadline ends the job, naming the lost processes. A process that comes back from a
//! generation the job has left is refused: it exits and is replaced.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use flotilla_group::{PeerName, RendezvousError};
use tokio::time::Instant;

use crate::wire::{Ctrl, Formed, RENDEZVOUS_PROTOCOL};

/// What a process said when it enlisted.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Enlisted {
    /// Its slot (the launcher's name for the process).
    pub slot: u64,
    /// Its address, for naming it.
    pub addr: String,
    /// Where it accepts mesh connections.
    pub mesh_addr: String,
    /// Its host key.
    pub host: String,
    /// The generation it was last a member of (0: none).
    pub generation: u64,
    /// The optimizer steps its training state holds (`None`: none, a joiner).
    pub step: Option<u64>,
    /// The protocol version it speaks.
    pub protocol: u32,
    /// Its config hash.
    pub config_hash: u64,
}

/// What the lighthouse does after an event.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Out {
    /// Send `Ctrl` to the process of this slot.
    Send(u64, Ctrl),
    /// Close the connection of this slot (after what was sent).
    Close(u64),
    /// A generation is running (after its `Go`): its number and members, by rank.
    Running(u64, Vec<u64>),
    /// A member's run ended: the job is ending.
    Finished,
    /// The job cannot go on.
    Failed(RendezvousError),
}

/// The job's bounds and deadlines.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Bounds {
    /// Fewest ranks the job runs with.
    pub min: usize,
    /// Most ranks it takes.
    pub max: usize,
    /// How many processes the first generation waits for (the ones started with the job;
    /// `max` unless fewer were): more may join it later, up to `max`.
    pub first: usize,
    /// How long the first generation waits for its `first` processes.
    pub join_timeout: Duration,
    /// How long a later generation waits for the previous one's members to enlist again.
    pub agreement: Duration,
    /// How long members have to build their mesh.
    pub mesh: Duration,
    /// Ranks per replica: a generation has whole replicas of this many (a pipeline's
    /// stages; 1 otherwise), and rank `r` runs stage `r % unit` ([`super::replicas`]).
    pub unit: usize,
}

/// How often a process waiting for a generation hears that it stands by.
const STANDBY_EVERY: Duration = Duration::from_secs(2);

#[derive(Debug)]
enum Phase {
    /// Collecting enlistments for generation `generation + 1` until `deadline`.
    Forming {
        enlisted: BTreeMap<u64, Enlisted>,
        deadline: Instant,
    },
    /// The members of `generation` build their mesh; `ready` have.
    Meshing {
        ready: BTreeSet<u64>,
        deadline: Instant,
    },
    Running,
    /// A member's run ended: the job is ending (no new generation; leaving is not a loss).
    Finished,
    Failed,
}

/// The membership (see the module's documentation).
#[derive(Debug)]
pub(crate) struct Quorum {
    bounds: Bounds,
    /// The newest generation formed (0: none yet).
    generation: u64,
    /// Its members' slots, by rank, and what each said when it enlisted.
    members: Vec<Enlisted>,
    phase: Phase,
    /// Processes waiting to join while a generation builds its mesh.
    waiting: BTreeMap<u64, Enlisted>,
    /// Slots with an open connection.
    connected: BTreeSet<u64>,
    /// The job's config hash (the first enlistment's).
    config_hash: Option<u64>,
    /// Processes lost, as "slot S (rank R of generation G)", oldest first.
    lost: Vec<String>,
    /// Whether a generation ever ran (until then nobody holds training state, and a
    /// generation waits for the maximum, as the first).
    ran: bool,
    /// When the processes waiting next hear that they stand by.
    next_standby: Instant,
}

impl Quorum {
    /// A job that has not formed a generation yet, waiting until `now + join_timeout`.
    pub(crate) fn new(bounds: Bounds, now: Instant) -> Self {
        Self {
            bounds,
            generation: 0,
            members: Vec::new(),
            phase: Phase::Forming {
                enlisted: BTreeMap::new(),
                deadline: now + bounds.join_timeout,
            },
            waiting: BTreeMap::new(),
            connected: BTreeSet::new(),
            config_hash: None,
            lost: Vec::new(),
            ran: false,
            next_standby: now,
        }
    }

    /// The newest generation formed.
    #[cfg(test)]
    pub(crate) fn generation(&self) -> u64 {
        self.generation
    }

    /// Whether the job has ended in failure.
    #[cfg(test)]
    pub(crate) fn failed(&self) -> bool {
        matches!(self.phase, Phase::Failed)
    }

    /// A process enlisted (its connection open until it closes: [`Quorum::closed`]).
    pub(crate) fn enlist(&mut self, e: Enlisted, now: Instant) -> Vec<Out> {
        self.connected.insert(e.slot);
        if let Err(re) = self.admissible(&e) {
            return vec![
                Out::Send(e.slot, Ctrl::Reject(re.redacted())),
                Out::Close(e.slot),
            ];
        }
        self.config_hash.get_or_insert(e.config_hash);
        let mut out = Vec::new();
        let joiner = e.step.is_none() && !self.is_member(e.slot);
        let grows = self.grows_with(1);
        match &mut self.phase {
            Phase::Failed => return vec![Out::Close(e.slot)],
            Phase::Finished => {
                let re = RendezvousError::MasterFailed {
                    reason: "the job has finished".into(),
                };
                return vec![Out::Send(e.slot, Ctrl::Reject(re)), Out::Close(e.slot)];
            }
            Phase::Forming { enlisted, .. } => {
                enlisted.insert(e.slot, e);
            }
            Phase::Meshing { .. } if joiner => {
                self.waiting.insert(e.slot, e);
                return out;
            }
            // Not enough for another whole replica yet: it stands by.
            Phase::Running if joiner && !grows => {
                out.push(Out::Send(e.slot, self.standby()));
                self.waiting.insert(e.slot, e);
                return out;
            }
            // A member whose mesh failed, or the first news of a change.
            Phase::Meshing { .. } | Phase::Running => {
                self.start_forming(now, &mut out);
                // It has enlisted: no need to tell it to.
                out.retain(|o| !matches!(o, Out::Send(s, Ctrl::Regroup { .. }) if *s == e.slot));
                if let Phase::Forming { enlisted, .. } = &mut self.phase {
                    enlisted.insert(e.slot, e);
                }
            }
        }
        self.try_form(now, false, &mut out);
        out
    }

    /// A member built its mesh.
    pub(crate) fn ready(&mut self, slot: u64, now: Instant) -> Vec<Out> {
        let mut out = Vec::new();
        let Phase::Meshing { ready, .. } = &mut self.phase else {
            return out;
        };
        if self.members.iter().any(|m| m.slot == slot) {
            ready.insert(slot);
        }
        if ready.len() == self.members.len() {
            for m in &self.members {
                out.push(Out::Send(m.slot, Ctrl::Go));
            }
            out.push(Out::Running(
                self.generation,
                self.members.iter().map(|m| m.slot).collect(),
            ));
            self.phase = Phase::Running;
            self.ran = true;
            if self.grows_with(0) {
                self.start_forming(now, &mut out);
                self.try_form(now, false, &mut out);
            }
        }
        out
    }

    /// A member's run ended: no generation forms any more, and members that leave are not
    /// lost.
    pub(crate) fn finished(&mut self, slot: u64) -> Vec<Out> {
        if !(self.is_member(slot) && matches!(self.phase, Phase::Running)) {
            return Vec::new();
        }
        self.phase = Phase::Finished;
        let mut out = vec![Out::Finished];
        let re = RendezvousError::StoodBy {
            generation: self.generation,
        };
        for slot in std::mem::take(&mut self.waiting).into_keys() {
            out.push(Out::Send(slot, Ctrl::Reject(re.clone())));
            out.push(Out::Close(slot));
        }
        out
    }

    /// A member could not build its mesh: the generation forms again.
    pub(crate) fn mesh_failed(&mut self, slot: u64, now: Instant) -> Vec<Out> {
        let mut out = Vec::new();
        if matches!(self.phase, Phase::Meshing { .. }) && self.is_member(slot) {
            self.start_forming(now, &mut out);
        }
        out
    }

    /// A process's connection closed: it is gone (a member is lost).
    pub(crate) fn closed(&mut self, slot: u64, now: Instant) -> Vec<Out> {
        let mut out = Vec::new();
        self.connected.remove(&slot);
        self.waiting.remove(&slot);
        let member = self.is_member(slot);
        if matches!(self.phase, Phase::Finished) {
            return out;
        }
        if member {
            self.note_lost(slot);
        }
        match &mut self.phase {
            Phase::Forming { enlisted, .. } => {
                enlisted.remove(&slot);
            }
            Phase::Meshing { .. } | Phase::Running if member => {
                self.start_forming(now, &mut out);
            }
            _ => {}
        }
        self.try_form(now, false, &mut out);
        out
    }

    /// The clock: a deadline passed forms what is there or ends the job.
    pub(crate) fn tick(&mut self, now: Instant) -> Vec<Out> {
        let mut out = Vec::new();
        if now >= self.next_standby && !self.waiting.is_empty() {
            self.next_standby = now + STANDBY_EVERY;
            let standby = self.standby();
            out.extend(self.waiting.keys().map(|s| Out::Send(*s, standby.clone())));
        }
        match &self.phase {
            Phase::Forming { deadline, .. } if now >= *deadline => {
                self.try_form(now, true, &mut out);
            }
            Phase::Meshing { ready, deadline } if now >= *deadline => {
                let late: Vec<u64> = (self.members.iter())
                    .map(|m| m.slot)
                    .filter(|s| !ready.contains(s))
                    .collect();
                for slot in late {
                    // Silent while building its mesh: it is lost (its next word is stale).
                    self.note_lost(slot);
                    self.connected.remove(&slot);
                    out.push(Out::Close(slot));
                }
                self.start_forming(now, &mut out);
            }
            _ => {}
        }
        out
    }

    /// Whether `e` may enlist: protocol, config, a known generation, room.
    fn admissible(&self, e: &Enlisted) -> Result<(), RendezvousError> {
        let peer = PeerName::unranked(format!("slot {} ({})", e.slot, e.addr));
        if e.protocol != RENDEZVOUS_PROTOCOL {
            return Err(RendezvousError::ProtocolVersion {
                peer,
                expected: RENDEZVOUS_PROTOCOL,
                got: e.protocol,
            });
        }
        if let Some(hash) = self.config_hash.filter(|h| *h != e.config_hash) {
            return Err(RendezvousError::ConfigHashMismatch {
                peer,
                expected: Some(hash),
                got: e.config_hash,
            });
        }
        let member = self.is_member(e.slot);
        if e.generation != 0 && (e.generation != self.generation || !member) {
            return Err(RendezvousError::StaleGeneration {
                peer,
                generation: e.generation,
                current: self.generation,
            });
        }
        if e.generation == 0 && member {
            return Err(RendezvousError::DuplicateRank {
                peer,
                holder: format!("slot {} of generation {}", e.slot, self.generation),
            });
        }
        let survivors = self
            .members
            .iter()
            .filter(|m| self.connected.contains(&m.slot));
        let (taken, queued) = (
            survivors.count(),
            self.waiting.len() + self.forming_joiners(),
        );
        if e.generation == 0 && self.generation > 0 && taken + queued >= self.bounds.max {
            return Err(RendezvousError::JobFull {
                peer,
                max: self.bounds.max,
            });
        }
        Ok(())
    }

    /// Joiners among the enlisted of a forming generation.
    fn forming_joiners(&self) -> usize {
        match &self.phase {
            Phase::Forming { enlisted, .. } => {
                enlisted.values().filter(|e| e.step.is_none()).count()
            }
            _ => 0,
        }
    }

    /// Whether `more` processes beside the waiting ones would make the running generation
    /// another whole replica larger (within the maximum).
    fn grows_with(&self, more: usize) -> bool {
        let unit = self.bounds.unit.max(1);
        let members = self.members.len();
        let could = (members + self.waiting.len() + more).min(self.bounds.max);
        could / unit * unit > members
    }

    /// What a process waiting for a generation hears: it stands by.
    fn standby(&self) -> Ctrl {
        Ctrl::Standby {
            generation: self.generation,
        }
    }

    fn is_member(&self, slot: u64) -> bool {
        self.members.iter().any(|m| m.slot == slot)
    }

    fn note_lost(&mut self, slot: u64) {
        if let Some(rank) = self.members.iter().position(|m| m.slot == slot) {
            let name = format!(
                "slot {slot} (rank {rank} of generation {})",
                self.generation
            );
            if !self.lost.contains(&name) {
                self.lost.push(name);
            }
        }
    }

    /// Starts collecting enlistments for the next generation (with the joiners waiting),
    /// telling every connected member of the current one to enlist again.
    fn start_forming(&mut self, now: Instant, out: &mut Vec<Out>) {
        if matches!(
            self.phase,
            Phase::Forming { .. } | Phase::Failed | Phase::Finished
        ) {
            return;
        }
        let next = self.generation + 1;
        for m in &self.members {
            if self.connected.contains(&m.slot) {
                out.push(Out::Send(m.slot, Ctrl::Regroup { generation: next }));
            }
        }
        self.phase = Phase::Forming {
            enlisted: std::mem::take(&mut self.waiting),
            deadline: now + self.bounds.agreement,
        };
    }

    /// Forms the next generation when everyone awaited is in (or, `at_deadline`, with those
    /// who are), or ends the job below the minimum.
    fn try_form(&mut self, now: Instant, at_deadline: bool, out: &mut Vec<Out>) {
        let Phase::Forming { enlisted, .. } = &self.phase else {
            return;
        };
        let awaited = self
            .members
            .iter()
            .filter(|m| self.connected.contains(&m.slot))
            .all(|m| enlisted.contains_key(&m.slot));
        let survivors = enlisted.values().filter(|e| e.step.is_some()).count();
        let complete = if !self.ran {
            enlisted.len() >= self.bounds.first
        } else {
            awaited && survivors > 0
        };
        if !complete && !at_deadline {
            return;
        }
        let unit = self.bounds.unit.max(1);
        let usable = enlisted.len() / unit * unit;
        let ok = usable >= self.bounds.min.max(unit) && (!self.ran || survivors > 0);
        if !ok {
            let re = RendezvousError::BelowMinimum {
                min: self.bounds.min,
                present: if self.ran { survivors } else { enlisted.len() },
                lost: self.lost_names(),
            };
            for slot in enlisted.keys() {
                out.push(Out::Send(*slot, Ctrl::Reject(re.clone())));
                out.push(Out::Close(*slot));
            }
            out.push(Out::Failed(re));
            self.phase = Phase::Failed;
            return;
        }
        let Phase::Forming { enlisted, .. } = std::mem::replace(&mut self.phase, Phase::Running)
        else {
            return;
        };
        self.form(enlisted, now, out);
    }

    /// The lost processes, or what the first generation lacked.
    fn lost_names(&self) -> String {
        if self.lost.is_empty() {
            "none (not enough processes enlisted in time)".into()
        } else {
            self.lost.join(", ")
        }
    }

    /// The members of the next generation by rank, and the processes left to stand by:
    /// `survivors` in their old order, then `joiners`. Whole replicas when a replica has
    /// several ranks ([`super::replicas::arrange`]); else every survivor and joiner up to the
    /// maximum, rank 0 one that holds the most steps (`step`).
    fn arrange(
        &self,
        mut survivors: Vec<Enlisted>,
        joiners: Vec<Enlisted>,
        step: u64,
    ) -> (Vec<Enlisted>, Vec<Enlisted>) {
        let old: Vec<u64> = self.members.iter().map(|m| m.slot).collect();
        if self.bounds.unit > 1 {
            let (mut kept, mut others) = (Vec::new(), Vec::new());
            for e in survivors {
                match old.iter().position(|s| *s == e.slot) {
                    Some(rank) => kept.push((rank, e)),
                    // Standing by since an earlier generation.
                    None => others.push(e),
                }
            }
            others.extend(joiners);
            return super::replicas::arrange(kept, others, self.bounds.unit, self.bounds.max);
        }
        if let Some(i) = survivors.iter().position(|e| e.step == Some(step)) {
            let source = survivors.remove(i);
            survivors.insert(0, source);
        }
        let mut members: Vec<Enlisted> = survivors.into_iter().chain(joiners).collect();
        let rest = members.split_off(members.len().min(self.bounds.max));
        (members, rest)
    }

    /// Generation `generation + 1` of `enlisted` (at most the maximum: the rest wait).
    fn form(&mut self, enlisted: BTreeMap<u64, Enlisted>, now: Instant, out: &mut Vec<Out>) {
        let old: Vec<u64> = self.members.iter().map(|m| m.slot).collect();
        let (mut survivors, joiners): (Vec<Enlisted>, Vec<Enlisted>) =
            enlisted.into_values().partition(|e| e.step.is_some());
        survivors.sort_by_key(|e| old.iter().position(|s| *s == e.slot));
        let step = survivors.iter().filter_map(|e| e.step).max().unwrap_or(0);
        let (members, rest) = self.arrange(survivors, joiners, step);
        self.generation += 1;
        for extra in rest {
            out.push(Out::Send(
                extra.slot,
                Ctrl::Standby {
                    generation: self.generation,
                },
            ));
            self.waiting.insert(extra.slot, extra);
        }
        let session: u64 = rand::random();
        let peers: Vec<String> = members.iter().map(|m| m.mesh_addr.clone()).collect();
        let hosts: Vec<String> = members.iter().map(|m| m.host.clone()).collect();
        let slots: Vec<u64> = members.iter().map(|m| m.slot).collect();
        for (rank, m) in members.iter().enumerate() {
            let msg = Ctrl::Formed(Formed {
                generation: self.generation,
                rank,
                session,
                peers: peers.clone(),
                hosts: hosts.clone(),
                slots: slots.clone(),
                step,
            });
            out.push(Out::Send(m.slot, msg));
        }
        tracing::info!(
            generation = self.generation,
            ?slots,
            step,
            "lighthouse: generation formed"
        );
        self.members = members;
        self.phase = Phase::Meshing {
            ready: BTreeSet::new(),
            deadline: now + self.bounds.mesh,
        };
    }
}

#[cfg(test)]
#[path = "quorum_tests.rs"]
mod tests;
