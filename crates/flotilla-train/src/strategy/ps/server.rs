//! What the parameter servers share: the model a server holds (a shard of the flat
//! parameters and its version), the push check, refusals, and the root's gathering of the
//! other shards. The servers themselves are state machines: [`super::shard_server::ShardServer`] and
//! [`super::local::LocalServer`].

use std::collections::BTreeSet;
use std::ops::Range;
use std::time::{Duration, Instant};

use flotilla_engine::Engine;

use super::{PsContext, send};
use crate::error::{Result, TrainError};
use crate::strategy::allreduce::clip::{scale_to, square_sum};
use flotilla_ps::{
    Accumulator, Admission, Event, Inbox, Mean, PsMessage, Refusal, admit, check_samples,
    encode_params,
};

/// `1, 2, 3`.
pub(crate) fn list(ranks: &BTreeSet<usize>) -> String {
    ranks
        .iter()
        .map(|r| r.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Parameters and their version, as a server holds them.
pub(crate) struct Params {
    pub(crate) version: u64,
    pub(crate) values: Vec<f32>,
}

impl Params {
    /// The encoded `Params` message of this version.
    pub(crate) fn encoded(&self) -> Vec<u8> {
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
            ranges: std::iter::once(0..n).collect(),
            servers: vec![0],
        }
    }

    /// This server's range of the flat parameters.
    pub fn range(&self) -> Range<usize> {
        self.ranges[self.index].clone()
    }
}

/// A server's model state: its shard of the parameters, the full flat buffer the engine
/// holds, and a reusable full-length gradient.
pub(crate) struct Model {
    params: Params,
    full: Vec<f32>,
    grad: Vec<f32>,
    range: Range<usize>,
    /// Clips each applied mean gradient to this global norm (a server holding every
    /// parameter: the norm is its gradient's).
    clip: Option<f64>,
}

impl Model {
    /// `engine`'s current parameters, holding `range` of them.
    pub(crate) fn new(engine: &dyn Engine, range: Range<usize>) -> Result<Self> {
        let n = engine.num_params();
        let mut full = vec![0.0; n];
        engine.read_params(&mut full)?;
        Ok(Self {
            params: Params {
                version: 0,
                values: full[range.clone()].to_vec(),
            },
            full,
            grad: vec![0.0; n],
            range,
            clip: None,
        })
    }

    /// `self` clipping each applied mean gradient to global norm `max`
    /// (`allreduce.clip_grad_norm`), as sync all-reduce clips the averaged gradient. Only a
    /// server holding every parameter can: a shard's norm is not the step's.
    pub(crate) fn clipping(mut self, max: Option<f64>) -> Result<Self> {
        if max.is_some() && self.range.len() != self.full.len() {
            return Err(TrainError::config(
                "allreduce.clip_grad_norm",
                format!(
                    "a shard server holds {} of the {} parameters: the norm of a step spans \
                     every shard",
                    self.range.len(),
                    self.full.len()
                ),
            ));
        }
        self.clip = max;
        Ok(self)
    }

    /// The global norm this server clips to, if it does.
    pub(crate) fn clip(&self) -> Option<f64> {
        self.clip
    }

    /// Values in the shard.
    pub(crate) fn len(&self) -> usize {
        self.params.values.len()
    }

    /// The parameter version.
    pub(crate) fn version(&self) -> u64 {
        self.params.version
    }

    /// Sets the version (a resumed run's).
    pub(crate) fn set_version(&mut self, version: u64) {
        self.params.version = version;
    }

    /// The encoded `Params` message of the shard at its version.
    pub(crate) fn encoded(&self) -> Vec<u8> {
        self.params.encoded()
    }

    /// Applies a mean push to the shard: a gradient (clipped, when the server clips) through
    /// `engine`'s optimizer (zero outside the shard), a weight delta (model averaging) by
    /// addition. New parameters that are not all finite are refused: the shard keeps its
    /// parameters and version (the optimizer's state has taken the step) and the reason is
    /// returned.
    pub(crate) fn apply(
        &mut self,
        engine: &mut dyn Engine,
        mean: &Mean,
        lr: f64,
        averaging: bool,
    ) -> Result<Option<String>> {
        let range = self.range.clone();
        if averaging {
            for ((f, p), d) in self.full[range.clone()]
                .iter_mut()
                .zip(&self.params.values)
                .zip(&mean.values)
            {
                *f = p + d;
            }
        } else {
            let grad = &mut self.grad[range.clone()];
            grad.copy_from_slice(&mean.values);
            if let Some(max) = self.clip {
                scale_to(grad, square_sum(grad).sqrt(), max);
            }
            engine.apply_grads(&self.grad, lr)?;
            engine.read_params(&mut self.full)?;
        }
        if let Some(i) = self.full[range.clone()].iter().position(|v| !v.is_finite()) {
            let at = range.start + i;
            let bad = self.full[at];
            self.full[range].copy_from_slice(&self.params.values);
            engine.write_params(&self.full)?;
            return Ok(Some(format!(
                "the update would make parameter {at} non-finite ({bad})"
            )));
        }
        if averaging {
            engine.write_params(&self.full)?;
        }
        self.params.values.copy_from_slice(&self.full[range]);
        self.params.version += 1;
        Ok(None)
    }
}

/// The root collects every other shard (at `version` or later; 0 for whatever they have)
/// into its `engine`, so that it evaluates and checkpoints the whole model; with `state`,
/// every shard server's optimizer state too, each shard's part of it put into the engine's
/// (so that a checkpoint holds the optimizer state of every shard).
pub(crate) fn gather(
    ctx: &mut PsContext<'_>,
    engine: &mut dyn Engine,
    (shard, inbox): (&ShardPlan, Option<&Inbox>),
    model: &mut Model,
    (version, state): (u64, bool),
) -> Result<()> {
    let Some(inbox) = inbox else { return Ok(()) };
    let timeout = Duration::from_secs_f64(ctx.config.comm.timeout_s);
    for &rank in &shard.servers[1..] {
        send(ctx.comm, rank, &PsMessage::Gather { version, state })?;
    }
    let mut missing: BTreeSet<usize> = shard.servers[1..].iter().copied().collect();
    let mut states: Vec<Option<Vec<u8>>> = vec![None; shard.servers.len()];
    if state {
        states[0] = Some(engine.optimizer_state()?);
    }
    let waiting = |missing: &BTreeSet<usize>, states: &[Option<Vec<u8>>]| {
        !missing.is_empty() || (state && states.iter().any(Option::is_none))
    };
    let deadline = Instant::now() + timeout;
    while waiting(&missing, &states) {
        match inbox.recv_until(deadline) {
            None => {
                return Err(TrainError::Peer {
                    peer: missing.first().copied().unwrap_or(0),
                    message: format!(
                        "shard server(s) {} did not send their shard (and state) within \
                         {timeout:?}",
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
            Some(Event::Message(rank, PsMessage::State { bytes })) if state => {
                if let Some(i) = shard.servers.iter().position(|r| *r == rank) {
                    states[i] = Some(bytes);
                }
            }
            Some(Event::Message(rank, other)) => {
                return Err(TrainError::Protocol {
                    peer: rank,
                    message: format!("the root expects a shard, got {}", other.name()),
                });
            }
            // Shard servers never rejoin (only single-server jobs take workers back).
            Some(Event::Back(_)) => {}
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
    engine.write_params(&model.full)?;
    let states: Vec<Vec<u8>> = states.into_iter().flatten().collect();
    // An engine whose optimizer keeps its state elsewhere (a `Learner`'s) gives none.
    if state && states.iter().all(|s| !s.is_empty()) {
        let whole = compose_states(engine, &shard.ranges, &states)?;
        engine.load_optimizer_state(&whole)?;
    }
    Ok(())
}

/// The whole model's optimizer state of shard servers' `states` (each an engine's
/// whole-model state, of which the part over its server's range counts): each range's part
/// from its server. Exact for an optimizer that treats each value alone (SGD, momentum,
/// Adam, AdamW), whose per-tensor counters every server steps alike.
fn compose_states(
    engine: &dyn Engine,
    ranges: &[Range<usize>],
    states: &[Vec<u8>],
) -> Result<Vec<u8>> {
    use flotilla_engine::FlatOptimizerState;
    let layout = engine.layout();
    let mut parts = Vec::with_capacity(states.len());
    for (range, bytes) in ranges.iter().zip(states) {
        let whole = FlatOptimizerState::gather(layout, &[(None, bytes)])?;
        parts.push(whole.shard(layout, std::slice::from_ref(range))?);
    }
    let pieces: Vec<_> = ranges
        .iter()
        .zip(&parts)
        .map(|(r, b)| (Some(std::slice::from_ref(r)), b.as_slice()))
        .collect();
    Ok(FlatOptimizerState::gather(layout, &pieces)?.whole(layout)?)
}

/// What a server checks a push against.
pub(crate) struct PushCheck<'a> {
    pub(crate) admission: Admission,
    pub(crate) current: u64,
    pub(crate) len: usize,
    pub(crate) averaging: bool,
    /// In a sync round: the children yet to push (a child pushes once per round).
    pub(crate) sync_pending: Option<&'a BTreeSet<usize>>,
    /// The most samples the pushing child can claim ([`flotilla_ps::check_samples`]).
    pub(crate) max_samples: u64,
}

impl PushCheck<'_> {
    /// Admits `child`'s push into `acc` and returns its staleness (including the staleness
    /// carried from below), or refuses it, tells the child why and returns `None` (nothing
    /// changes). `msg` must be a push.
    pub(crate) fn take(
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
            Some(p) if !p.contains(&child) => {
                Err(Refusal::retry("a second push in the same sync round"))
            }
            _ => Ok(s + u64::from(below)),
        })
        .and_then(|s| check_samples(samples, self.max_samples).map(|()| s))
        .and_then(|s| {
            let base = version as f64 - f64::from(below);
            acc.add(child, samples, loss, base, values).map(|()| s)
        });
        match verdict {
            Ok(s) => Ok(Some(s)),
            Err(reason) => {
                reject(ctx, child, &reason)?;
                Ok(None)
            }
        }
    }
}

/// Handles a push that [`admit`] refused: logged, answered with `Reject`, nothing changed.
pub(crate) fn reject(ctx: &mut PsContext<'_>, child: usize, refusal: &Refusal) -> Result<()> {
    let then = if refusal.retry { "" } else { " (for good)" };
    ctx.log(&format!("rejected push from rank {child}{then}: {refusal}"))?;
    send(
        ctx.comm,
        child,
        &PsMessage::Reject {
            reason: refusal.reason.clone(),
            retry: refusal.retry,
        },
    )
}
