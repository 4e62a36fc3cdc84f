//! One rank of a training job, set up: rendezvous, data, this rank's [`Strategy`] (built by
//! [`registry::build`], restored by [`Strategy::restore`] from the checkpoint the run resumes
//! from) and the plan its counting gives; then the one run loop ([`crate::runloop`]) and the
//! summary.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use flotilla_cluster::Topology;
use flotilla_data::Samples;
use flotilla_tcp::{ProcessGroup, StallWatcher};

use crate::batches::{Batches, Position};
use crate::checkpoint::CheckpointState;
use crate::config::TrainConfig;
use crate::error::Result;
use crate::fault::Fault;
use crate::history::{History, RankReport};
use crate::observe::Observer;
use crate::plan::{Cadence, Counting, LoopPlan};
use crate::runlog::RunLog;
use crate::runloop;
use crate::strategy::{Cx, ModelSource, Resume, Setup, Strategy, registry};

/// What a rank does, in a word (its strategy's name, before the strategy is built).
pub use crate::strategy::registry::role_label;

/// How a run ended.
#[derive(Debug, Clone, PartialEq)]
pub struct RunSummary {
    /// This process's role (`peer` for all-reduce, `root`, `local-server`, `worker`).
    pub role: &'static str,
    /// This process's rank.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// Final test accuracy.
    pub test_acc: f64,
    /// Final test loss (a text's validation loss, in nats per token).
    pub test_loss: f64,
    /// The final test loss in bits per byte, when the tokens are bytes (a text).
    pub bpb: Option<f64>,
    /// Mean global training loss of the last epoch.
    pub train_loss: f64,
    /// Optimizer steps taken (in total, including those before a resume).
    pub steps: u64,
    /// The step (or round) this process started from: a resumed checkpoint's, else 0.
    pub resumed_at: u64,
    /// Steps (or rounds) this process itself took, counted as they finished: a run resumed
    /// at step `r` of `n` takes `n - r`.
    pub steps_run: u64,
    /// Seconds from start to end.
    pub wall_s: f64,
    /// Global training samples per second over the run.
    pub samples_per_s: f64,
    /// Global training samples of this run (as this rank counts them: peers and the root
    /// count every rank's).
    pub samples: u64,
    /// XXH3 of the final parameters (identical on every rank).
    pub param_hash: u64,
    /// The final checkpoint directory (rank 0 only).
    pub checkpoint: Option<PathBuf>,
    /// The figures above by name, and the role's own (see [`crate::strategy::Strategy::figures`]).
    pub figures: std::collections::BTreeMap<String, f64>,
    /// This rank's history of the run (losses, epoch ends, evaluations).
    pub history: History,
    /// Every rank's role, figures and traffic, by rank, gathered at the end of the run;
    /// `None` when a rank could not take part (e.g. a worker an async server lost).
    pub ranks: Option<Vec<RankReport>>,
}

impl RunSummary {
    /// The stable, parseable last line of a run. Roles that do not evaluate (local servers,
    /// workers) say what they did instead.
    pub fn final_line(&self) -> String {
        match self.role {
            "peer" | "root" | "stage" => {
                // A text's validation loss, in nats and bits per byte.
                let text = self.bpb.map_or(String::new(), |b| {
                    format!(" val_loss={:.4} bpb={b:.4}", self.test_loss)
                });
                format!(
                    "final test_acc={:.4} loss={:.4}{text} steps={} wall_s={:.1}",
                    self.test_acc, self.test_loss, self.steps, self.wall_s
                )
            }
            role => format!(
                "final role={role} rank={} rounds={} train_loss={:.4} wall_s={:.1}",
                self.rank, self.steps, self.train_loss, self.wall_s
            ),
        }
    }
}

/// The line a rank logs once it joined: rank, model, device (what it resolved to: the
/// adapter, or what `auto` chose and why), config hash and the launcher's local rank (rank
/// among this host's processes), when it gave one.
fn up_line(device: &str, model: &str, (rank, world): (usize, usize), hash: u64) -> String {
    let local = flotilla_cluster::LauncherEnv::from_process()
        .ok()
        .and_then(|e| e.local_rank)
        .map_or(String::new(), |l| {
            format!(" local_rank={} (${})", l.value, l.var)
        });
    format!("rank {rank}/{world} up: model={model} device={device} config_hash={hash:016x}{local}")
}

/// The line a rank logs at the end of its run saying where its parameter tensors are, as
/// the tensors themselves report it ([`flotilla_engine::ModelState::param_placement`], not the
/// configured device): `rank 1 (worker) parameter tensors on wgpu (Cpu on Vulkan) (all 10
/// parameter tensors)`. One mechanism for every role, through [`Strategy::model`]: a peer's,
/// a worker's and a server's engine, a pipeline stage's part of the model; a role that holds
/// no model of its own (a local server relays its parent's as flat host buffers) says so.
/// Tensors on two devices are an error.
fn placement_line(strategy: &mut dyn Strategy, rank: usize) -> Result<String> {
    let role = strategy.name();
    let what = match strategy.model() {
        Some(model) => match model.param_placement()? {
            Some(placement) => format!("on {placement}"),
            None => "none (no layer of its part has parameters)".to_string(),
        },
        None => "none (it holds no model of its own)".to_string(),
    };
    Ok(format!("rank {rank} ({role}) parameter tensors {what}"))
}

