//! A parameter-server worker: pull parameters, compute on a batch of its shard, push the
//! gradient (or, with `local_steps > 1`, the weight delta of that many local steps), repeat
//! until its server says stop. One round is one [`Strategy::step`].

use std::ops::Range;
use std::time::{Duration, Instant};

use flotilla_cluster::{Aggregation, RoleKind};
use flotilla_engine::{Engine, ModelState, ParamLayout};
use flotilla_tcp::CommError;

use super::job::{Announcement, Place};
use super::{PsContext, Refusals, deadlines, send};
use crate::batches::Batches;
use crate::checkpoint::CheckpointState;
use crate::error::{Result, TrainError};
use crate::fault::FaultAction;
use crate::plan::Counting;
use crate::strategy::accumulate::MicroBatches;
use crate::strategy::allreduce::dropout_seed;
use crate::strategy::{Cx, Evaluation, Resume, Setup, Step, Strategy};
use flotilla_ps::{PsMessage, TAG};

/// Worker state between rounds.
pub struct Worker {
    /// The whole model, trained on the pulled parameters.
    engine: Box<dyn Engine>,
    /// `parents[i]` holds the parameters of `ranges[i]` (one parent holding everything, or
    /// the shard servers of a sharded flat topology).
    parents: Vec<usize>,
    ranges: Vec<Range<usize>>,
    local_steps: usize,
    /// A push's (or local step's) micro-batches before its last
    /// (`allreduce.accumulation_steps`).
    accumulator: MicroBatches,
    layout: ParamLayout,
    params: Vec<f32>,
    versions: Vec<u64>,
    grad: Vec<f32>,
    local: Vec<f32>,
    rounds: u64,
    last_loss: f32,
    compute: Duration,
    push: Duration,
    wait: Duration,
    timeout: Duration,
    /// The first parameters were pulled (and their versions logged).
    pulled: bool,
    /// Each parent's refusals of this worker's pushes in a row.
    refusals: Vec<Refusals>,
    /// What it says when it starts.
    announcement: Announcement,
    /// How the run counts its rounds, and this worker's shard of the data.
    counting: Counting,
    /// See [`super::job::Place::resync_from`].
    resync_from: Option<usize>,
    /// Whether its parents are sync servers (each waits for every worker's push of a round).
    sync: bool,
}

/// What the parents said this round.
enum Pulled {
    /// Parameters from every parent.
    Params,
    /// The first parent said stop.
    Stop(String),
}

impl Worker {
    /// This rank's worker in the job of `setup`: under its parents (one server, or every shard
    /// server of a sharded flat topology, each holding its range of the parameters), training
    /// on its shard of the data.
    pub fn build(cx: &mut Cx<'_>, setup: &Setup<'_>) -> Result<Self> {
        let place = Place::of(cx, setup)?;
        let RoleKind::Worker { index } = place.role.kind else {
            return Err(TrainError::config(
                "topology",
                format!("rank {} is not a worker", cx.rank),
            ));
        };
        let policy = super::staleness::for_job(cx.config, setup.topology, cx.rank).own;
        let engine = setup.engine(cx.config, &policy.optimizer)?;
        let n = engine.num_params();
        let layout = engine.layout().clone();
        let ranges = setup.topology.shard_ranges(n);
        let ranges = if place.role.parents.len() == ranges.len() {
            ranges
        } else {
            std::iter::once(0..n).collect()
        };
        let parents = &place.role.parents;
        // Longer than its server waits on it (`deadlines.rs`): the worker hears the server
        // name a silent worker, or a local server name a silent root.
        let under_local = parents
            .first()
            .and_then(|&p| setup.topology.role(p))
            .is_some_and(|r| !r.parents.is_empty());
        let timeout = deadlines::worker_on(cx.config, under_local);
        let sync = parents
            .first()
            .and_then(|&p| setup.topology.role(p))
            .is_some_and(|r| r.aggregation.is_none_or(|a| a == Aggregation::Sync));
        Ok(Self {
            sync,
            engine,
            announcement: place.announcement.clone(),
            counting: place.counting((place.workers, index)),
            resync_from: place.resync_from,
            parents: parents.clone(),
            ranges,
            local_steps: cx.config.topology.local_steps.max(1),
            accumulator: MicroBatches::new(cx.config.allreduce.accumulation_steps as usize),
            layout,
            params: vec![0.0; n],
            versions: vec![0; parents.len()],
            grad: vec![0.0; n],
            local: vec![0.0; n],
            rounds: 0,
            last_loss: f32::NAN,
            compute: Duration::ZERO,
            push: Duration::ZERO,
            wait: Duration::ZERO,
            timeout,
            pulled: false,
            refusals: parents.iter().map(|_| Refusals::default()).collect(),
        })
    }

