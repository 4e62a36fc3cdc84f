//! Parameter servers: the root (flat server or global server: owns the optimizer, evaluates,
//! decides when to stop) and local servers (aggregate their workers for a parent), each
//! `sync` (one averaged update per round, waiting for every child) or `async` (each push
//! applied or forwarded on arrival).

use std::collections::BTreeSet;
use std::ops::Range;
use std::time::{Duration, Instant};

use flotilla_engine::Engine;

use super::aggregate::{Accumulator, Admission, Mean, admit};
use super::inbox::{Event, Inbox};
use super::protocol::PsMessage;
use super::protocol::encode_params;
use super::{PsContext, send, send_bytes};
use crate::error::{Result, TrainError};

fn list(ranks: &BTreeSet<usize>) -> String {
    ranks
        .iter()
        .map(|r| r.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Parameters and their version, as a server holds them.
struct Params {
    version: u64,
    values: Vec<f32>,
}

impl Params {
    /// The encoded `Params` message of this version.
    fn encoded(&self) -> Vec<u8> {
        encode_params(self.version, &self.values)
    }
}

/// How a run of the root ended.
#[derive(Debug, Clone, PartialEq)]
pub struct RootOutcome {
    /// Rounds completed (sync: updates; async: updates / children).
    pub rounds: u64,
    /// Updates applied.
    pub updates: u64,
    /// Why it stopped.
    pub reason: String,
    /// Children lost on the way (async only).
    pub lost: Vec<usize>,
    /// Largest staleness of an applied update.
    pub max_staleness: u64,
    /// Mean staleness of applied updates.
    pub mean_staleness: f64,
    /// Seconds from the first update to the stop (the server loop, without start-up).
    pub busy_s: f64,
}

/// The part of the parameters a server owns: all of them, or one shard of a flat topology
/// whose parameters are split across `servers` by balanced ranges.
#[derive(Debug, Clone)]
pub struct ShardPlan {
    /// Which shard this server holds.
    pub index: usize,
    /// Every shard's range of the flat parameter buffer.
    pub ranges: Vec<Range<usize>>,
    /// The rank of every shard server, index-aligned with `ranges` (rank 0 is shard 0, the root).
    pub servers: Vec<usize>,
}

impl ShardPlan {
    /// One server holding all `n` parameters.
    pub fn whole(n: usize) -> Self {
        Self {
            index: 0,
            ranges: flotilla_cluster::balanced_ranges(n, 1),
            servers: vec![0],
        }
    }

    fn range(&self) -> Range<usize> {
        self.ranges[self.index].clone()
    }
}

/// A server's model state: its shard of the parameters, the full flat buffer the engine
/// holds, and a reusable full-length gradient.
struct Model {
    params: Params,
    full: Vec<f32>,
    grad: Vec<f32>,
    range: Range<usize>,
}

impl Model {
    fn new(ctx: &PsContext<'_>, range: Range<usize>) -> Result<Self> {
        let n = ctx.engine.num_params();
        let mut full = vec![0.0; n];
        ctx.engine.read_params(&mut full)?;
        Ok(Self {
            params: Params {
                version: 0,
                values: full[range.clone()].to_vec(),
            },
            full,
            grad: vec![0.0; n],
            range,
        })
    }

    /// Applies a mean push to the shard: a gradient through the engine's optimizer (zero
    /// outside the shard), a weight delta (model averaging) by addition.
    fn apply(
        &mut self,
        ctx: &mut PsContext<'_>,
        mean: &Mean,
        lr: f64,
        averaging: bool,
    ) -> Result<()> {
        if averaging {
            for (p, d) in self.params.values.iter_mut().zip(&mean.values) {
                *p += d;
            }
            self.full[self.range.clone()].copy_from_slice(&self.params.values);
            ctx.engine.write_params(&self.full)?;
        } else {
            self.grad[self.range.clone()].copy_from_slice(&mean.values);
            ctx.engine.apply_grads(&self.grad, lr)?;
            ctx.engine.read_params(&mut self.full)?;
            self.params
                .values
                .copy_from_slice(&self.full[self.range.clone()]);
        }
        self.params.version += 1;
        Ok(())
    }
}

/// The root collects every other shard (at `version` or later; 0 for whatever they have)
/// into its engine, so that it
/// evaluates and checkpoints the whole model.
fn gather(
    ctx: &mut PsContext<'_>,
    shard: &ShardPlan,
    inbox: Option<&Inbox>,
    model: &mut Model,
    version: u64,
) -> Result<()> {
    let Some(inbox) = inbox else { return Ok(()) };
    let timeout = Duration::from_secs_f64(ctx.config.comm.timeout_s);
    for &rank in &shard.servers[1..] {
        send(ctx.comm, rank, &PsMessage::Gather { version })?;
    }
    let mut missing: BTreeSet<usize> = shard.servers[1..].iter().copied().collect();
    let deadline = Instant::now() + timeout;
    while !missing.is_empty() {
        match inbox.recv_until(deadline) {
            None => {
                return Err(TrainError::Peer {
                    peer: missing.first().copied().unwrap_or(0),
                    message: format!(
                        "shard server(s) {} did not send their shard within {timeout:?}",
                        list(&missing)
                    ),
                });
            }
            Some(Event::Message(rank, PsMessage::Params { values, .. })) => {
                let Some(i) = shard.servers.iter().position(|r| *r == rank) else {
                    continue;
                };
                let range = shard.ranges[i].clone();
                if values.len() != range.len() {
                    return Err(TrainError::Protocol {
                        peer: rank,
                        message: format!(
                            "shard of {} values, expected {}",
                            values.len(),
                            range.len()
                        ),
                    });
                }
                model.full[range].copy_from_slice(&values);
                missing.remove(&rank);
            }
            Some(Event::Message(rank, other)) => {
                return Err(TrainError::Protocol {
                    peer: rank,
                    message: format!("the root expects a shard, got {}", other.name()),
                });
            }
            Some(Event::Malformed(rank, e)) => {
                return Err(TrainError::Peer {
                    peer: rank,
                    message: e.to_string(),
                });
            }
            Some(Event::Lost(rank, e)) => {
                return Err(TrainError::Peer {
                    peer: rank,
                    message: format!("shard server rank {rank} lost: {e}"),
                });
            }
        }
    }
    ctx.engine.write_params(&model.full)?;
    Ok(())
}

/// What a server checks a push against.
struct PushCheck<'a> {
    admission: Admission,
    current: u64,
    len: usize,
    averaging: bool,
    /// In a sync round: the children yet to push (a child pushes once per round).
    sync_pending: Option<&'a BTreeSet<usize>>,
}

impl PushCheck<'_> {
    /// Admits `child`'s push into `acc` and returns its staleness (including the staleness
    /// carried from below), or refuses it, tells the child why and returns `None` (nothing
    /// changes). `msg` must be a push.
    fn take(
        &self,
        ctx: &mut PsContext<'_>,
        acc: &mut Accumulator,
        child: usize,
        msg: PsMessage,
    ) -> Result<Option<u64>> {
        let PsMessage::Push {
            version,
            staleness: below,
            samples,
            loss,
            delta,
            values,
        } = msg
        else {
            return Err(TrainError::Protocol {
                peer: child,
                message: format!("expected a push, got {}", msg.name()),
            });
        };
        let verdict = admit(
            self.admission,
            self.current,
            self.len,
            self.averaging,
            version,
            delta,
            &values,
        )
        .and_then(|s| match self.sync_pending {
            Some(p) if !p.contains(&child) => Err("a second push in the same sync round".into()),
            _ => Ok(s + u64::from(below)),
        });
        match verdict {
            Ok(s) => {
                acc.add(
                    child,
                    samples,
                    loss,
                    version as f64 - f64::from(below),
                    values,
                );
                Ok(Some(s))
            }
            Err(reason) => {
                reject(ctx, child, &reason)?;
                Ok(None)
            }
        }
    }
}

