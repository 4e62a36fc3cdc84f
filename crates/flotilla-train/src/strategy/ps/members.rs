//! Who a parameter server's rounds wait for: its children, those still taking part, those
//! yet to push in the sync round under way, and those lost or left out. One set of rules for
//! the server that owns the model (`shard_server.rs`) and a local server (`local.rs`).
//!
//! In an elastic job (`flotilla launch -n MIN:MAX` with a parameter server's workers,
//! [`crate::config::Elasticity::ServerWorkers`]) a worker lost (its connection closed) or,
//! in a sync round, silent past the deadline is left out: the round closes with the pushes
//! of the others (sample-weighted, as every round's mean is; a push the worker made before
//! it went counts), and the rounds after it wait for the remaining workers only. A push from
//! a worker left out (a frozen one that woke up) is refused for good: it stops, and the
//! launcher replaces it like a lost one. A replacement takes the rank's links back (the
//! rendezvous' rejoin), pulls the current parameters and is taken into the round under way.
//!
//! The job's minimum counts the workers of every group: a flat server sees them all; a local
//! server sees only its own, so it tells its parent which of them are left out
//! ([`PsMessage::Members`]) and the root keeps the count ([`JobWorkers`]).

use std::collections::{BTreeMap, BTreeSet};

use flotilla_cluster::{RoleKind, Topology};
use flotilla_ps::{PsMessage, Refusal};

use super::server::list;
use crate::config::{Elasticity, TrainConfig};
use crate::error::{Result, TrainError};
use flotilla_cluster::Arch;

/// A server's children and who of them takes part.
#[derive(Debug)]
pub(super) struct Members {
    children: Vec<usize>,
    active: BTreeSet<usize>,
    /// Sync: the children yet to push in this round.
    pending: BTreeSet<usize>,
    /// Children lost or left out, in the order they went.
    lost: Vec<usize>,
    sync: bool,
    /// Elastic: the fewest children the server trains on with (a local server: 1, the
    /// job's minimum is its root's to keep). `None`: a fixed-size job.
    min: Option<usize>,
    /// An elastic sync round's deadline passed with no child's push: a worker may be
    /// waiting for another shard, so the server waits once more before it leaves the silent
    /// ones out. Cleared when a round starts.
    stalled: bool,
}

/// What leaving children out did.
pub(super) enum Left {
    /// Fewer than the minimum would remain: nothing changed.
    BelowMinimum,
    /// They are out; `true`: the sync round under way waits for nobody now.
    Out(bool),
}

impl Members {
    /// `children`, all taking part, in a sync or async server, elastic down to `min`.
    pub fn new(children: &[usize], sync: bool, min: Option<usize>) -> Self {
        let active: BTreeSet<usize> = children.iter().copied().collect();
        Self {
            children: children.to_vec(),
            pending: active.clone(),
            active,
            lost: Vec::new(),
            sync,
            min,
            stalled: false,
        }
    }

    /// Every child, in the topology's order.
    pub fn children(&self) -> &[usize] {
        &self.children
    }

    /// The children taking part.
    pub fn active(&self) -> &BTreeSet<usize> {
        &self.active
    }

    /// Sync: the children yet to push in this round.
    pub fn pending(&self) -> &BTreeSet<usize> {
        &self.pending
    }

    /// The children lost or left out, in the order they went.
    pub fn lost(&self) -> &[usize] {
        &self.lost
    }

    /// Whether this is an elastic job's server.
    pub fn elastic(&self) -> bool {
        self.min.is_some()
    }

    /// Whether `child` is one of the children left out of an elastic job.
    pub fn left_out(&self, child: usize) -> bool {
        self.elastic() && self.children.contains(&child) && !self.active.contains(&child)
    }

    /// The refusal, for good, of a push from `child`, left out at round `round`.
    pub fn refusal(child: usize, round: u64) -> Refusal {
        Refusal::lasting(format!(
            "rank {child} was left out of the job at round {round} (lost or silent past the \
             deadline); a replacement takes its place"
        ))
    }

    /// `child` pushed in the sync round under way; `true` when it was the last awaited.
    pub fn pushed(&mut self, child: usize) -> bool {
        self.pending.remove(&child);
        self.pending.is_empty()
    }

    /// A sync round starts: it waits for every child taking part, returned.
    pub fn next_round(&mut self) -> Vec<usize> {
        self.stalled = false;
        self.pending = self.active.clone();
        self.active.iter().copied().collect()
    }

    /// `child` is lost to a fixed-size async server, which goes on without it.
    pub fn lose(&mut self, child: usize) -> bool {
        if !self.active.remove(&child) {
            return false;
        }
        self.pending.remove(&child);
        self.lost.push(child);
        true
    }

    /// The children silent past an elastic sync round's deadline, to leave out; `None` the
    /// first time none pushed (see `stalled`).
    pub fn silent(&mut self) -> Option<Vec<usize>> {
        if self.pending.len() == self.active.len() && !self.stalled {
            self.stalled = true;
            return None;
        }
        Some(self.pending.iter().copied().collect())
    }

    /// Leaves `peers` (children taking part) out while at least the minimum remain.
    pub fn leave_out(&mut self, peers: &[usize]) -> Left {
        let min = self.min.unwrap_or(1);
        let remaining = self.active.iter().filter(|p| !peers.contains(p)).count();
        if remaining < min {
            return Left::BelowMinimum;
        }
        for &peer in peers {
            if self.active.remove(&peer) {
                self.pending.remove(&peer);
                self.lost.push(peer);
            }
        }
        Left::Out(self.sync && self.pending.is_empty())
    }