    /// The parents' newest parameters, or the first parent's stop. A parent other than the
    /// first that cannot be reached may just have stopped: the first parent (the root, for
    /// shards) then has a stop for this worker too.
    fn pull(&mut self, cx: &mut PsContext<'_>) -> Result<Pulled> {
        let mut unreachable: Option<TrainError> = None;
        for i in 0..self.parents.len() {
            if unreachable.is_some() && i > 0 {
                break;
            }
            let parent = self.parents[i];
            loop {
                let deadline = Instant::now() + self.timeout;
                let bytes = match cx.comm.recv(parent, TAG, deadline) {
                    Ok(b) => b,
                    Err(e) if i > 0 => {
                        unreachable = Some(e.into());
                        break;
                    }
                    Err(e) => return Err(e.into()),
                };
                match PsMessage::decode(&bytes, parent)? {
                    PsMessage::Params { version, values } => {
                        let range = self.ranges[i].clone();
                        if values.len() != range.len() {
                            return Err(TrainError::Protocol {
                                peer: parent,
                                message: format!(
                                    "sent {} parameters, this worker expects {} from it",
                                    values.len(),
                                    range.len()
                                ),
                            });
                        }
                        self.params[range].copy_from_slice(&values);
                        self.versions[i] = version;
                        self.refusals[i].params();
                        break;
                    }
                    PsMessage::Stop { reason } => return Ok(Pulled::Stop(reason)),
                    PsMessage::Abort { reason } => return Err(super::aborted_by(parent, &reason)),
                    PsMessage::Reject { reason, retry } => {
                        self.refusals[i].refused(parent, reason.clone(), retry)?;
                        cx.log(&format!(
                            "push rejected by rank {parent}: {reason}; pulling again"
                        ))?;
                        send(cx.comm, parent, &PsMessage::Pull)?;
                    }
                    other => {
                        return Err(TrainError::Protocol {
                            peer: parent,
                            message: format!(
                                "a worker expects params, stop or reject, got {}",
                                other.name()
                            ),
                        });
                    }
                }
            }
        }
        match unreachable {
            Some(e) => Err(e),
            None => Ok(Pulled::Params),
        }
    }