/// Handles a push that [`admit`] refused: logged, answered with `Reject`, nothing changed.
fn reject(ctx: &mut PsContext<'_>, child: usize, reason: &str) -> Result<()> {
    ctx.log(&format!("rejected push from rank {child}: {reason}"))?;
    send(
        ctx.comm,
        child,
        &PsMessage::Reject {
            reason: reason.to_string(),
        },
    )
}

/// A server with workers or local servers as children that owns (a shard of) the model:
/// the root (flat server, shard 0 of a sharded flat topology, or the global server) or
/// another shard server of a sharded flat topology. The root evaluates, decides when to stop,
/// and gathers the other shards for evaluation and the checkpoint; the other shard servers
/// stop when the root says so.
pub fn run_server(
    ctx: &mut PsContext<'_>,
    children: &[usize],
    sync: bool,
    shard: &ShardPlan,
) -> Result<RootOutcome> {
    let is_root = shard.index == 0;
    let root = shard.servers[0];
    let mut model = Model::new(ctx, shard.range())?;
    let n = model.params.values.len();
    let mut peers = children.to_vec();
    if !is_root {
        peers.push(root);
    }
    let inbox = Inbox::listen(ctx.comm, &peers);
    let shard_inbox =
        (is_root && shard.servers.len() > 1).then(|| Inbox::listen(ctx.comm, &shard.servers[1..]));
    let timeout = Duration::from_secs_f64(ctx.config.comm.timeout_s);
    let averaging = ctx.config.topology.local_steps > 1;
    let total_rounds = ctx.rounds;
    let base_lr = ctx.config.base_lr();
    let admission = if sync {
        Admission::Sync
    } else {
        Admission::Async {
            max_staleness: ctx.config.topology.max_staleness,
        }
    };
    let mut active: BTreeSet<usize> = children.iter().copied().collect();
    let mut lost = Vec::new();
    let (mut rounds, mut updates) = (0u64, 0u64);
    let (mut max_st, mut sum_st) = (0u64, 0u64);
    let mut acc = Accumulator::new(n, sync);
    let mut pending = active.clone();
    let mut round_started = Instant::now();
    let mut wait = Duration::ZERO;
    let mut stop_reason: Option<String> = None;
    let mut gather_wait: Option<u64> = None;
    let mut first_update: Option<Instant> = None;
    ctx.log(&format!(
        "{} ({}) holding parameters {:?} of {}, children [{}], {} rounds",
        if is_root {
            "root server"
        } else {
            "shard server"
        },
        if sync { "sync" } else { "async" },
        shard.range(),
        ctx.engine.num_params(),
        list(&active),
        total_rounds
    ))?;

    while stop_reason.is_none() {
        let t = Instant::now();
        let event = inbox.recv_until(Instant::now() + timeout);
        wait += t.elapsed();
        let Some(event) = event else {
            let silent = if sync { &pending } else { &active };
            return Err(TrainError::Peer {
                peer: silent.first().copied().unwrap_or(0),
                message: format!(
                    "{} server at round {rounds}: no message from rank(s) {} within {:?}",
                    if sync { "sync" } else { "async" },
                    list(silent),
                    timeout
                ),
            });
        };
        let (child, msg) = match event {
            Event::Message(c, m) if c == root && !is_root => {
                match m {
                    PsMessage::Stop { reason } => stop_reason = Some(reason),
                    PsMessage::Gather { version } if model.params.version >= version => {
                        send_bytes(ctx.comm, root, &model.params.encoded())?;
                    }
                    PsMessage::Gather { version } => gather_wait = Some(version),
                    other => {
                        return Err(TrainError::Protocol {
                            peer: root,
                            message: format!(
                                "a shard server expects stop or gather from the root, got {}",
                                other.name()
                            ),
                        });
                    }
                }
                continue;
            }
            Event::Message(c, m) => (c, m),
            Event::Malformed(c, e) if c == root && !is_root => {
                return Err(TrainError::Peer {
                    peer: c,
                    message: e.to_string(),
                });
            }
            Event::Malformed(c, e) => {
                reject(ctx, c, &e.to_string())?;
                continue;
            }
            Event::Lost(c, e) if c == root && !is_root => {
                return Err(TrainError::Peer {
                    peer: c,
                    message: format!("root server rank {c} lost: {e}"),
                });
            }
            Event::Lost(c, e) => {
                if !active.contains(&c) {
                    continue;
                }
                if sync {
                    // A shard server may see a worker leave because the root has just told
                    // everyone to stop: that stop must then arrive soon.
                    if !is_root && let Some(reason) = await_stop(&inbox, root, timeout) {
                        stop_reason = Some(reason);
                        continue;
                    }
                    return Err(TrainError::Peer {
                        peer: c,
                        message: format!("rank {c} lost during sync round {rounds}: {e}"),
                    });
                }
                active.remove(&c);
                lost.push(c);
                ctx.log(&format!(
                    "rank {c} lost ({e}); async training continues with {} of {} children",
                    active.len(),
                    children.len()
                ))?;
                if active.is_empty() {
                    if !is_root && let Some(reason) = await_stop(&inbox, root, timeout) {
                        stop_reason = Some(reason);
                        continue;
                    }
                    return Err(TrainError::Peer {
                        peer: c,
                        message: "every child of this server is lost".into(),
                    });
                }
                continue;
            }
        };
        match msg {
            PsMessage::Pull => send_bytes(ctx.comm, child, &model.params.encoded())?,
            msg @ PsMessage::Push { .. } => {
                let check = PushCheck {
                    admission,
                    current: model.params.version,
                    len: n,
                    averaging,
                    sync_pending: sync.then_some(&pending),
                };
                let Some(staleness) = check.take(ctx, &mut acc, child, msg)? else {
                    continue;
                };
                if sync {
                    pending.remove(&child);
                    if !pending.is_empty() {
                        continue;
                    }
                }
                let Some(mean) = acc.take() else { continue };
                let lr_round = if sync {
                    updates
                } else {
                    updates / children.len() as u64
                };
                let mut lr = ctx.config.schedule.lr_schedule.lr_at(
                    base_lr,
                    lr_round,
                    total_rounds,
                    ctx.config.schedule.warmup_steps,
                );
                if ctx.config.topology.staleness_lr {
                    lr /= 1.0 + staleness as f64;
                }
                let t = Instant::now();
                first_update.get_or_insert(t);
                model.apply(ctx, &mean, lr, averaging)?;
                let apply_s = t.elapsed();
                updates += 1;
                max_st = max_st.max(staleness);
                sum_st += staleness;
                if gather_wait.is_some_and(|v| model.params.version >= v) {
                    gather_wait = None;
                    send_bytes(ctx.comm, root, &model.params.encoded())?;
                }
                let round_done = sync || updates.is_multiple_of(children.len() as u64);
                if round_done {
                    rounds += 1;
                    ctx.log_quiet(&format!(
                        "round {rounds} v{} loss={:.4} pushes={} wait={:.1}ms apply={:.1}ms round={:.1}ms",
                        model.params.version,
                        mean.loss,
                        mean.pushes,
                        wait.as_secs_f64() * 1e3,
                        apply_s.as_secs_f64() * 1e3,
                        round_started.elapsed().as_secs_f64() * 1e3
                    ))?;
                    if is_root {
                        ctx.observe_round(rounds, total_rounds, mean.loss);
                    }
                    wait = Duration::ZERO;
                    round_started = Instant::now();
                    if is_root && rounds >= total_rounds {
                        stop_reason = Some(format!("{rounds} rounds done"));
                    }
                    let eval_due = ctx.eval_every > 0 && rounds.is_multiple_of(ctx.eval_every);
                    if is_root && eval_due && stop_reason.is_none() {
                        let v = if sync { model.params.version } else { 0 };
                        gather(ctx, shard, shard_inbox.as_ref(), &mut model, v)?;
                        let acc_now = ctx.evaluate_and_log(rounds)?;
                        if let Some(target) = ctx.config.schedule.target_accuracy
                            && acc_now >= target
                        {
                            stop_reason = Some(format!(
                                "test accuracy {acc_now:.4} reached target {target}"
                            ));
                        }
                    }
                }
                if stop_reason.is_none() {
                    if sync {
                        let msg = model.params.encoded();
                        for &c in &active {
                            send_bytes(ctx.comm, c, &msg)?;
                        }
                        pending = active.clone();
                    } else {
                        send_bytes(ctx.comm, child, &model.params.encoded())?;
                    }
                }
            }
            other => {
                return Err(TrainError::Protocol {
                    peer: child,
                    message: format!("a server expects pull or push, got {}", other.name()),
                });
            }
        }
    }
    let reason = stop_reason.unwrap_or_default();
    let stop = PsMessage::Stop {
        reason: reason.clone(),
    };
    if is_root {
        // The other shards, for the checkpoint, while their servers still run; then everyone
        // is told to stop, the shard servers first.
        let v = if sync { model.params.version } else { 0 };
        gather(ctx, shard, shard_inbox.as_ref(), &mut model, v)?;
        for &rank in &shard.servers[1..] {
            let _ = send(ctx.comm, rank, &stop);
        }
    }
    for &c in &active {
        // A child that already left cannot be told; that is not an error at the end.
        let _ = send(ctx.comm, c, &stop);
    }
    ctx.log(&format!("stopping: {reason}"))?;
    Ok(RootOutcome {
        rounds,
        updates,
        reason,
        lost,
        max_staleness: max_st,
        mean_staleness: if updates > 0 {
            sum_st as f64 / updates as f64
        } else {
            0.0
        },
        busy_s: first_update.map_or(0.0, |t| t.elapsed().as_secs_f64()),
    })
}

