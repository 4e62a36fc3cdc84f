//! [`serve`]: the server loop a user program runs on its server rank(s), with its own model
//! and optimizer; see the [module documentation](super).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Instant;

use burn::module::Module;
use burn::optim::{GradientsParams, ModuleOptimizer};
use flotilla_engine::{ParamLayout, any_module};
use flotilla_group::ProcessGroup;
use flotilla_ps::{
    Accumulator, Admission, Event, Inbox, PsMessage, TAG, admit, check_samples, encode_params,
};

use super::{Aggregation, PsConfig, Shard, shards};
use crate::data_parallel::DataParallel;
use crate::error::{DistError, Result};

/// What a server did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ServeStats {
    /// The parameter version reached (updates applied).
    pub version: u64,
    /// Pushes refused (wrong version, length, non-finite values, too stale).
    pub rejected: u64,
    /// The largest staleness of an applied push (async).
    pub max_staleness: u64,
    /// Workers lost during the run (async goes on without them).
    pub lost: Vec<usize>,
    /// The sample-weighted mean loss of the last update's pushes.
    pub last_loss: f32,
}

/// One server's state between messages (the model travels through the loop beside it).
struct Server<'o, F> {
    group: Arc<dyn ProcessGroup>,
    config: PsConfig,
    layout: ParamLayout,
    shard: Shard,
    optim: &'o mut ModuleOptimizer,
    lr: F,
    rounds: u64,
    acc: Accumulator,
    /// The whole flat model as this server knows it (its shard current).
    flat: Vec<f32>,
    live: BTreeSet<usize>,
    pushed: BTreeSet<usize>,
    stopped: BTreeSet<usize>,
    stats: ServeStats,
}

/// Serves `model` to the job's workers (run on ranks `0..config.servers`), stepping `optim`
/// at `lr(version)` for `rounds` updates (sync: rounds of every worker's push; async: pushes
/// applied), then stops the workers. Collective with every rank's [`serve`] or
/// [`super::Worker::new`] at start (the parameter lists are checked, rank 0's initial
/// parameters taken). Returns the trained model, whole on rank 0 (the other servers send it
/// their parts at the end), and what this server did.
pub fn serve<M: Module>(
    group: Arc<dyn ProcessGroup>,
    model: M,
    optim: &mut ModuleOptimizer,
    lr: impl FnMut(u64) -> f64,
    rounds: u64,
    config: PsConfig,
) -> Result<(M, ServeStats)> {
    config.check(group.size())?;
    let rank = group.rank();
    if rank >= config.servers {
        return Err(DistError::Config(format!(
            "rank {rank} is a worker (servers are ranks 0..{}): use flotilla_burn::ps::Worker there",
            config.servers
        )));
    }
    let dp = DataParallel::new(group.clone(), &model)?;
    let model = dp.broadcast_model(model)?;
    let layout = dp.layout().clone();
    let shard = shards(&layout, config.servers).swap_remove(rank);
    let mut flat = vec![0.0; layout.total];
    any_module::read_params(&model, &layout, &mut flat)?;
    let workers = config.workers(group.size());
    let mut server = Server {
        acc: Accumulator::new(shard.values.len(), config.aggregation == Aggregation::Sync),
        group,
        config,
        layout,
        shard,
        optim,
        lr,
        rounds,
        flat,
        live: workers.iter().copied().collect(),
        pushed: BTreeSet::new(),
        stopped: BTreeSet::new(),
        stats: ServeStats::default(),
    };
    let model = match server.run(model, &Inbox::listen(&server.group, &workers)) {
        Ok(model) => model,
        Err(e) => return Err(server.abort_workers(e)),
    };
    let model = server.gather(model)?;
    Ok((model, server.stats))
}