    /// Brings a worker's first pull from sync shard servers to one version of every shard: a
    /// replacement taken back by the shards in rounds one apart (one shard had closed its
    /// round when it was taken, the other not) closes each round behind with a push of no
    /// samples (which weighs nothing in the mean) and pulls that shard again. Left apart, its
    /// pushes would reach the shards in different rounds, and where the root waits for every
    /// shard's round (an epoch's end) the shard behind would wait for this worker while
    /// this worker waits for the root. The reason of a stop heard meanwhile.
    fn align(&mut self, cx: &mut PsContext<'_>) -> Result<Option<String>> {
        let newest = self.versions.iter().copied().max().unwrap_or(0);
        if !self.sync || self.versions.iter().all(|&v| v == newest) {
            return Ok(None);
        }
        for i in 0..self.parents.len() {
            while self.versions[i] < newest {
                let (parent, range) = (self.parents[i], self.ranges[i].clone());
                let nothing = PsMessage::Push {
                    version: self.versions[i],
                    staleness: 0,
                    samples: 0,
                    loss: 0.0,
                    delta: self.local_steps > 1,
                    values: vec![0.0; range.len()],
                };
                cx.log(&format!(
                    "round of version {} of rank {parent} closed with no samples: this \
                     worker trains on version {newest} of every shard",
                    self.versions[i]
                ))?;
                send(cx.comm, parent, &nothing)?;
                let deadline = Instant::now() + self.timeout;
                let bytes = cx.comm.recv(parent, TAG, deadline)?;
                match PsMessage::decode(&bytes, parent)? {
                    PsMessage::Params { version, values } if values.len() == range.len() => {
                        self.params[range].copy_from_slice(&values);
                        self.versions[i] = version;
                    }
                    PsMessage::Stop { reason } => return Ok(Some(reason)),
                    other => {
                        return Err(TrainError::Protocol {
                            peer: parent,
                            message: format!(
                                "a worker aligning expects params, got {}",
                                other.name()
                            ),
                        });
                    }
                }
            }
        }
        Ok(None)
    }

    /// Logs the versions of the first parameters pulled (`first pull: version V from rank
    /// P`): a replaced worker's show that it starts from the job's current parameters.
    fn log_first_pull(&mut self, cx: &mut PsContext<'_>) -> Result<()> {
        let from: Vec<String> = self
            .versions
            .iter()
            .zip(&self.parents)
            .map(|(v, p)| format!("version {v} from rank {p}"))
            .collect();
        cx.log_quiet(&format!("first pull: {}", from.join(", ")))
    }

    /// `local_steps` batches on the pulled parameters: the gradient, or the weight delta.
    /// Round `done`'s dropout masks are a function of the run's seed, this rank and the
    /// batch, so a resumed worker draws the ones it would have.
    fn compute(&mut self, cx: &mut PsContext<'_>, data: &mut Batches, done: u64) -> Result<()> {
        let engine = &mut *self.engine;
        engine.write_params(&self.params)?;
        let averaging = self.local_steps > 1;
        let mut loss_sum = 0.0f32;
        for i in 0..self.local_steps {
            let (_, batch) = {
                let _span = tracing::info_span!(target: "flotilla::train", "data").entered();
                data.next_batch()?
            };
            let step = done * self.local_steps as u64 + i as u64;
            engine.set_dropout_seed(dropout_seed(cx.config.model.seed, cx.rank, step));
            let batch = self.accumulator.run(engine, &self.layout, batch)?;
            let loss = engine.forward_backward(batch)?;
            loss_sum += self.accumulator.mean_loss(loss);
            engine.read_grads(&mut self.grad)?;
            self.accumulator.mean_into(&mut self.grad);
            if averaging {
                engine.apply_grads(&self.grad, cx.config.base_lr())?;
            }
        }
        if averaging {
            engine.read_params(&mut self.local)?;
            for ((d, l), g) in self.grad.iter_mut().zip(&self.local).zip(&self.params) {
                *d = l - g;
            }
        }
        self.last_loss = loss_sum / self.local_steps as f32;
        Ok(())
    }

    /// Sends each parent its slice of the gradient.
    fn push_up(&mut self, cx: &mut PsContext<'_>, samples: usize) -> Result<()> {
        let n = self.params.len();
        if cx.fault.and_then(|f| f.at(self.rounds + 1)) == Some(FaultAction::BadLength) {
            eprintln!("FLOTILLA_FAULT: pushing a gradient of the wrong length");
            self.grad.truncate(n / 2);
        }
        // A parent whose link is gone may have stopped (a shard server always, the main
        // server when its stop crossed this push): the stop, already received, comes with the
        // next pull, and a parent that was lost fails that pull naming it.
        for (i, &parent) in self.parents.iter().enumerate() {
            let len = self.grad.len();
            let msg = PsMessage::Push {
                version: self.versions[i],
                staleness: 0,
                samples: samples as u32,
                loss: self.last_loss,
                delta: self.local_steps > 1,
                values: self.grad[self.ranges[i].start.min(len)..self.ranges[i].end.min(len)]
                    .to_vec(),
            };
            match send(cx.comm, parent, &msg) {
                Err(TrainError::Comm(CommError::PeerLost { .. })) => {}
                Err(e) if i == 0 => return Err(e),
                _ => {}
            }
        }
        self.grad.resize(n, 0.0);
        Ok(())
    }
}

