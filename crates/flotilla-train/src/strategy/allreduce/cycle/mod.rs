//! The asynchronous all-reduce's background cycle (Horovod's background thread, without a
//! coordinator), over any [`ProcessGroup`]: tensors are submitted by name from any thread, and every
//! `cycle_duration` the ranks agree which of them every rank holds, fuse those into buffers
//! and all-reduce them.
//!
//! # One cycle
//!
//! 1. Each rank builds its [`negotiate::Announce`]: the ready bit set (ids of the names it
//!    holds a tensor for), the names it holds that have no id yet (with lengths), and the
//!    stop / abort flags.
//! 2. One `all_gather_bytes` on the reducer's group: every rank sees every announcement.
//! 3. Every rank registers the new names (sorted, so ids agree whatever the submission
//!    order), ANDs the bit sets and reduces the tensors ready everywhere, in id order, packed
//!    into buffers of at most `buffer_bytes` ([`pack::pack`]), one ring all-reduce each. A
//!    submitter gets the **sum** over ranks.
//! 4. Ids set on some ranks and not others feed the stall inspector ([`flotilla_group::stall::StallWatch`]):
//!    past `stall.warning` every rank logs which tensors wait for which ranks (again at that
//!    interval); past `stall.shutdown` a rank sets `abort` in its next announcement and every
//!    rank fails everything pending with [`CommError::Stalled`] in that same cycle.
//! 5. It sleeps to the next cycle.
//!
//! A name may be submitted again before its previous tensor was reduced: each rank keeps a
//! queue per name, and the k-th tensor of a name on one rank is reduced with the k-th on
//! every other. [`CycleReducer::shutdown`] is collective: a rank asks to stop once its queues
//! are empty, and the cycle ends in the cycle where every rank asked, so no rank is left
//! waiting in a gather.
//!
//! The group given to [`CycleReducer::start`] must be the reducer's alone (e.g. a
//! [`ProcessGroup::group`] of every rank): the cycle issues collectives on it from its own
//! thread.

pub mod negotiate;
pub mod pack;
mod predict;

pub use predict::WeightHistory;

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use flotilla_group::stall::{StallPolicy, StallVerdict, StallWatch, Stalled};
use flotilla_group::{CommError, Pending, PendingSender, ProcessGroup};
use negotiate::{Agreement, Announce, Names};

/// How the cycle runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CycleConfig {
    /// Time from the start of one cycle to the start of the next.
    pub cycle: Duration,
    /// Fusion buffer size in bytes (0: one all-reduce per tensor).
    pub buffer_bytes: usize,
    /// When to warn about and when to abort on tensors some ranks never submit.
    pub stall: StallPolicy,
}

impl Default for CycleConfig {
    fn default() -> Self {
        Self {
            cycle: Duration::from_millis(5),
            buffer_bytes: 64 << 20,
            stall: StallPolicy::default(),
        }
    }
}

/// What the cycle did over its life.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CycleStats {
    /// Cycles run.
    pub cycles: u64,
    /// Cycles that reduced something.
    pub busy_cycles: u64,
    /// All-reduces issued (fusion buffers).
    pub all_reduces: u64,
    /// Tensors reduced.
    pub tensors: u64,
    /// Values reduced.
    pub values: u64,
    /// Seconds spent in all-reduces.
    pub reduce_s: f64,
}

type Reply = PendingSender<Vec<f32>>;

struct Entry {
    data: Vec<f32>,
    reply: Reply,
}

/// This rank's submitted, unreduced tensors, shared by submitters and the cycle thread.
#[derive(Default)]
struct Local {
    queues: BTreeMap<String, VecDeque<Entry>>,
    /// The owner asked for a collective shutdown.
    stop: bool,
    /// The owner is gone without a shutdown: leave at once.
    gone: bool,
    /// The cycle ended with this error; later submissions fail with it.
    closed: Option<CommError>,
}

fn lock(m: &Mutex<Local>) -> std::sync::MutexGuard<'_, Local> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Submits named tensors to the background cycle; see the module documentation.
pub struct CycleReducer {
    local: Arc<Mutex<Local>>,
    thread: Option<JoinHandle<Result<CycleStats, CommError>>>,
    seq: AtomicU64,
}

