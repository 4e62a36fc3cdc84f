//! One issuer of collectives per process and group (Horovod's controller).
//!
//! Any thread may [`Scheduler::submit`] a *named* collective; it runs once every member of
//! the group has submitted the same name, in an order that every member agrees on. That is
//! what lets a training loop and a background thread (the asynchronous all-reduce's cycle)
//! share one group: without it, two threads issuing collectives race and ranks disagree on
//! the order.
//!
//! # Protocol
//!
//! Rank 0 of the group coordinates. `submit` stores the operation locally and announces
//! `(name, kind, length)` to the coordinator (tag [`TAG_READY`]). When the coordinator has
//! the same name from every member it appends it to the order and sends the order (tag
//! [`TAG_ORDER`]) to every member, itself included. Each member's executor thread runs the
//! operations in exactly that order on the group, so every member issues the same
//! collectives in the same order.
//!
//! # Ordering invariant
//!
//! The execution order of a group's scheduled collectives is the coordinator's completion
//! order, identical on every member; a name is in flight at most once per rank; an
//! operation whose members disagree on kind or length fails on every member with a
//! [`CommError::Protocol`] naming a rank that differs; one that some members never submit
//! fails at the group's deadline with a [`CommError::Deadline`] naming them. Do not mix
//! scheduled and direct collectives on the same group.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

use crate::error::CommError;
use crate::group::{Pending, ProcessGroup, ReduceOp, tags};

/// Tag of announcements to the coordinator.
pub const TAG_READY: u32 = tags::RESERVED + 1;
/// Tag of execution orders from the coordinator.
pub const TAG_ORDER: u32 = tags::RESERVED + 2;

/// A collective to run through the scheduler.
#[derive(Debug)]
pub enum Collective {
    /// [`ProcessGroup::all_reduce_sum`] of the buffer.
    AllReduceSum(Vec<f32>),
    /// [`ProcessGroup::all_reduce_i64`].
    AllReduceI64(Vec<i64>, ReduceOp),
    /// [`ProcessGroup::all_reduce_u64`].
    AllReduceU64(Vec<u64>, ReduceOp),
    /// [`ProcessGroup::broadcast_f32`] from the root.
    BroadcastF32(Vec<f32>, usize),
    /// [`ProcessGroup::broadcast_bytes`] from the root.
    BroadcastBytes(Vec<u8>, usize),
    /// [`ProcessGroup::all_gather_bytes`].
    AllGatherBytes(Vec<u8>),
    /// [`ProcessGroup::barrier`].
    Barrier,
}

impl Collective {
    /// What every member must agree on: (kind, length).
    fn shape(&self) -> (u8, u64) {
        match self {
            Collective::AllReduceSum(v) => (0, v.len() as u64),
            Collective::AllReduceI64(v, op) => (1 + *op as u8, v.len() as u64),
            Collective::AllReduceU64(v, op) => (8 + *op as u8, v.len() as u64),
            Collective::BroadcastF32(v, root) => (16, ((*root as u64) << 40) | v.len() as u64),
            Collective::BroadcastBytes(_, root) => (17, *root as u64),
            Collective::AllGatherBytes(_) => (18, 0),
            Collective::Barrier => (19, 0),
        }
    }
}

/// The result of a scheduled collective.
#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    /// Reduced or broadcast `f32` values.
    F32(Vec<f32>),
    /// Reduced `i64` values.
    I64(Vec<i64>),
    /// Reduced `u64` words.
    U64(Vec<u64>),
    /// Broadcast bytes.
    Bytes(Vec<u8>),
    /// Gathered byte strings, by rank.
    Gathered(Vec<Vec<u8>>),
    /// Nothing (barrier).
    Done,
}

impl Output {
    /// The `f32` result, if this is one.
    pub fn into_f32(self) -> Option<Vec<f32>> {
        match self {
            Output::F32(v) => Some(v),
            _ => None,
        }
    }
}

#[derive(Debug, Serialize, Deserialize)]
enum Ready {
    Op { name: String, kind: u8, len: u64 },
    Stop,
}