/// Runs one rank of a training job of `model` (a spec's model: `&config.validate()?`; a
/// program's own module). `rank` is this process's rank (`None`: assigned at rendezvous).
pub fn run(
    config: &TrainConfig,
    model: &dyn ModelSource,
    rank: Option<usize>,
    observer: &mut dyn Observer,
) -> Result<RunSummary> {
    let started = Instant::now();
    config.validate()?;
    let topology = config.topology()?;
    let hash = config.shared_hash(Some(&model.fingerprint()?));
    // The device is per rank (not in the hash): `cuda` becomes this local rank's GPU.
    let config = &crate::gpu::on_local_gpu(config)?;
    // Opened before joining, so that a missing driver fails this rank at once.
    let device = flotilla_engine::describe_device(&config.model.device)?;
    let (rejoin, links) = crate::rejoin::mode(&topology, rank)?;
    let comm = crate::backend::connect(config, rank, hash, topology.world_size(), rejoin, links)?;
    let (rank, world) = (comm.rank(), comm.size());
    observer.started(rank, world, role_label(&topology, rank));
    let mut log = RunLog::open(&config.telemetry.output, rank)?;
    let up = up_line(&device, model.name(), (rank, world), hash);
    observer.message(&up);
    log.line(&up)?;

    let data = crate::job_data::JobData::load(config, model)?;
    if rejoin == flotilla_tcp::Rejoin::Join {
        let note = format!(
            "rank {rank} rejoined the running job (a replaced worker): it pulls the current parameters from its servers"
        );
        observer.message(&note);
        log.line(&note)?;
    }
    let job = Job {
        config,
        topology: &topology,
        comm: &comm,
        model,
        hash,
        train: Arc::clone(&data.train),
        started,
        rejoined: rejoin == flotilla_tcp::Rejoin::Join,
        // The root's momentum when its updates are stale, for the advice of every rank.
        async_momentum: crate::strategy::ps::staleness::for_job(config, &topology, rank)
            .root_async_momentum,
    };
    let mut cx = Cx {
        comm: &comm,
        config,
        test: &*data.test,
        rank,
        rounds: 0,
        log: &mut log,
        observer,
        fault: Fault::from_env(rank),
    };
    job.train(&mut cx)
}

/// What every rank's setup reads.
struct Job<'a> {
    config: &'a TrainConfig,
    topology: &'a Topology,
    comm: &'a Arc<dyn ProcessGroup>,
    model: &'a dyn ModelSource,
    hash: u64,
    train: Arc<dyn Samples>,
    started: Instant,
    /// This process replaced a lost worker of a running job: it takes part in no collective
    /// (it missed those issued before it came).
    rejoined: bool,
    /// See [`LoopPlan::async_momentum`].
    async_momentum: Option<(f64, f64)>,
}

