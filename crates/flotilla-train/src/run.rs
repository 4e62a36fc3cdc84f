//! One rank's run, driven step by step by its caller ([`Run`]): what [`crate::run()`] runs
//! to its end for `flotilla train` and `flotilla_burn::train`, and what a user's own loop
//! drives — the same setup (rendezvous, data, the configured way of training, resume, plan),
//! the same steps, evaluations and checkpoints, the same summary.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use flotilla_cluster::Topology;
use flotilla_data::Samples;
use flotilla_engine::EvalStats;
use flotilla_tcp::{ProcessGroup, StallWatcher};

use crate::batches::{Batches, Position};
use crate::checkpoint::CheckpointState;
use crate::config::TrainConfig;
use crate::elastic::Elastic;
use crate::error::Result;
use crate::fault::Fault;
use crate::job_data::JobData;
use crate::observe::Observer;
use crate::plan::{Cadence, Counting, LoopPlan};
use crate::runlog::RunLog;
use crate::runloop::{Loop, LoopState};
use crate::strategy::{Cx, Evaluation, ModelSource, Resume, Setup, Strategy, registry};
use crate::trainer::{self, RunSummary};

/// Runs one rank of a training job of `model` (a spec's model: `&config.validate()?`; a
/// program's own module) to its end: a [`Run`] stepped until the run ends. `rank` is
/// this process's rank (`None`: assigned at rendezvous).
pub fn run(
    config: &TrainConfig,
    model: &dyn ModelSource,
    rank: Option<usize>,
    observer: &mut dyn Observer,
) -> Result<RunSummary> {
    let mut run = Run::start(config, model, None, rank, observer)?;
    while run.step(observer)?.is_some() {}
    run.finish(observer)
}

/// Where a run stands after one of its steps ([`Run::step`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Progress {
    /// Units of progress done in total (optimizer steps, or parameter-server rounds),
    /// including those before a resume.
    pub step: u64,
    /// Units of progress the run plans.
    pub total: u64,
    /// Whether this step completed a unit (a server's step that only answered a pull did
    /// not).
    pub progressed: bool,
    /// The step's training loss, when the role knows it (the global mean for all-reduce
    /// peers).
    pub loss: Option<f32>,
    /// The 0-based epoch of the next batch and the batches of it already taken (a role that
    /// draws none stays at 0).
    pub epoch: u32,
    /// See [`Progress::epoch`].
    pub step_in_epoch: u64,
}

/// What a [`Run`] keeps for the [`Cx`] of each of its calls.
struct Parts {
    config: TrainConfig,
    comm: Arc<dyn ProcessGroup>,
    data: JobData,
    log: RunLog,
    rank: usize,
    rounds: u64,
    fault: Option<Fault>,
    started: Instant,
}

impl Parts {
    fn cx<'a>(&'a mut self, observer: &'a mut dyn Observer) -> Cx<'a> {
        Cx {
            comm: &self.comm,
            config: &self.config,
            test: &*self.data.test,
            rank: self.rank,
            rounds: self.rounds,
            log: &mut self.log,
            observer,
            fault: self.fault,
        }
    }
}

/// One rank of a training job, set up and driven step by step: [`Run::start`] joins the
/// job and makes this rank's part of the configured way of training (restored from the
/// checkpoint the run resumes from, its initial state agreed); each [`Run::step`] is one
/// unit of it with everything the run does after a step (epoch lines, evaluation when due,
/// targets, periodic checkpoints, progress, metrics); [`Run::finish`] makes the final
/// evaluation, checkpoint and summary. Every rank of the job drives its own run (servers
/// and pipeline stages too), each until [`Run::step`] returns `None`.
///
/// `observer` is the front end of every call (progress bars, the run log's lines); pass the
/// same one throughout.
pub struct Run {
    parts: Parts,
    role: Box<dyn Strategy>,
    batches: Batches,
    plan: LoopPlan,
    state: LoopState,
    watcher: Option<StallWatcher>,
    /// An elastic job's membership ([`crate::elastic`]).
    elastic: Option<Elastic>,
    /// A stop this member proposes, until the members agree on it ([`Run::propose_stop`]).
    proposed_stop: Option<String>,
    /// The epoch end the run stands at, and the step it opened at ([`Run::at_epoch_end`]).
    epoch_end: Option<(u64, EpochEnd)>,
}