#[derive(Debug, Serialize, Deserialize)]
enum Order {
    Run(String),
    Fail { name: String, error: Failure },
    Stop,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
enum Failure {
    Mismatch { rank: usize, detail: String },
    Missing { ranks: Vec<usize>, after_ms: u64 },
    Lost { rank: usize, reason: String },
}

/// Fuzzing hook: parses `bytes` as a scheduler `Ready` and as an `Order`; whatever parses
/// must serialise to JSON that parses to the same JSON again. Returns how many parsed.
#[cfg(feature = "fuzzing")]
pub(crate) fn fuzz_messages(bytes: &[u8]) -> usize {
    fn check<T: Serialize + for<'de> Deserialize<'de>>(bytes: &[u8]) -> usize {
        let Ok(msg) = serde_json::from_slice::<T>(bytes) else {
            return 0;
        };
        let Ok(json) = serde_json::to_vec(&msg) else {
            panic!("a parsed scheduler message does not serialise");
        };
        let again: T = serde_json::from_slice(&json).expect("own output parses");
        let json2 = serde_json::to_vec(&again).expect("serialises");
        assert_eq!(
            json, json2,
            "scheduler message does not survive a round trip"
        );
        1
    }
    check::<Ready>(bytes) + check::<Order>(bytes)
}

type Reply = oneshot::Sender<Result<Output, CommError>>;

/// A submitted operation waiting for its turn.
struct Entry {
    op: Collective,
    reply: Reply,
    since: Instant,
}

/// Submitted, not yet run, operations of this rank by name; `closed` once the executor
/// stopped (later submissions fail at once with that error).
#[derive(Default)]
struct TableState {
    ops: HashMap<String, Entry>,
    closed: Option<CommError>,
}

type Table = Arc<Mutex<TableState>>;

/// The single issuer of a group's collectives; see the module docs.
pub struct Scheduler {
    group: Arc<dyn ProcessGroup>,
    table: Table,
    threads: Vec<JoinHandle<()>>,
    seq: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for Scheduler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scheduler")
            .field("group", &self.group)
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Scheduler {
    /// Starts the scheduler of `group` on this rank (every member must start one). Rank 0
    /// of the group also runs the coordinator.
    pub fn new(group: Arc<dyn ProcessGroup>) -> Result<Scheduler, CommError> {
        let table: Table = Arc::default();
        let mut threads = Vec::new();
        let spawn = |name: &str, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name.to_string())
                .spawn(f)
                .map_err(|e| CommError::io("cannot start a scheduler thread", e))
        };
        if group.rank() == 0 {
            let g = group.clone();
            threads.push(spawn(
                "flotilla-coordinator",
                Box::new(move || coordinate(g)),
            )?);
        }
        let (g, t) = (group.clone(), table.clone());
        threads.push(spawn(
            "flotilla-scheduler",
            Box::new(move || execute(g, t)),
        )?);
        Ok(Scheduler {
            group,
            table,
            threads,
            seq: Default::default(),
        })
    }

    /// The group this scheduler issues collectives on.
    pub fn group(&self) -> &Arc<dyn ProcessGroup> {
        &self.group
    }

    /// Submits `op` under `name`; it runs when every member submitted `name`. A name may be
    /// reused once its previous operation finished on this rank.
    pub fn submit(&self, name: &str, op: Collective) -> Pending<Output> {
        let seq = self.seq.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (tx, pending) = Pending::channel(seq);
        let (kind, len) = op.shape();
        {
            let mut t = lock(&self.table);
            if let Some(e) = &t.closed {
                return Pending::ready(seq, Err(e.clone()));
            }
            if t.ops.contains_key(name) {
                return Pending::ready(
                    seq,
                    Err(CommError::InvalidArgument(format!(
                        "collective {name:?} submitted again before the previous one finished"
                    ))),
                );
            }
            let since = Instant::now();
            t.ops.insert(
                name.to_string(),
                Entry {
                    op,
                    reply: tx,
                    since,
                },
            );
        }
        let msg = Ready::Op {
            name: name.to_string(),
            kind,
            len,
        };
        if let Err(e) = send_json(&*self.group, 0, TAG_READY, &msg)
            && let Some(entry) = lock(&self.table).ops.remove(name)
        {
            let _ = entry.reply.send(Err(e));
        }
        pending
    }