impl std::fmt::Debug for CycleReducer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CycleReducer").finish_non_exhaustive()
    }
}

impl CycleReducer {
    /// Starts this rank's cycle on `group` (every member must start one with the same
    /// config; the group must not be used for anything else).
    pub fn start(group: Arc<dyn ProcessGroup>, config: CycleConfig) -> Result<Self, CommError> {
        let local: Arc<Mutex<Local>> = Arc::default();
        let shared = local.clone();
        let thread = std::thread::Builder::new()
            .name("flotilla-cycle".into())
            .spawn(move || {
                let mut cycle = Cycle::new(group, config, shared);
                let result = cycle.run();
                if let Err(e) = &result {
                    cycle.fail_all(e);
                }
                result.map(|()| cycle.stats)
            })
            .map_err(|e| CommError::io("cannot start the all-reduce cycle thread", e))?;
        Ok(Self {
            local,
            thread: Some(thread),
            seq: AtomicU64::new(0),
        })
    }

    /// Submits `data` under `name`; the result is its sum over every rank, once every rank
    /// submitted `name` (its k-th submission of `name` meets every other rank's k-th).
    pub fn submit(&self, name: &str, data: Vec<f32>) -> Pending<Vec<f32>> {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let (reply, pending) = Pending::channel(seq);
        let mut l = lock(&self.local);
        let refused = match (&l.closed, l.stop) {
            (Some(e), _) => Some(e.clone()),
            (None, true) => Some(CommError::InvalidArgument(format!(
                "tensor {name:?} submitted after shutdown"
            ))),
            _ => None,
        };
        match refused {
            Some(e) => {
                reply.send(Err(e));
            }
            None => l
                .queues
                .entry(name.to_string())
                .or_default()
                .push_back(Entry { data, reply }),
        }
        pending
    }

    /// Collective shutdown: waits until this rank's tensors are reduced and every rank asked
    /// to stop, then ends the cycle. Returns the cycle's figures, or the error that ended it.
    pub fn shutdown(mut self) -> Result<CycleStats, CommError> {
        lock(&self.local).stop = true;
        match self.thread.take().map(JoinHandle::join) {
            Some(Ok(result)) => result,
            Some(Err(_)) => Err(CommError::InvalidArgument(
                "the all-reduce cycle thread panicked".into(),
            )),
            None => Err(CommError::Shutdown),
        }
    }
}

impl Drop for CycleReducer {
    fn drop(&mut self) {
        // Not shut down collectively (the owner failed): leave without waiting for anyone.
        lock(&self.local).gone = true;
    }
}

/// The cycle thread's state.
struct Cycle {
    group: Arc<dyn ProcessGroup>,
    config: CycleConfig,
    local: Arc<Mutex<Local>>,
    names: Names,
    watch: StallWatch,
    /// Set when this rank gave up on a stall; announced in the next cycle.
    give_up: Option<CommError>,
    stats: CycleStats,
}

impl Cycle {
    fn new(group: Arc<dyn ProcessGroup>, config: CycleConfig, local: Arc<Mutex<Local>>) -> Self {
        Self {
            group,
            watch: StallWatch::new(config.stall),
            config,
            local,
            names: Names::default(),
            give_up: None,
            stats: CycleStats::default(),
        }
    }

    fn run(&mut self) -> Result<(), CommError> {
        loop {
            let started = Instant::now();
            let Some(mine) = self.announce() else {
                return Err(CommError::Shutdown);
            };
            let all = self.gather(&mine)?;
            self.register(&all)?;
            let agreement = negotiate::agree(&all);
            if agreement.abort {
                return Err(self.stall_error(&agreement));
            }
            self.stats.cycles += 1;
            if !agreement.ready.is_empty() {
                self.reduce(&agreement.ready)?;
            }
            if agreement.all_stop {
                return Ok(());
            }
            self.inspect(&agreement, Instant::now());
            std::thread::sleep(self.config.cycle.saturating_sub(started.elapsed()));
        }
    }