/// A borrow of a run's parts as the loop's, for one call.
macro_rules! with_loop {
    ($run:expr, $observer:expr, |$l:ident| $body:expr) => {{
        let s = &mut *$run;
        let mut cx = s.parts.cx($observer);
        let $l = &mut Loop {
            role: &mut *s.role,
            data: &mut s.batches,
            plan: &s.plan,
            cx: &mut cx,
            s: &mut s.state,
        };
        $body
    }};
}

impl Run {
    /// Joins the job of `config` as rank `rank` (`None`: assigned at the rendezvous) to train
    /// `model` (a spec's model, or a program's own module) on `data` (a program's own, made
    /// by [`JobData::given`]; `None`: what `data.path` names), and sets up this rank's part:
    /// data, strategy, resume, plan; the strategy's start (the initial broadcast, a worker's
    /// first pull) is done when it returns. Collective: every rank of the job calls it.
    pub fn start(
        config: &TrainConfig,
        model: &dyn ModelSource,
        data: Option<JobData>,
        rank: Option<usize>,
        observer: &mut dyn Observer,
    ) -> Result<Run> {
        let started = Instant::now();
        config.validate()?;
        let topology = config.topology()?;
        let mut fingerprint = model.fingerprint()?;
        if let Some(data) = &data {
            fingerprint = format!("{fingerprint}; {}", data.fingerprint());
        }
        let hash = config.shared_hash(Some(&fingerprint));
        // The device is per rank (not in the hash): `cuda` becomes this local rank's GPU.
        let config = crate::gpu::on_local_gpu(config)?;
        // Opened before joining, so that a missing driver fails this rank at once.
        let device = flotilla_engine::describe_device(&config.model.device)?;
        let (rejoin, links) = crate::rejoin::mode(&config, &topology, rank)?;
        let world = topology.world_size();
        let generations = config.elasticity() == Some(crate::config::Elasticity::Generations);
        let (comm, elastic) = if generations {
            let (comm, e) = Elastic::join(&config, hash)?;
            (comm, Some(e))
        } else {
            let comm = crate::backend::connect(&config, rank, hash, world, rejoin, links)?;
            (comm, None)
        };
        let (rank, world) = (comm.rank(), comm.size());
        // An elastic generation's members: a topology of its size.
        let mut config = config;
        let topology = match elastic {
            Some(_) => {
                config.topology.world_size = world;
                config.topology()?
            }
            None => topology,
        };
        observer.started(rank, world, trainer::role_label(&topology, rank));
        let mut log = match &elastic {
            Some(e) => RunLog::open_in(&config.telemetry.output, &format!("slot-{}", e.slot()))?,
            None => RunLog::open(&config.telemetry.output, rank)?,
        };
        let up = trainer::up_line(&device, model.name(), (rank, world), hash);
        observer.message(&up);
        log.line(&up)?;
        let data = match data {
            Some(data) => data,
            None => JobData::load(&config, model)?,
        };
        let rejoined = rejoin == flotilla_tcp::Rejoin::Join;
        if rejoined {
            let note = format!(
                "rank {rank} rejoined the running job (a replaced worker): it pulls the current parameters from its servers"
            );
            observer.message(&note);
            log.line(&note)?;
        }
        let parts = Parts {
            config,
            comm,
            data,
            log,
            rank,
            rounds: 0,
            fault: Fault::from_env(rank),
            started,
        };
        let job = Job {
            topology: &topology,
            model,
            hash,
            rejoined,
            elastic: elastic
                .as_ref()
                .map(|e| (e.global_batch, e.generation.clone())),
        };
        let mut run = job.set_up(parts, observer)?;
        if let Some(mut e) = elastic {
            e.started(true, rank);
            run.elastic = Some(e);
            run.generation_line(observer)?;
        }
        Ok(run)
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.parts.rank
    }

    /// Ranks in the job.
    pub fn world_size(&self) -> usize {
        self.parts.comm.size()
    }