/// Waits (up to `timeout`) for the root's stop, ignoring everything else; its reason if it
/// came.
fn await_stop(inbox: &Inbox, root: usize, timeout: Duration) -> Option<String> {
    let deadline = Instant::now() + timeout;
    while let Some(event) = inbox.recv_until(deadline) {
        if let Event::Message(r, PsMessage::Stop { reason }) = event
            && r == root
        {
            return Some(reason);
        }
    }
    None
}

/// A local server: a server to `children` and a child of `parent`. Sync: one averaged push
/// up per round of all children. Async: answers each child at once with the newest
/// parameters it has, and pushes up the mean of what it gathered whenever its previous push
/// has been answered.
pub fn run_local(
    ctx: &mut PsContext<'_>,
    parent: usize,
    children: &[usize],
    sync: bool,
) -> Result<u64> {
    let n = ctx.engine.num_params();
    let timeout = Duration::from_secs_f64(ctx.config.comm.timeout_s);
    let averaging = ctx.config.topology.local_steps > 1;
    let mut peers = children.to_vec();
    peers.push(parent);
    let inbox = Inbox::listen(ctx.comm, &peers);
    let admission = if sync {
        Admission::Sync
    } else {
        Admission::Async {
            max_staleness: ctx.config.topology.max_staleness,
        }
    };
    ctx.log(&format!(
        "local server ({}) under rank {parent} with children [{}]",
        if sync { "sync" } else { "async" },
        children
            .iter()
            .map(|c| c.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    ))?;
    send(ctx.comm, parent, &PsMessage::Pull)?;
    let mut params: Option<Params> = None;
    let mut active: BTreeSet<usize> = children.iter().copied().collect();
    let mut pending = active.clone();
    let mut early_pulls: Vec<usize> = Vec::new();
    let mut acc = Accumulator::new(n, sync);
    let mut outstanding = true; // the initial pull
    let mut pushes_up = 0u64;
    let mut round_started = Instant::now();

    let push_up = |ctx: &mut PsContext<'_>, version: u64, mean: Mean| -> Result<()> {
        // The staleness the mean already carries relative to the version it is pushed at.
        let staleness = (version as f64 - mean.base_version).round().max(0.0) as u32;
        send(
            ctx.comm,
            parent,
            &PsMessage::Push {
                version,
                staleness,
                samples: mean.samples.min(u32::MAX as u64) as u32,
                loss: mean.loss,
                delta: averaging,
                values: mean.values,
            },
        )
    };

    loop {
        let Some(event) = inbox.recv_until(Instant::now() + timeout) else {
            let silent: BTreeSet<usize> = if outstanding {
                [parent].into()
            } else if sync {
                pending.clone()
            } else {
                active.clone()
            };
            return Err(TrainError::Peer {
                peer: silent.first().copied().unwrap_or(parent),
                message: format!(
                    "local server: no message from rank(s) {} within {:?}",
                    list(&silent),
                    timeout
                ),
            });
        };
        let (peer, msg) = match event {
            Event::Message(p, m) => (p, m),
            Event::Malformed(p, e) if p != parent => {
                reject(ctx, p, &e.to_string())?;
                continue;
            }
            Event::Malformed(p, e) => {
                return Err(TrainError::Peer {
                    peer: p,
                    message: e.to_string(),
                });
            }
            Event::Lost(p, e) => {
                if p == parent || sync {
                    return Err(TrainError::Peer {
                        peer: p,
                        message: format!("rank {p} lost: {e}"),
                    });
                }
                if active.remove(&p) {
                    ctx.log(&format!(
                        "rank {p} lost ({e}); continuing with {} children",
                        active.len()
                    ))?;
                }
                if active.is_empty() {
                    return Err(TrainError::Peer {
                        peer: p,
                        message: "every child of this local server is lost".into(),
                    });
                }
                continue;
            }
        };
        if peer == parent {
            match msg {
                PsMessage::Params { version, values } => {
                    outstanding = false;
                    let first = params.is_none();
                    let p = Params { version, values };
                    if sync || first {
                        // Sync: the new round starts for everyone. Async: answer the
                        // children that pulled before there was anything to give.
                        let msg = p.encoded();
                        let targets: Vec<usize> = if sync && !first {
                            active.iter().copied().collect()
                        } else {
                            std::mem::take(&mut early_pulls)
                        };
                        for c in targets {
                            send_bytes(ctx.comm, c, &msg)?;
                        }
                        pending = active.clone();
                        ctx.log_quiet(&format!(
                            "v{version} from rank {parent}; round {:.1}ms",
                            round_started.elapsed().as_secs_f64() * 1e3
                        ))?;
                        round_started = Instant::now();
                    }
                    params = Some(p);
                    if !sync && let Some(mean) = acc.take() {
                        let v = params.as_ref().map_or(0, |p| p.version);
                        push_up(ctx, v, mean)?;
                        outstanding = true;
                        pushes_up += 1;
                    }
                }
                PsMessage::Stop { reason } => {
                    let stop = PsMessage::Stop {
                        reason: reason.clone(),
                    };
                    for &c in &active {
                        let _ = send(ctx.comm, c, &stop);
                    }
                    ctx.log(&format!(
                        "stop from rank {parent} ({reason}); pushed up {pushes_up} times"
                    ))?;
                    return Ok(pushes_up);
                }
                PsMessage::Reject { reason } => {
                    ctx.log(&format!(
                        "push rejected by rank {parent}: {reason}; pulling again"
                    ))?;
                    send(ctx.comm, parent, &PsMessage::Pull)?;
                    outstanding = true;
                }
                other => {
                    return Err(TrainError::Protocol {
                        peer: parent,
                        message: format!(
                            "a local server expects params, stop or reject from its parent, got {}",
                            other.name()
                        ),
                    });
                }
            }
            continue;
        }
        let child = peer;
        match msg {
            PsMessage::Pull => match &params {
                Some(p) => send_bytes(ctx.comm, child, &p.encoded())?,
                None => early_pulls.push(child),
            },
            msg @ PsMessage::Push { .. } => {
                let Some(current) = params.as_ref().map(|p| p.version) else {
                    reject(ctx, child, "no parameters yet: pull first")?;
                    continue;
                };
                let check = PushCheck {
                    admission,
                    current,
                    len: n,
                    averaging,
                    sync_pending: sync.then_some(&pending),
                };
                if check.take(ctx, &mut acc, child, msg)?.is_none() {
                    continue;
                }
                if sync {
                    pending.remove(&child);
                    if pending.is_empty()
                        && let Some(mean) = acc.take()
                    {
                        push_up(ctx, current, mean)?;
                        outstanding = true;
                        pushes_up += 1;
                    }
                } else {
                    if let Some(p) = &params {
                        send_bytes(ctx.comm, child, &p.encoded())?;
                    }
                    if !outstanding && let Some(mean) = acc.take() {
                        push_up(ctx, current, mean)?;
                        outstanding = true;
                        pushes_up += 1;
                    }
                }
            }
            other => {
                return Err(TrainError::Protocol {
                    peer: child,
                    message: format!("a server expects pull or push, got {}", other.name()),
                });
            }
        }
    }
}