    /// This rank's announcement; `None` when the owner is gone.
    fn announce(&mut self) -> Option<Announce> {
        let mut l = lock(&self.local);
        if l.gone {
            return None;
        }
        let mut ready = Vec::new();
        let mut new_names = Vec::new();
        for (name, queue) in l.queues.iter_mut() {
            let Some(front) = queue.front() else { continue };
            let len = front.data.len() as u64;
            match self.names.id(name) {
                None => new_names.push((name.clone(), len)),
                Some(id) => match self.names.entry(id) {
                    Some((_, want)) if *want != len => {
                        // Every rank must fail, not only this one: the others would wait for
                        // this rank's tensor forever. Announced as an abort in this cycle.
                        let e = CommError::InvalidArgument(format!(
                            "rank {} submitted tensor {name:?} with {len} values, registered \
                             with {want}",
                            self.group.world_rank(self.group.rank())
                        ));
                        if let Some(entry) = queue.pop_front() {
                            entry.reply.send(Err(e.clone()));
                        }
                        self.give_up.get_or_insert(e);
                    }
                    _ => ready.push(id),
                },
            }
        }
        let idle = l.queues.values().all(VecDeque::is_empty);
        Some(Announce {
            stop: l.stop && idle,
            abort: self.give_up.is_some(),
            ready: negotiate::bits(ready, self.names.len()),
            new_names,
        })
    }

    fn gather(&self, mine: &Announce) -> Result<Vec<Announce>, CommError> {
        let g = &self.group;
        g.all_gather_bytes(&mine.encode())?
            .iter()
            .enumerate()
            .map(|(r, bytes)| {
                Announce::decode(bytes).map_err(|e| CommError::Protocol {
                    peer: g.world_rank(r),
                    detail: e.to_string(),
                })
            })
            .collect()
    }

    fn register(&mut self, all: &[Announce]) -> Result<(), CommError> {
        self.names.register(all).map_err(|m| {
            let g = &self.group;
            let (rank, len) = m.lengths.get(1).copied().unwrap_or((0, 0));
            CommError::Protocol {
                peer: g.world_rank(rank),
                detail: format!(
                    "tensor {:?}: rank {} submitted {len} values, expected {}",
                    m.name,
                    g.world_rank(rank),
                    m.lengths[0].1
                ),
            }
        })
    }

    /// Reduces the tensors ready everywhere (ids ascending), fused, and answers submitters.
    fn reduce(&mut self, ids: &[u32]) -> Result<(), CommError> {
        let entries: Vec<Entry> = {
            let mut l = lock(&self.local);
            ids.iter()
                .filter_map(|&id| {
                    let name = &self.names.entry(id)?.0;
                    l.queues.get_mut(name)?.pop_front()
                })
                .collect()
        };
        if entries.len() != ids.len() {
            return Err(CommError::InvalidArgument(
                "a tensor announced ready vanished from its queue".into(),
            ));
        }
        let values: usize = entries.iter().map(|e| e.data.len()).sum();
        let _span = tracing::info_span!(
            target: "flotilla::comm",
            "all_reduce",
            tensors = entries.len() as u64,
            bytes = (values * 4) as u64
        )
        .entered();
        let started = Instant::now();
        let lens: Vec<usize> = entries.iter().map(|e| e.data.len()).collect();
        let groups = pack::pack(&lens, self.config.buffer_bytes);
        let pending: Vec<_> = groups
            .iter()
            .map(|r| {
                let buf: Vec<f32> = entries[r.clone()]
                    .iter()
                    .flat_map(|e| e.data.iter().copied())
                    .collect();
                self.group.all_reduce_start(buf)
            })
            .collect();
        let mut entries = entries.into_iter();
        for (p, r) in pending.into_iter().zip(&groups) {
            let summed = match p.wait() {
                Ok(s) => s,
                Err(e) => {
                    for rest in entries {
                        rest.reply.send(Err(e.clone()));
                    }
                    return Err(e);
                }
            };
            let mut at = 0;
            for e in entries.by_ref().take(r.len()) {
                let n = e.data.len();
                e.reply.send(Ok(summed[at..at + n].to_vec()));
                at += n;
            }
        }
        self.stats.busy_cycles += 1;
        self.stats.all_reduces += groups.len() as u64;
        self.stats.tensors += ids.len() as u64;
        self.stats.values += values as u64;
        self.stats.reduce_s += started.elapsed().as_secs_f64();
        Ok(())
    }