    /// Submits and waits.
    pub fn run(&self, name: &str, op: Collective) -> Result<Output, CommError> {
        self.submit(name, op).wait()
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        let me = self.group.rank();
        let _ = send_json(&*self.group, me, TAG_ORDER, &Order::Stop);
        if me == 0 {
            let _ = send_json(&*self.group, 0, TAG_READY, &Ready::Stop);
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        fail_all(&self.table, &CommError::Shutdown);
    }
}

fn send_json<T: Serialize>(
    g: &dyn ProcessGroup,
    peer: usize,
    tag: u32,
    msg: &T,
) -> Result<(), CommError> {
    let bytes = serde_json::to_vec(msg).map_err(|e| {
        CommError::InvalidArgument(format!("cannot encode a scheduler message: {e}"))
    })?;
    g.send(peer, tag, &bytes)
}

/// A name announced by some members, waiting for the rest.
struct Waiting {
    shape: (u8, u64),
    from: BTreeSet<usize>,
    first_rank: usize,
    since: Instant,
    failed: Option<Failure>,
}

/// The coordinator loop (rank 0): collects announcements, emits the order.
fn coordinate(g: Arc<dyn ProcessGroup>) {
    let n = g.size();
    let mut live: Vec<usize> = (0..n).collect();
    let mut lost: BTreeMap<usize, String> = BTreeMap::new();
    let mut waiting: BTreeMap<String, Waiting> = BTreeMap::new();
    let timeout = g.timeout();
    loop {
        let deadline = waiting
            .values()
            .map(|w| w.since + timeout)
            .min()
            .unwrap_or_else(|| Instant::now() + Duration::from_secs(3600));
        let mut orders: Vec<Order> = Vec::new();
        match g.recv_any(&live, TAG_READY, deadline) {
            Ok((from, bytes)) => match serde_json::from_slice::<Ready>(&bytes) {
                Ok(Ready::Stop) if from == g.rank() => return,
                Ok(Ready::Op { name, kind, len }) => {
                    if let Some(o) = announce(&*g, &mut waiting, &lost, from, name, (kind, len)) {
                        orders.push(o);
                    }
                }
                _ => tracing::warn!(rank = g.world_rank(from), "malformed scheduler message"),
            },
            Err(CommError::Deadline { .. }) => {}
            Err(e) => {
                // A member is gone: nothing that needs it can run any more.
                let Some(r) = e.blamed_rank().and_then(|w| g.group_rank(w)) else {
                    return;
                };
                tracing::error!(error = %e, "scheduler lost a member");
                live.retain(|&x| x != r);
                lost.insert(r, e.to_string());
                for (name, _) in std::mem::take(&mut waiting) {
                    let error = Failure::Lost {
                        rank: g.world_rank(r),
                        reason: e.to_string(),
                    };
                    orders.push(Order::Fail { name, error });
                }
                if live.is_empty() {
                    return;
                }
            }
        }
        orders.extend(expire(&*g, &mut waiting, timeout));
        for order in &orders {
            for &r in &live {
                let _ = send_json(&*g, r, TAG_ORDER, order);
            }
        }
    }
}

/// Records that `from` submitted `name`; the order to send when that completes it.
fn announce(
    g: &dyn ProcessGroup,
    waiting: &mut BTreeMap<String, Waiting>,
    lost: &BTreeMap<usize, String>,
    from: usize,
    name: String,
    shape: (u8, u64),
) -> Option<Order> {
    if let Some((&r, reason)) = lost.iter().next() {
        let error = Failure::Lost {
            rank: g.world_rank(r),
            reason: reason.clone(),
        };
        return Some(Order::Fail { name, error });
    }
    let w = waiting.entry(name.clone()).or_insert_with(|| Waiting {
        shape,
        from: BTreeSet::new(),
        first_rank: from,
        since: Instant::now(),
        failed: None,
    });
    if w.shape != shape && w.failed.is_none() {
        w.failed = Some(Failure::Mismatch {
            rank: g.world_rank(from),
            detail: format!(
                "collective {name:?}: rank {} submitted kind {} length {}, rank {} kind {} length {}",
                g.world_rank(from),
                shape.0,
                shape.1,
                g.world_rank(w.first_rank),
                w.shape.0,
                w.shape.1
            ),
        });
    }
    w.from.insert(from);
    if w.from.len() < g.size() {
        return None;
    }
    let w = waiting.remove(&name)?;
    Some(match w.failed {
        Some(error) => Order::Fail { name, error },
        None => Order::Run(name),
    })
}

/// Fails every name past its deadline, naming the members that never submitted it.
fn expire(
    g: &dyn ProcessGroup,
    waiting: &mut BTreeMap<String, Waiting>,
    timeout: Duration,
) -> Vec<Order> {
    let now = Instant::now();
    let expired: Vec<String> = waiting
        .iter()
        .filter(|(_, w)| now >= w.since + timeout)
        .map(|(k, _)| k.clone())
        .collect();
    expired
        .into_iter()
        .filter_map(|name| {
            let w = waiting.remove(&name)?;
            let ranks = (0..g.size())
                .filter(|r| !w.from.contains(r))
                .map(|r| g.world_rank(r))
                .collect();
            let error = Failure::Missing {
                ranks,
                after_ms: timeout.as_millis() as u64,
            };
            Some(Order::Fail { name, error })
        })
        .collect()
}

/// The executor loop of every member: runs the coordinator's order.
fn execute(g: Arc<dyn ProcessGroup>, table: Table) {
    let me = g.rank();
    // Completes non-blocking all-reduces in order while the next ones are issued.
    let (done_tx, done_rx) = mpsc::channel::<(Pending<Vec<f32>>, Reply)>();
    let completer = std::thread::Builder::new()
        .name("flotilla-completer".into())
        .spawn(move || {
            for (p, reply) in done_rx {
                let _ = reply.send(p.wait().map(Output::F32));
            }
        });
    // The coordinator answers within its own deadline; twice that without an order for a
    // submitted operation means the coordinator itself is stuck.
    let patience = g.timeout() * 2;
    loop {
        let oldest = lock(&table).ops.values().map(|e| e.since).min();
        let deadline = oldest.map_or_else(
            || Instant::now() + Duration::from_secs(3600),
            |t| t + patience,
        );
        let (from, bytes) = match g.recv_any(&[0, me], TAG_ORDER, deadline) {
            Ok(x) => x,
            Err(CommError::Deadline { .. }) if oldest.is_none() => continue,
            Err(CommError::Deadline { after, .. }) => {
                let e = CommError::Timeout {
                    peer: g.world_rank(0),
                    op: "waiting for the collective scheduler's order".into(),
                    after,
                };
                fail_all(&table, &e);
                break;
            }
            Err(e) => {
                fail_all(&table, &e);
                break;
            }
        };
        let order = match serde_json::from_slice::<Order>(&bytes) {
            Ok(o) => o,
            Err(e) => {
                tracing::warn!(error = %e, "malformed scheduler order");
                continue;
            }
        };
        match order {
            Order::Stop if from == me => break,
            Order::Stop => {}
            Order::Fail { name, error } => {
                if let Some(entry) = lock(&table).ops.remove(&name) {
                    let _ = entry.reply.send(Err(failure_error(&name, error)));
                }
            }
            Order::Run(name) => {
                let Some(Entry { op, reply, .. }) = lock(&table).ops.remove(&name) else {
                    tracing::error!(%name, "ordered to run a collective this rank never submitted");
                    continue;
                };
                if let Collective::AllReduceSum(buf) = op {
                    let _ = done_tx.send((g.all_reduce_start(buf), reply));
                } else {
                    let _ = reply.send(run_blocking(&*g, op));
                }
            }
        }
    }
    drop(done_tx);
    if let Ok(c) = completer {
        let _ = c.join();
    }
}

fn failure_error(name: &str, f: Failure) -> CommError {
    match f {
        Failure::Mismatch { rank, detail } => CommError::Protocol { peer: rank, detail },
        Failure::Missing { ranks, after_ms } => CommError::Deadline {
            waiting_for: ranks,
            op: format!("scheduled collective {name:?}"),
            after: Duration::from_millis(after_ms),
        },
        Failure::Lost { rank, reason } => CommError::PeerLost {
            peer: rank,
            op: format!("scheduled collective {name:?}"),
            reason,
        },
    }
}

/// Fails everything submitted and every later submission with `e`.
fn fail_all(table: &Table, e: &CommError) {
    let mut t = lock(table);
    t.closed.get_or_insert_with(|| e.clone());
    for (_, entry) in t.ops.drain() {
        let _ = entry.reply.send(Err(e.clone()));
    }
}

fn run_blocking(g: &dyn ProcessGroup, op: Collective) -> Result<Output, CommError> {
    Ok(match op {
        Collective::AllReduceSum(mut v) => {
            g.all_reduce_sum(&mut v)?;
            Output::F32(v)
        }
        Collective::AllReduceI64(mut v, op) => {
            g.all_reduce_i64(&mut v, op)?;
            Output::I64(v)
        }
        Collective::AllReduceU64(mut v, op) => {
            g.all_reduce_u64(&mut v, op)?;
            Output::U64(v)
        }
        Collective::BroadcastF32(mut v, root) => {
            g.broadcast_f32(&mut v, root)?;
            Output::F32(v)
        }
        Collective::BroadcastBytes(mut v, root) => {
            g.broadcast_bytes(&mut v, root)?;
            Output::Bytes(v)
        }
        Collective::AllGatherBytes(v) => Output::Gathered(g.all_gather_bytes(&v)?),
        Collective::Barrier => {
            g.barrier()?;
            Output::Done
        }
    })
}