impl Job<'_> {
    /// This rank's strategy, built, restored and run to the end of the plan.
    fn train(&self, cx: &mut Cx<'_>) -> Result<RunSummary> {
        let setup = Setup {
            model: self.model,
            topology: self.topology,
            samples: self.train.len(),
        };
        let mut strategy = registry::build(cx, &setup)?;
        let from = Resume::find(cx, self.hash, self.rejoined)?;
        let resumed = strategy.restore(cx, &from)?;
        let (data, plan) = self.plan(strategy.counting(), cx, resumed.as_ref())?;
        if let Some((what, how)) = strategy.describe(self.config) {
            cx.log(&format!(
                "training: {what}, {} steps/epoch of {}x{} samples, {} steps, {how}",
                data.steps_per_epoch(),
                self.config.step_batch(),
                plan.workers,
                plan.total,
            ))?;
        }
        // The stall inspector of the world group's collectives (buckets, evaluation).
        let watcher = match strategy.stall_policy(self.config) {
            Some(policy) => {
                let everyone: Vec<usize> = (0..self.comm.size()).collect();
                let channel = self.comm.group(&everyone)?;
                Some(StallWatcher::start(self.comm.clone(), channel, policy)?)
            }
            None => None,
        };
        let done = runloop::run(&mut *strategy, data, &plan, cx)?;
        if let Some(w) = watcher {
            w.shutdown()?;
        }
        let placed = placement_line(&mut *strategy, cx.rank)?;
        cx.log_quiet(&placed)?;
        let summary = self.summary(&*strategy, cx, done);
        cx.log_quiet(&summary.final_line())?;
        Ok(summary)
    }

    /// The batches this rank draws, from where a resumed run stood, and the loop's plan for
    /// a strategy counting `counting`.
    fn plan(
        &self,
        counting: Counting,
        cx: &mut Cx<'_>,
        resumed: Option<&CheckpointState>,
    ) -> Result<(Batches, LoopPlan)> {
        let config = self.config;
        // A step takes its micro-batches as one batch, which the strategy cuts: epochs,
        // positions and resume count in steps.
        let (seed, batch) = (config.model.seed, config.step_batch());
        let resumed_at = resumed.map_or(0, |s| s.step);
        let (data, total, cadence) = match counting {
            Counting::Epochs { shards, index } => {
                let start = resumed.map_or(Position::default(), |s| Position {
                    epoch: s.epoch,
                    step_in_epoch: s.step_in_epoch,
                });
                let data =
                    Batches::new(Arc::clone(&self.train), (shards, index), seed, batch, start)?;
                let s = &config.schedule;
                let planned = data.steps_per_epoch() * s.epochs as u64;
                let total = match s.max_steps {
                    Some(m) if s.epochs == 0 => m,
                    Some(m) => m.min(planned),
                    None => planned,
                };
                let every = s.eval_every.unwrap_or(1);
                (data, total, Cadence::Epochs { every })
            }
            Counting::Rounds {
                total,
                every,
                local_steps,
                shard,
            } => {
                // A worker resumes where its batches stood after that many rounds (exact for
                // sync servers, where every worker pushes once a round).
                let fresh = Batches::new(
                    Arc::clone(&self.train),
                    shard,
                    seed,
                    batch,
                    Position::default(),
                )?;
                let start =
                    Position::after(resumed_at * local_steps as u64, fresh.steps_per_epoch());
                let data = Batches::new(Arc::clone(&self.train), shard, seed, batch, start)?;
                (data, total, Cadence::Rounds { every })
            }
        };
        cx.rounds = total;
        let plan = LoopPlan {
            total,
            cadence,
            resumed_at,
            model: self.model.name().to_string(),
            config_hash: self.hash,
            started: self.started,
            workers: counting.shards(),
            async_momentum: self.async_momentum,
        };
        Ok((data, plan))
    }

    fn summary(&self, role: &dyn Strategy, cx: &mut Cx<'_>, done: runloop::Finished) -> RunSummary {
        let (data_wait_s, data_bytes) = (done.data_wait_s, done.data_bytes);
        let mut s = self.bare_summary(role, cx, done);
        let own = role.figures(cx);
        s.figures = [
            ("test_acc", s.test_acc),
            ("test_loss", s.test_loss),
            ("val_loss", s.bpb.map_or(f64::NAN, |_| s.test_loss)),
            ("bpb", s.bpb.unwrap_or(f64::NAN)),
            ("train_loss", s.train_loss),
            ("steps", s.steps as f64),
            ("resumed_at", s.resumed_at as f64),
            ("steps_run", s.steps_run as f64),
            ("wall_s", s.wall_s),
            ("samples_per_s", s.samples_per_s),
            ("data_wait_s", data_wait_s.unwrap_or(f64::NAN)),
            ("data_bytes", data_bytes as f64),
        ]
        .into_iter()
        .chain(own)
        .filter(|(_, v)| v.is_finite())
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        s.ranks = self.gather_ranks(&s, cx);
        s
    }

    /// Every rank's [`RankReport`], sent to rank 0 once at the end (the traffic of the
    /// exchange itself is not counted; other ranks get `None`). A missing report is logged,
    /// not fatal: the run itself is done.
    fn gather_ranks(&self, s: &RunSummary, cx: &mut Cx<'_>) -> Option<Vec<RankReport>> {
        let traffic = self.comm.stats();
        let mine = RankReport {
            rank: s.rank,
            role: s.role.to_string(),
            bytes_sent: traffic.bytes_sent,
            bytes_received: traffic.bytes_received,
            shm_bytes: traffic.shm_bytes,
            bytes_sent_inter_host: traffic.bytes_sent_inter_host,
            figures: s.figures.clone(),
        };
        let timeout = std::time::Duration::from_secs_f64(self.config.comm.timeout_s);
        let gathered = crate::gather::to_root(&**self.comm, mine, timeout)?;
        for (rank, why) in &gathered.missing {
            // The log is the place for it; a failed write of it changes nothing here.
            let _ = cx.log(&format!(
                "warning: no end-of-run report from rank {rank} (its traffic is not in the summary): {why}"
            ));
        }
        Some(gathered.reports)
    }

    fn bare_summary(
        &self,
        role: &dyn Strategy,
        cx: &Cx<'_>,
        done: runloop::Finished,
    ) -> RunSummary {
        RunSummary {
            role: role.name(),
            rank: cx.rank,
            world_size: self.comm.size(),
            test_acc: done.eval.map_or(f64::NAN, |e| e.accuracy()),
            test_loss: done.eval.map_or(f64::NAN, |e| e.loss()),
            bpb: done
                .eval
                .and_then(|e| crate::eval::bits_per_byte(&e, cx.test)),
            train_loss: done.train_loss,
            steps: done.progress,
            resumed_at: done.resumed_at,
            steps_run: done.steps_run,
            wall_s: self.started.elapsed().as_secs_f64(),
            samples_per_s: done.samples_per_s,
            samples: done.samples,
            param_hash: done.param_hash.unwrap_or(0),
            checkpoint: done.checkpoint,
            figures: Default::default(),
            history: done.history,
            ranks: None,
        }
    }
}