    /// This rank's role: `peer`, `stage`, `worker`, `root`, `shard-server`, `local-server`.
    pub fn role(&self) -> &'static str {
        self.role.name()
    }

    /// The job's process group (a strategy's background reductions use groups of their own,
    /// so a caller's collectives on it between steps cannot interleave with them).
    pub fn group(&self) -> Arc<dyn ProcessGroup> {
        self.parts.comm.clone()
    }

    /// Makes the strategy's model the whole current model, as before an evaluation or a
    /// checkpoint (an async peer applies the steps it has in flight): collective, every rank
    /// after the same step.
    ///
    /// In an elastic job a member lost meanwhile is not an error: the run joins the next
    /// generation, whose start gives every member rank 0's state (buffers included), and
    /// returns; a member that got through goes on to its next step, whose exchange fails
    /// and brings it to the same generation.
    ///
    /// At an epoch end ([`Run::at_epoch_end`]) a second call does nothing: the model is whole
    /// already (and a process that joined there after the members made it so does not
    /// make it again).
    pub fn prepare_model(&mut self, observer: &mut dyn Observer) -> Result<()> {
        if self.epoch_end() == Some(EpochEnd::Prepared) {
            return Ok(());
        }
        let mut cx = self.parts.cx(observer);
        let prepared = self.role.prepare_model(&mut cx);
        // Made whole, or given rank 0's state by the next generation's start.
        self.advance_epoch_end(EpochEnd::Prepared);
        match prepared {
            Err(e) if self.elastic.is_some() && crate::elastic::survivable(&e) => {
                self.regroup(observer, &e.to_string())
            }
            other => other,
        }
    }

    /// Units of progress ([`Progress::step`]) that take one epoch of the training data: this
    /// rank's steps over its shard, or, on a parameter-server role, rounds over every
    /// worker's shard.
    pub fn per_epoch(&self) -> u64 {
        self.plan.per_epoch
    }

    /// The settings the run took (this rank's device resolved).
    pub fn config(&self) -> &TrainConfig {
        &self.parts.config
    }

    /// Why the run stopped, once it has (planned progress done, a target reached, its
    /// server's word, [`Run::stop`]).
    pub fn stopped(&self) -> Option<&str> {
        self.state.stopped()
    }

    /// One unit of this rank's part of the run, and what the run does after it; `None` once
    /// the run has ended (then [`Run::finish`]). An error ends the run: the rank to
    /// blame, if another, is named in it.
    ///
    /// In an elastic job a step lost with a member is not an error: the run joins the next
    /// generation and resumes at the most steps any member holds (the step returned did not
    /// progress), and after each step every member votes whether the membership changes.
    pub fn step(&mut self, observer: &mut dyn Observer) -> Result<Option<Progress>> {
        self.close_epoch_end();
        let turned = with_loop!(self, observer, |l| l.turn());
        let step = match turned {
            Err(e) if self.elastic.is_some() && crate::elastic::survivable(&e) => {
                self.regroup(observer, &e.to_string())?;
                return Ok(Some(self.progress(false, None)));
            }
            other => other?,
        };
        if let Some(s) = &step {
            self.mark_epoch_end(s.progressed);
            self.settle(observer)?;
        }
        Ok(step.map(|step| self.progress(step.progressed, step.loss)))
    }

    /// Carries out what the members voted after a step: stop, regroup or go on.
    fn settle(&mut self, observer: &mut dyn Observer) -> Result<()> {
        let vote = self.ballot();
        self.carry_out(observer, vote)
    }

    /// Carries out the members' `vote`.
    fn carry_out(&mut self, observer: &mut dyn Observer, vote: Vote) -> Result<()> {
        match vote {
            Vote::Stop(reason) => {
                self.proposed_stop = None;
                with_loop!(self, observer, |l| l.stop(reason))
            }
            Vote::Regroup(why) | Vote::Lost(why) => self.regroup(observer, &why),
            Vote::On => Ok(()),
        }
    }

    /// Votes now, between two steps, as the members do after each step: a stop proposed
    /// ([`Run::propose_stop`]) ends the run here, a change of members moves it to the next
    /// generation (a lost vote too: a proposal is then carried in the next). Collective in an
    /// elastic job (every member calls it after the same step, as where an epoch ends);
    /// elsewhere nothing. Whether the run has stopped.
    ///
    /// It closes the epoch end the run stands at ([`Run::at_epoch_end`]), unless the vote
    /// was lost with a member: then the next generation's members close it again.
    pub fn vote(&mut self, observer: &mut dyn Observer) -> Result<bool> {
        if self.elastic.is_none() || self.state.stopped().is_some() {
            self.close_epoch_end();
            return Ok(self.state.stopped().is_some());
        }
        let vote = self.ballot();
        if !matches!(vote, Vote::Lost(_)) {
            self.close_epoch_end();
        }
        self.carry_out(observer, vote)?;
        Ok(self.state.stopped().is_some())
    }

    /// Proposes that the run end for `reason` (the caller's own criterion, decided on one
    /// member: its early stopping, its interrupter). In an elastic job every member stops
    /// after the same step: the one whose vote (after each step, or [`Run::vote`]) first
    /// carries the proposal (a proposal in a lost generation's vote is carried again in the
    /// next). Elsewhere it is [`Run::stop`].
    pub fn propose_stop(&mut self, observer: &mut dyn Observer, reason: &str) -> Result<()> {
        if self.elastic.is_none() {
            return self.stop(observer, reason);
        }
        if self.state.stopped().is_none() {
            self.proposed_stop = Some(reason.to_string());
        }
        Ok(())
    }

    /// Where the run stands before its next step ([`Progress::progressed`] false): a process
    /// that joined an elastic job stands at its members' step and epoch.
    pub fn position(&self) -> Progress {
        self.progress(false, None)
    }

    /// Where the run stands after a step that `progressed` with `loss`.
    fn progress(&self, progressed: bool, loss: Option<f32>) -> Progress {
        // The next batch's: after an epoch's last step, the next epoch (a `Learner` ends
        // its epoch there, and a joiner of an elastic job counts its position so).
        let at = self.batches.next_position();
        Progress {
            step: self.state.progress(),
            total: self.plan.total,
            progressed,
            loss,
            epoch: at.epoch,
            step_in_epoch: at.step_in_epoch,
        }
    }

    /// Ends the run here for `reason` (the caller's own criterion), on a rank whose role
    /// stops itself: an all-reduce peer or a pipeline stage (each must stop after the same
    /// step, or the others wait for its next collective until their deadline), or a
    /// parameter server's root, which tells every server and worker below it. On the other
    /// roles (workers, shard and local servers) it does nothing: they run until the root's
    /// stop reaches them, as in a run of the plan's length.
    pub fn stop(&mut self, observer: &mut dyn Observer, reason: &str) -> Result<()> {
        if self.state.stopped().is_some() || !self.role.stops_itself() {
            return Ok(());
        }
        with_loop!(self, observer, |l| l.stop(reason.to_string()))
    }

    /// Evaluates the current model on the test set, as the run does when an evaluation is
    /// due: collective for all-reduce peers and pipeline stages (every rank calls it after
    /// the same step), local at a parameter server's root; `None` for a role that holds no
    /// model to evaluate (workers, shard and local servers).
    pub fn evaluate(&mut self, observer: &mut dyn Observer) -> Result<Option<EvalStats>> {
        if self.role.evaluation() == Evaluation::None {
            return Ok(None);
        }
        with_loop!(self, observer, |l| l.evaluate()).map(Some)
    }

    /// Writes a checkpoint of the whole training state now (parameters, optimizer, step, data
    /// position), as a periodic one is written: every rank calls it after the same step; the
    /// rank that writes returns the directory.
    pub fn checkpoint(&mut self, observer: &mut dyn Observer) -> Result<Option<PathBuf>> {
        with_loop!(self, observer, |l| l.checkpoint())
    }

    /// Writes the whole model's parameters to `path` now: safetensors under the model's own
    /// names (a user's module loads it with burn's safetensors store; the file a checkpoint
    /// holds as `model.safetensors`), written atomically. Every rank calls it after the same
    /// step; under ZeRO stage 3 the parameters are gathered one bucket at a time as the file
    /// is written, so no rank holds them all. The rank that writes returns the file.
    pub fn save_model(
        &mut self,
        observer: &mut dyn Observer,
        path: &Path,
    ) -> Result<Option<PathBuf>> {
        with_loop!(self, observer, |l| l.save_model(path))
    }

    /// The end of the run: the final evaluation, the cross-rank identity check, the final
    /// checkpoint and this rank's summary (with every rank's report on rank 0). Call it once
    /// [`Run::step`] has returned `None`, or after [`Run::stop`]: a rank that leaves
    /// earlier leaves the others waiting for it until their deadline, which names it.
    pub fn finish(mut self, observer: &mut dyn Observer) -> Result<RunSummary> {
        let done = loop {
            match with_loop!(&mut self, observer, |l| l.finish()) {
                // A member lost at the end: the others finish in the next generation.
                Err(e) if self.elastic.is_some() && crate::elastic::survivable(&e) => {
                    self.regroup(observer, &e.to_string())?;
                }
                other => break other?,
            }
        };
        if let Some(e) = self.elastic.as_mut() {
            e.finished();
        }
        if let Some(w) = self.watcher.take() {
            w.shutdown()?;
        }
        let started = self.parts.started;
        let mut cx = self.parts.cx(observer);
        let placed = trainer::placement_line(&mut *self.role, cx.rank)?;
        cx.log_quiet(&placed)?;
        let summary = trainer::summary(&*self.role, &mut cx, done, started);
        cx.log_quiet(&summary.final_line())?;
        Ok(summary)
    }

    /// The newest training loss (the last step's, or an epoch's mean at its end; NaN before
    /// the first).
    pub fn train_loss(&self) -> f64 {
        self.state.train_loss()
    }

    /// The last evaluation of the run, if this role evaluates and has.
    pub fn last_eval(&self) -> Option<EvalStats> {
        self.state.last_eval()
    }
}