    /// The children out once `peers` are too.
    pub fn out_with(&self, peers: &[usize]) -> BTreeSet<usize> {
        let mut out: BTreeSet<usize> = self.lost.iter().copied().collect();
        out.extend(peers);
        out
    }

    /// The error that stops the job: leaving `peers` out leaves fewer than the minimum.
    pub fn below_minimum(&self, peers: &[usize]) -> TrainError {
        let min = self.min.unwrap_or(1);
        let remaining = self.active.iter().filter(|p| !peers.contains(p)).count();
        down_to(
            peers.first().copied().unwrap_or(0),
            remaining,
            min,
            &self.out_with(peers),
        )
    }

    /// Takes `peer`'s replacement back; into the sync round under way when `into_round`
    /// (a local server that already pushed its round up waits for the next). `false`: not
    /// a child.
    pub fn take_back(&mut self, peer: usize, into_round: bool) -> bool {
        if !self.children.contains(&peer) {
            return false;
        }
        self.lost.retain(|&p| p != peer);
        self.active.insert(peer);
        if self.sync && into_round {
            self.pending.insert(peer);
        }
        true
    }

    /// What a local server tells its parent: the children left out now.
    pub fn report(&self) -> PsMessage {
        PsMessage::Members {
            left_out: self.out_with(&[]).into_iter().map(|r| r as u32).collect(),
        }
    }

    /// The log line of `peers` leaving (`why`) at round `round`.
    pub fn left_line(&self, peers: &[usize], why: &str, round: u64) -> String {
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
        format!(
            "{who} {why}: left out at round {round}; {} training goes on with {} of {} workers",
            self.mode(),
            self.active.len(),
            self.children.len()
        )
    }

    /// The log line of `peer`'s replacement taken back at round `round`, version `version`.
    pub fn back_line(&self, peer: usize, round: u64, version: u64) -> String {
        format!(
            "rank {peer} rejoined (a replaced worker) at round {round} version {version}; {} \
             training goes on with {} of {} workers",
            self.mode(),
            self.active.len(),
            self.children.len()
        )
    }

    fn mode(&self) -> &'static str {
        if self.sync { "sync" } else { "async" }
    }
}

/// The error that stops an elastic job down to `remaining` workers of its `min`, naming the
/// workers `left` out (blaming `peer`).
fn down_to(peer: usize, remaining: usize, min: usize, left: &BTreeSet<usize>) -> TrainError {
    TrainError::Peer {
        peer,
        message: format!(
            "the job is down to {remaining} worker(s), fewer than its minimum of {min}; left \
             out: rank(s) {}",
            list(left)
        ),
    }
}

/// The fewest workers each server of an elastic job keeps training with: a flat server or
/// shard server all of the job's (its minimum ranks less the servers); a local server 1 (its
/// root keeps the job's minimum); `None` in a fixed-size job and for a hierarchical job's
/// root, whose children are local servers.
pub(super) fn min_children(
    config: &TrainConfig,
    topology: &Topology,
    rank: usize,
) -> Option<usize> {
    if config.elasticity() != Some(Elasticity::ServerWorkers) {
        return None;
    }
    let min = config.topology.min_world_size?;
    match topology.role(rank)?.kind {
        RoleKind::LocalServer { .. } => Some(1),
        _ if config.topology.arch == Arch::Flat => {
            let servers = topology.world_size() - topology.num_workers();
            Some(min.saturating_sub(servers).max(1))
        }
        _ => None,
    }
}

/// The root's count of an elastic hierarchical job's workers: each local server reports
/// which of its workers are left out; below the minimum the job stops naming them.
#[derive(Debug)]
pub(super) struct JobWorkers {
    total: usize,
    min: usize,
    /// By local server, its workers left out.
    left_out: BTreeMap<usize, BTreeSet<usize>>,
}

impl JobWorkers {
    /// The count of an elastic hierarchical job's root; `None` for every other server.
    pub fn of(config: &TrainConfig, topology: &Topology, rank: usize) -> Option<Self> {
        let elastic = config.elasticity() == Some(Elasticity::ServerWorkers);
        if !elastic || config.topology.arch != Arch::Hierarchical || rank != topology.root() {
            return None;
        }
        let total = topology.num_workers();
        let servers = topology.world_size() - total;
        let min = config
            .topology
            .min_world_size?
            .saturating_sub(servers)
            .max(1);
        Some(Self {
            total,
            min,
            left_out: BTreeMap::new(),
        })
    }

    /// Local server `from` reports its workers `left_out`: an error stops the job when
    /// fewer than the minimum remain in all; otherwise the log line of the change.
    pub fn report(&mut self, from: usize, left_out: &[u32]) -> Result<String> {
        let set: BTreeSet<usize> = left_out.iter().map(|&r| r as usize).collect();
        self.left_out.insert(from, set);
        let all: BTreeSet<usize> = self.left_out.values().flatten().copied().collect();
        let remaining = self.total.saturating_sub(all.len());
        if remaining < self.min {
            return Err(down_to(
                all.first().copied().unwrap_or(from),
                remaining,
                self.min,
                &all,
            ));
        }
        Ok(format!(
            "local server rank {from} reports worker(s) [{}] left out; the job trains with {} \
             of {} workers (minimum {})",
            list(&self.left_out[&from]),
            remaining,
            self.total,
            self.min
        ))
    }
}