    /// The stall inspector: warn, or give up (announced in the next cycle).
    fn inspect(&mut self, agreement: &Agreement, now: Instant) {
        match self.watch.observe(&agreement.partial, now) {
            StallVerdict::Quiet => {}
            StallVerdict::Warn(stalled) => {
                let (what, _) = self.describe(&stalled);
                tracing::warn!(target: "flotilla::stall", "stall: {what}");
            }
            StallVerdict::Abort(stalled) => {
                let (what, waiting_for) = self.describe(&stalled);
                tracing::error!(target: "flotilla::stall", "stall: {what}; aborting");
                self.give_up = Some(CommError::Stalled {
                    waiting_for,
                    what,
                    after: stalled[0].waited,
                });
            }
        }
    }

    /// The error of a cycle in which some rank gave up: this rank's own, or one built from
    /// the same partial tensors.
    fn stall_error(&mut self, agreement: &Agreement) -> CommError {
        if let Some(e) = self.give_up.take() {
            return e;
        }
        let now = Instant::now();
        let stalled: Vec<Stalled> = agreement
            .partial
            .iter()
            .map(|(id, missing)| Stalled {
                id: *id,
                missing: missing.clone(),
                waited: Duration::ZERO,
            })
            .collect();
        let waited = match self.watch.observe(&agreement.partial, now) {
            StallVerdict::Warn(s) | StallVerdict::Abort(s) => s.first().map(|s| s.waited),
            StallVerdict::Quiet => None,
        };
        let (what, waiting_for) = self.describe(&stalled);
        CommError::Stalled {
            waiting_for,
            what: format!("{what} (another rank gave up first)"),
            after: waited.unwrap_or(self.config.stall.shutdown.unwrap_or_default()),
        }
    }

    /// One clause per set of missing ranks (oldest first; at most four names each), and the
    /// missing world ranks, those of the oldest stalled tensor first.
    fn describe(&self, stalled: &[Stalled]) -> (String, Vec<usize>) {
        let g = &self.group;
        let ranks = |rs: &[usize]| {
            rs.iter()
                .map(|&r| g.world_rank(r).to_string())
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut groups: Vec<(&Vec<usize>, Vec<&Stalled>)> = Vec::new();
        for s in stalled {
            match groups.iter_mut().find(|(m, _)| *m == &s.missing) {
                Some((_, v)) => v.push(s),
                None => groups.push((&s.missing, vec![s])),
            }
        }
        let mut missing: Vec<usize> = Vec::new();
        let clauses: Vec<String> = groups
            .iter()
            .map(|(absent, list)| {
                for &r in absent.iter() {
                    if !missing.contains(&g.world_rank(r)) {
                        missing.push(g.world_rank(r));
                    }
                }
                let have: Vec<usize> = (0..g.size()).filter(|r| !absent.contains(r)).collect();
                let mut names: Vec<String> = list
                    .iter()
                    .take(4)
                    .map(|s| format!("{:?}", self.names.entry(s.id).map_or("?", |(n, _)| n)))
                    .collect();
                if list.len() > 4 {
                    names.push(format!("and {} more", list.len() - 4));
                }
                format!(
                    "{} {} submitted by rank(s) {} wait{} for rank(s) {} ({:.1} s)",
                    if list.len() == 1 { "tensor" } else { "tensors" },
                    names.join(", "),
                    ranks(&have),
                    if list.len() == 1 { "s" } else { "" },
                    ranks(absent),
                    list[0].waited.as_secs_f64()
                )
            })
            .collect();
        (clauses.join("; "), missing)
    }

    /// Fails every pending and later submission with `e`.
    fn fail_all(&self, e: &CommError) {
        let mut l = lock(&self.local);
        l.closed.get_or_insert_with(|| e.clone());
        for (_, queue) in std::mem::take(&mut l.queues) {
            for entry in queue {
                entry.reply.send(Err(e.clone()));
            }
        }
    }
}