impl<F: FnMut(u64) -> f64> Server<'_, F> {
    /// Takes one event after another until every live worker was told to stop.
    fn run<M: Module>(&mut self, mut model: M, inbox: &Inbox) -> Result<M> {
        while self.live.iter().any(|w| !self.stopped.contains(w)) {
            let deadline = Instant::now() + self.config.timeout;
            match inbox.recv_until(deadline) {
                None => return Err(self.silent()),
                Some(Event::Message(w, PsMessage::Pull)) => self.answer(w)?,
                Some(Event::Message(w, push @ PsMessage::Push { .. })) => {
                    model = self.on_push(model, w, push)?;
                }
                Some(Event::Message(w, PsMessage::Abort { reason })) => {
                    self.on_lost(w, &format!("failed: {reason}"))?;
                }
                Some(Event::Message(w, other)) => {
                    self.reject(
                        w,
                        &format!("a server takes pull and push, not {}", other.name()),
                    )?;
                }
                Some(Event::Malformed(w, e)) => self.reject(w, &e.to_string())?,
                Some(Event::Lost(w, e)) => self.on_lost(w, &format!("lost: {e}"))?,
                Some(Event::Back(_)) => {}
            }
        }
        if !self.done() {
            return Err(DistError::Peer {
                rank: self.stats.lost.last().copied().unwrap_or(0),
                message: format!(
                    "every worker was lost ({:?}) at version {} of {}",
                    self.stats.lost, self.stats.version, self.rounds
                ),
            });
        }
        Ok(model)
    }

    fn done(&self) -> bool {
        self.stats.version >= self.rounds
    }

    /// Sends `w` this server's parameters, or stop once the rounds are done.
    fn answer(&mut self, w: usize) -> Result<()> {
        let bytes = if self.done() {
            self.stopped.insert(w);
            PsMessage::Stop {
                reason: format!("{} updates done", self.stats.version),
            }
            .encode()
        } else {
            encode_params(self.stats.version, &self.flat[self.shard.values.clone()])
        };
        self.group.send(w, TAG, &bytes)?;
        Ok(())
    }

    fn reject(&mut self, w: usize, reason: &str) -> Result<()> {
        self.stats.rejected += 1;
        tracing::warn!(target: "flotilla::burn", "refused a message of rank {w}: {reason}");
        let msg = PsMessage::Reject {
            reason: reason.to_string(),
        };
        self.group.send(w, TAG, &msg.encode())?;
        Ok(())
    }

    /// Admits a push, then applies it (async) or the round once every worker pushed (sync).
    fn on_push<M: Module>(&mut self, model: M, w: usize, push: PsMessage) -> Result<M> {
        let PsMessage::Push {
            version,
            samples,
            loss,
            delta,
            values,
            ..
        } = push
        else {
            return Ok(model);
        };
        let admission = match self.config.aggregation {
            Aggregation::Sync => Admission::Sync,
            Aggregation::Async { max_staleness, .. } => Admission::Async { max_staleness },
        };
        let len = self.shard.values.len();
        let verdict = admit(
            admission,
            self.stats.version,
            len,
            false,
            version,
            delta,
            &values,
        )
        .and_then(|s| check_samples(samples, self.config.batch_size.into()).map(|()| s));
        let staleness = match verdict {
            Ok(s) => s,
            Err(reason) => {
                self.reject(w, &reason)?;
                return Ok(model);
            }
        };
        if self.done() {
            return self.answer(w).map(|()| model);
        }
        if let Err(reason) = self.acc.add(w, samples, loss, version as f64, values) {
            self.reject(w, &reason)?;
            return Ok(model);
        }
        self.pushed.insert(w);
        if let Aggregation::Async { staleness_lr, .. } = self.config.aggregation {
            let scale = if staleness_lr {
                1.0 / (1.0 + staleness as f64)
            } else {
                1.0
            };
            self.stats.max_staleness = self.stats.max_staleness.max(staleness);
            let (model, refused) = self.apply(model, scale)?;
            match refused {
                Some(reason) => self.reject(w, &reason)?,
                None => self.answer(w)?,
            }
            return Ok(model);
        }
        if self.live.iter().any(|c| !self.pushed.contains(c)) {
            return Ok(model);
        }
        let (model, refused) = self.apply(model, 1.0)?;
        for c in self.live.clone() {
            // Refused: every worker of the round pushes again on the same version.
            match &refused {
                Some(reason) => self.reject(c, reason)?,
                None => self.answer(c)?,
            }
        }
        Ok(model)
    }

    /// One optimizer step of this server's tensors with the mean of the pushes gathered; or,
    /// when the new parameters would not all be finite, the model as it was (the optimizer's
    /// state has taken the step) and why.
    fn apply<M: Module>(&mut self, model: M, lr_scale: f64) -> Result<(M, Option<String>)> {
        self.pushed.clear();
        let Some(mean) = self.acc.take() else {
            return Ok((model, None));
        };
        let mut grads = GradientsParams::new();
        let (layout, params) = (&self.layout, self.shard.params.clone());
        any_module::put_grads(&model, &mut grads, layout, params, &mean.values)?;
        let lr = (self.lr)(self.stats.version) * lr_scale;
        let model = self.optim.step(lr, model, grads);
        let mut next = vec![0.0; self.flat.len()];
        any_module::read_params(&model, &self.layout, &mut next)?;
        if let Some(i) = next[self.shard.values.clone()]
            .iter()
            .position(|v| !v.is_finite())
        {
            let at = self.shard.values.start + i;
            let model = any_module::write_params(model, &self.layout, &self.flat)?;
            let why = format!(
                "the update would make parameter {at} non-finite ({})",
                next[at]
            );
            return Ok((model, Some(why)));
        }
        self.flat = next;
        self.stats.version += 1;
        self.stats.last_loss = mean.loss;
        Ok((model, None))
    }

    /// A worker failed or is gone: fatal for a sync round, dropped by an async server.
    fn on_lost(&mut self, w: usize, what: &str) -> Result<()> {
        if self.config.aggregation == Aggregation::Sync {
            return Err(DistError::Peer {
                rank: w,
                message: format!("worker rank {w} {what}"),
            });
        }
        tracing::warn!(target: "flotilla::burn", "worker rank {w} {what}; going on without it");
        self.live.remove(&w);
        self.stats.lost.push(w);
        Ok(())
    }

    /// The error when no worker spoke before the deadline, naming who was waited for.
    fn silent(&self) -> DistError {
        let waiting: Vec<usize> = self
            .live
            .iter()
            .copied()
            .filter(|w| !self.pushed.contains(w) && !self.stopped.contains(w))
            .collect();
        DistError::Peer {
            rank: waiting.first().copied().unwrap_or(0),
            message: format!(
                "no message from worker ranks {waiting:?} within {:?} (version {})",
                self.config.timeout, self.stats.version
            ),
        }
    }

    /// Tells every live worker this server failed with `e` (best effort) and returns `e`.
    fn abort_workers(&self, e: DistError) -> DistError {
        let bytes = PsMessage::Abort {
            reason: e.to_string(),
        }
        .encode();
        for &w in &self.live {
            let _ = self.group.send(w, TAG, &bytes);
        }
        e
    }

    /// Rank 0: `model` with every other server's part; the others send theirs to rank 0.
    fn gather<M: Module>(&mut self, model: M) -> Result<M> {
        let rank = self.group.rank();
        if rank != 0 {
            let part = encode_params(self.stats.version, &self.flat[self.shard.values.clone()]);
            self.group.send(0, TAG, &part)?;
            return Ok(model);
        }
        let all = shards(&self.layout, self.config.servers);
        for (s, shard) in all.iter().enumerate().skip(1) {
            let bytes = self
                .group
                .recv(s, TAG, Instant::now() + self.config.timeout)?;
            match PsMessage::decode(&bytes, s)? {
                PsMessage::Params { values, .. } if values.len() == shard.values.len() => {
                    self.flat[shard.values.clone()].copy_from_slice(&values);
                }
                other => {
                    return Err(DistError::Peer {
                        rank: s,
                        message: format!(
                            "server rank {s} sent a {} instead of its part",
                            other.name()
                        ),
                    });
                }
            }
        }
        Ok(any_module::write_params(model, &self.layout, &self.flat)?)
    }
}