/// Where a run's count and batches start.
#[derive(Clone, Copy)]
enum Start<'a> {
    /// Where the checkpoint it resumed from stood.
    Resumed(&'a CheckpointState),
    /// A fresh run after this many epochs of its data ([`JobData::start_epoch`]; 0: the
    /// beginning).
    AfterEpochs(u64),
    /// A process joining a running elastic job at this many steps (the members' state).
    AtStep(u64),
}

/// What a rank's setup reads besides its parts.
struct Job<'a> {
    topology: &'a Topology,
    model: &'a dyn ModelSource,
    hash: u64,
    /// This process replaced a lost worker of a running job: it takes part in no collective
    /// (it missed those issued before it came).
    rejoined: bool,
    /// An elastic job's global batch and the generation this process joined.
    elastic: Option<(usize, flotilla_tcp::Generation)>,
}

impl Job<'_> {
    /// This rank's strategy, built, restored and started, with its batches and plan.
    fn set_up(&self, mut parts: Parts, observer: &mut dyn Observer) -> Result<Run> {
        let (train, started) = (Arc::clone(&parts.data.train), parts.started);
        let start_epoch = parts.data.start_epoch;
        let mut cx = parts.cx(observer);
        // Joining a running elastic job: its members' state comes with the start.
        let joining = self.elastic.as_ref().filter(|(_, g)| g.number > 1);
        let setup = Setup {
            model: self.model,
            topology: self.topology,
            samples: train.len(),
            joining: joining.is_some(),
        };
        let mut role = registry::build(&mut cx, &setup)?;
        let resumed = match joining {
            Some(_) => None,
            None => {
                let from = Resume::find(&mut cx, self.hash, self.rejoined)?;
                role.restore(&mut cx, &from)?
            }
        };
        let start = match (&resumed, joining) {
            (Some(s), _) => Start::Resumed(s),
            (None, Some((_, g))) => Start::AtStep(g.step),
            (None, None) => Start::AfterEpochs(u64::from(start_epoch)),
        };
        let (batches, plan) = self.plan(role.counting(), &mut cx, (train, started), start)?;
        let config = cx.config;
        if let Some((what, how)) = role.describe(config) {
            cx.log(&format!(
                "training: {what}, {} steps/epoch of {}x{} samples, {} steps, {how}{}",
                batches.steps_per_epoch(),
                config.step_batch(),
                plan.workers,
                plan.total,
                if config.model.recompute {
                    ", each block's forward recomputed in backward"
                } else {
                    ""
                },
            ))?;
        }
        // The stall inspector of the world group's collectives (buckets, evaluation).
        let watcher = match role.stall_policy(config) {
            Some(policy) => {
                let everyone: Vec<usize> = (0..cx.comm.size()).collect();
                let channel = cx.comm.group(&everyone)?;
                Some(StallWatcher::start(cx.comm.clone(), channel, policy)?)
            }
            None => None,
        };
        let state = LoopState::new(&*role, &batches, &plan, &cx);
        role.start(&mut cx)?;
        let rounds = cx.rounds;
        parts.rounds = rounds;
        Ok(Run {
            parts,
            role,
            batches,
            plan,
            state,
            watcher,
            elastic: None,
            proposed_stop: None,
            epoch_end: None,
        })
    }

    /// The batches this rank draws, from where a resumed run stood, and the loop's plan for
    /// a strategy counting `counting` over `train` (`started`: when the process started).
    fn plan(
        &self,
        counting: Counting,
        cx: &mut Cx<'_>,
        (train, started): (Arc<dyn Samples>, Instant),
        start: Start<'_>,
    ) -> Result<(Batches, LoopPlan)> {
        let config = cx.config;
        // A step takes its micro-batches as one batch, which the strategy cuts: epochs,
        // positions and resume count in steps.
        let (seed, batch) = (config.model.seed, config.step_batch());
        let mut resumed_at = match start {
            Start::Resumed(s) => s.step,
            Start::AtStep(step) => step,
            Start::AfterEpochs(_) => 0,
        };
        let (data, total, cadence, per_epoch) = match counting {
            Counting::Epochs { shards, index } => {
                let at = match start {
                    Start::Resumed(s) => Position {
                        epoch: s.epoch,
                        step_in_epoch: s.step_in_epoch,
                    },
                    Start::AfterEpochs(epochs) => Position {
                        epoch: u32::try_from(epochs).unwrap_or(u32::MAX),
                        step_in_epoch: 0,
                    },
                    Start::AtStep(_) => Position::default(),
                };
                let data = match &self.elastic {
                    Some((global, _)) => {
                        let at = match start {
                            Start::AtStep(step) => elastic_position(&train, *global, step),
                            _ => at,
                        };
                        let micro = config.allreduce.accumulation_steps as usize;
                        Batches::sliced(train, (shards, index), seed, (*global, micro), at)?
                    }
                    None => Batches::new(train, (shards, index), seed, batch, at)?,
                };
                if let Start::AfterEpochs(epochs) = start {
                    resumed_at = epochs * data.steps_per_epoch();
                }
                let s = &config.schedule;
                let planned = data.steps_per_epoch() * s.epochs as u64;
                let total = match s.max_steps {
                    Some(m) if s.epochs == 0 => m,
                    Some(m) => m.min(planned),
                    None => planned,
                };
                let every = s.eval_every.unwrap_or(1);
                let per_epoch = data.steps_per_epoch();
                (data, total, Cadence::Epochs { every }, per_epoch)
            }
            Counting::Rounds {
                total,
                every,
                per_epoch,
                local_steps,
                shard,
            } => {
                // A worker resumes where its batches stood after that many rounds (exact for
                // sync servers, where every worker pushes once a round).
                if let Start::AfterEpochs(epochs) = start {
                    resumed_at = epochs * per_epoch;
                }
                let fresh = Batches::new(train.clone(), shard, seed, batch, Position::default())?;
                let start =
                    Position::after(resumed_at * local_steps as u64, fresh.steps_per_epoch());
                let data = Batches::new(train, shard, seed, batch, start)?;
                (data, total, Cadence::Rounds { every }, per_epoch)
            }
        };
        cx.rounds = total;
        let plan = LoopPlan {
            total,
            per_epoch,
            cadence,
            resumed_at,
            model: self.model.name().to_string(),
            config_hash: self.hash,
            started,
            workers: counting.shards(),
            // The root's momentum when its updates are stale, for the advice of every rank.
            async_momentum: crate::strategy::ps::staleness::for_job(config, self.topology, cx.rank)
                .root_async_momentum,
        };
        Ok((data, plan))
    }
}

/// Where an elastic job's batches stand after `step` steps (its global batches are the
/// same for every number of members).
fn elastic_position(train: &Arc<dyn Samples>, global: usize, step: u64) -> Position {
    let per_epoch = (train.len() / global.max(1)) as u64;
    Position::after(step, per_epoch)
}

#[path = "run_regroup.rs"]
mod regroup;

#[path = "run_epoch_end.rs"]
mod epoch_end;

use epoch_end::EpochEnd;
use regroup::Vote;