impl Strategy for Worker {
    fn name(&self) -> &'static str {
        "worker"
    }

    fn evaluation(&self) -> Evaluation {
        Evaluation::None
    }

    fn counting(&self) -> Counting {
        self.counting
    }

    fn model(&mut self) -> Option<&mut dyn ModelState> {
        Some(&mut *self.engine)
    }

    /// Continues a resumed run at the checkpoint's round (rounds counted from there).
    fn restore(&mut self, cx: &mut Cx<'_>, from: &Resume) -> Result<Option<CheckpointState>> {
        let n = self.engine.num_params();
        let model = Some(&mut *self.engine as &mut dyn ModelState);
        let state = super::job::restore(cx, from, (model, n), (self.resync_from, false))?;
        if let Some(s) = &state {
            self.rounds = s.step;
        }
        Ok(state)
    }

    fn start(&mut self, cx: &mut Cx<'_>) -> Result<()> {
        self.announcement.log(cx)?;
        for &p in &self.parents {
            send(cx.comm, p, &PsMessage::Pull)?;
        }
        Ok(())
    }

    fn step(&mut self, cx: &mut Cx<'_>, data: &mut Batches, done: u64) -> Result<Step> {
        // A sync server fails naming the rank this worker lost (an async one goes on).
        self.step_inner(cx, data, done)
            .map_err(|e| super::abort_peers(cx.comm, &[], &self.parents, e))
    }
}

impl Worker {
    /// One round: pull, compute, push.
    fn step_inner(&mut self, cx: &mut Cx<'_>, data: &mut Batches, done: u64) -> Result<Step> {
        let t = Instant::now();
        let pulled = {
            let _span = tracing::info_span!(target: "flotilla::ps", "ps_pull").entered();
            self.pull(cx)
        };
        self.wait += t.elapsed();
        if let Pulled::Stop(reason) = pulled? {
            cx.log(&format!(
                "stop from rank {} ({reason}) after {} rounds; compute {:.1}s push {:.1}s wait {:.1}s",
                self.parents[0],
                self.rounds,
                self.compute.as_secs_f64(),
                self.push.as_secs_f64(),
                self.wait.as_secs_f64()
            ))?;
            return Ok(Step {
                done: Some(reason),
                ..Step::default()
            });
        }
        if !self.pulled {
            self.pulled = true;
            self.log_first_pull(cx)?;
            if let Some(reason) = self.align(cx)? {
                return Ok(Step {
                    done: Some(reason),
                    ..Step::default()
                });
            }
        }
        let t = Instant::now();
        self.compute(cx, data, done)?;
        self.compute += t.elapsed();
        let t = Instant::now();
        let samples = data.batch_size() * self.local_steps;
        {
            let _span =
                tracing::info_span!(target: "flotilla::ps", "ps_push", round = self.rounds + 1)
                    .entered();
            self.push_up(cx, samples)?;
        }
        self.push += t.elapsed();
        self.rounds += 1;
        if self.rounds.is_multiple_of(100) {
            cx.log_quiet(&format!(
                "round {} v{} loss={:.4} compute {:.2}s push {:.2}s wait {:.2}s",
                self.rounds,
                self.versions[0],
                self.last_loss,
                self.compute.as_secs_f64(),
                self.push.as_secs_f64(),
                self.wait.as_secs_f64()
            ))?;
        }
        Ok(Step {
            progressed: true,
            loss: Some(self.last_loss),
            samples: samples as u64,
            done: None,
        })
    }
}
