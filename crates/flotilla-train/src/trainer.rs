//! The training loop of one rank: rendezvous, data, engine, initial broadcast, epochs of
//! steps, distributed evaluation, checkpoints, and the final cross-rank consistency check.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use flotilla_cluster::{Arch, Topology};
use flotilla_comm::{Communicator, ProcessGroup};
use flotilla_data::{DistributedSampler, ImageDataset, Mnist, fill_batch};
use flotilla_engine::{BatchRef, BurnEngine, Engine, EvalStats};

use crate::checkpoint::{self, CheckpointState};
use crate::config::TrainConfig;
use crate::error::{Result, TrainError};
use crate::fault::Fault;
use crate::observe::{Observer, StepEvent};
use crate::ps;
use crate::runlog::{EpochMetrics, RunLog, append_metrics};
use crate::strategy::{Strategy, SyncAllReduce};

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
    /// Final test loss.
    pub test_loss: f64,
    /// Mean global training loss of the last epoch.
    pub train_loss: f64,
    /// Optimizer steps taken (in total, including those before a resume).
    pub steps: u64,
    /// Seconds from start to end.
    pub wall_s: f64,
    /// Global training samples per second over the run.
    pub samples_per_s: f64,
    /// XXH3 of the final parameters (identical on every rank).
    pub param_hash: u64,
    /// The final checkpoint directory (rank 0 only).
    pub checkpoint: Option<PathBuf>,
}

impl RunSummary {
    /// The stable, parseable last line of a run. Roles that do not evaluate (local servers,
    /// workers) say what they did instead.
    pub fn final_line(&self) -> String {
        match self.role {
            "peer" | "root" => format!(
                "final test_acc={:.4} loss={:.4} steps={} wall_s={:.1}",
                self.test_acc, self.test_loss, self.steps, self.wall_s
            ),
            role => format!(
                "final role={role} rank={} rounds={} train_loss={:.4} wall_s={:.1}",
                self.rank, self.steps, self.train_loss, self.wall_s
            ),
        }
    }
}

/// Runs one rank of a training job. `rank` is this process's rank (`None`: assigned at
/// rendezvous).
pub fn run(
    config: &TrainConfig,
    rank: Option<usize>,
    observer: &mut dyn Observer,
) -> Result<RunSummary> {
    let started = Instant::now();
    let spec = config.validate()?;
    let topology = config.topology()?;
    let hash = config.cluster_hash(&spec);
    let comm: Arc<dyn ProcessGroup> = Arc::new(Communicator::connect(config.comm_config(
        rank,
        hash,
        topology.world_size(),
    ))?);
    let (rank, world) = (comm.rank(), comm.size());
    let mut log = RunLog::open(&config.telemetry.output, rank)?;
    let say = |log: &mut RunLog, observer: &mut dyn Observer, text: String| -> Result<()> {
        observer.message(&text);
        log.line(&text)
    };
    say(
        &mut log,
        observer,
        format!(
            "rank {rank}/{world} up: model={} device={} config_hash={hash:016x}",
            spec.name, config.model.device
        ),
    )?;

    let splits = Mnist::load(&config.data.path)?;
    let (mut train, test) = (splits.train, splits.test);
    if let Some(limit) = config.data.train_limit {
        train.truncate(limit.min(train.len()));
    }
    spec.check_io(
        &[1, train.rows(), train.cols()],
        train.num_classes().max(10),
    )?;

    let mut engine = BurnEngine::new(
        &spec,
        &config.optimizer,
        &config.model.device,
        config.model.seed,
    )?;
    if topology.arch() != Arch::Allreduce {
        return run_parameter_servers(
            config,
            &topology,
            &comm,
            &mut log,
            observer,
            &mut engine,
            &spec,
            &train,
            &test,
            started,
        );
    }
    let mut strategy = SyncAllReduce::new(comm.clone(), engine.layout(), config.bucket_bytes());

    // Resume: rank 0 reads the newest checkpoint; its position is shared with every rank,
    // and its weights and optimizer state travel with the initial broadcast.
    let mut resume_state = if rank == 0 && config.schedule.resume {
        match checkpoint::latest(&config.telemetry.output)? {
            Some(dir) => {
                let state = checkpoint::load(&dir, &mut engine)?;
                if state.config_hash != hash {
                    say(
                        &mut log,
                        observer,
                        format!(
                            "warning: {} was written by a run with another config",
                            dir.display()
                        ),
                    )?;
                }
                say(
                    &mut log,
                    observer,
                    format!("resuming from {} (step {})", dir.display(), state.step),
                )?;
                serde_json::to_vec(&state).map_err(|e| TrainError::Checkpoint {
                    path: dir.clone(),
                    message: e.to_string(),
                })?
            }
            None => Vec::new(),
        }
    } else {
        Vec::new()
    };
    comm.broadcast_bytes(&mut resume_state, 0)?;
    let resumed: Option<CheckpointState> = if resume_state.is_empty() {
        None
    } else {
        Some(
            serde_json::from_slice(&resume_state).map_err(|e| TrainError::Checkpoint {
                path: config.telemetry.output.clone(),
                message: format!("resume state from rank 0: {e}"),
            })?,
        )
    };
    strategy.synchronize_initial_state(&mut engine)?;

    let sampler = DistributedSampler::new(train.len(), world, rank, config.model.seed, true)?;
    let steps_per_epoch = sampler.steps_per_epoch(config.data.batch_size) as u64;
    if steps_per_epoch == 0 {
        return Err(TrainError::config(
            "config",
            format!(
                "`batch_size` {} x {world} ranks is larger than the {} training samples",
                config.data.batch_size,
                train.len()
            ),
        ));
    }
    let planned = steps_per_epoch * config.schedule.epochs as u64;
    let total_steps = match config.schedule.max_steps {
        Some(m) if config.schedule.epochs == 0 => m,
        Some(m) => m.min(planned),
        None => planned,
    };
    let epochs = total_steps.div_ceil(steps_per_epoch) as u32;
    say(
        &mut log,
        observer,
        format!(
            "training: {} params, {} buckets, {} steps/epoch of {}x{} samples, {} steps, strategy {}",
            engine.num_params(),
            strategy.plan().buckets.len(),
            steps_per_epoch,
            config.data.batch_size,
            world,
            total_steps,
            strategy.name()
        ),
    )?;

    let (mut step, start_epoch, mut skip) = match &resumed {
        Some(s) => (s.step, s.epoch, s.step_in_epoch),
        None => (0, 0, 0),
    };
    // Where the next step would start: saved in checkpoints so that a resume continues there.
    let (mut at_epoch, mut at_step_in_epoch) = (start_epoch, skip);
    let fault = Fault::from_env(rank);
    let mut images = Vec::new();
    let mut labels = Vec::new();
    let mut last_eval: Option<EvalStats> = None;
    let mut train_loss = f64::NAN;
    let mut trained_samples = 0u64;
    let train_started = Instant::now();
    let base_lr = config.base_lr();

    for epoch in start_epoch..epochs {
        if step >= total_steps {
            break;
        }
        let epoch_started = Instant::now();
        let batches = sampler.batches(epoch as u64, config.data.batch_size);
        let mut loss_sum = 0.0f64;
        let mut loss_count = 0u64;
        for (i, indices) in batches.iter().enumerate().skip(skip as usize) {
            if step >= total_steps {
                break;
            }
            fill_batch(&train, indices, &mut images, &mut labels)?;
            let lr = config.schedule.lr_schedule.lr_at(
                base_lr,
                step,
                total_steps,
                config.schedule.warmup_steps,
            );
            let stats = strategy.step(
                &mut engine,
                BatchRef {
                    images: &images,
                    labels: &labels,
                },
                lr,
            )?;
            step += 1;
            (at_epoch, at_step_in_epoch) = (epoch, i as u64 + 1);
            if let Some(f) = &fault {
                f.at(step);
            }
            if !stats.global_loss.is_finite() {
                return Err(TrainError::NonFiniteLoss {
                    step,
                    loss: stats.global_loss,
                });
            }
            loss_sum += stats.global_loss as f64;
            loss_count += 1;
            trained_samples += (indices.len() * world) as u64;
            observer.step(&StepEvent {
                epoch,
                epochs,
                step_in_epoch: i as u64 + 1,
                steps_per_epoch,
                step,
                total_steps,
                loss: stats.global_loss,
            });
            if config.schedule.checkpoint_every > 0
                && step % config.schedule.checkpoint_every == 0
                && rank == 0
            {
                let state = CheckpointState {
                    step,
                    epoch,
                    step_in_epoch: i as u64 + 1,
                    config_hash: hash,
                    model: spec.name.clone(),
                    num_params: engine.num_params(),
                    test_acc: last_eval.map(|e| e.accuracy()),
                };
                let dir = checkpoint::save(&config.telemetry.output, &engine, &state)?;
                log.line(&format!("checkpoint {}", dir.display()))?;
            }
        }
        skip = 0;
        let epoch_s = epoch_started.elapsed().as_secs_f64();
        train_loss = if loss_count > 0 {
            loss_sum / loss_count as f64
        } else {
            f64::NAN
        };
        let last_epoch = epoch + 1 == epochs || step >= total_steps;
        let every = config.schedule.eval_every.unwrap_or(1);
        let eval_now = last_epoch || (every > 0 && (epoch + 1) % every == 0);
        if eval_now {
            last_eval = Some(evaluate(&engine, &*comm, &test)?);
        }
        let samples_per_s =
            (loss_count as f64 * (config.data.batch_size * world) as f64) / epoch_s.max(1e-9);
        let metrics = EpochMetrics {
            epoch: epoch + 1,
            step,
            train_loss,
            test_loss: eval_now.then(|| last_eval.map(|e| e.loss())).flatten(),
            test_acc: eval_now.then(|| last_eval.map(|e| e.accuracy())).flatten(),
            samples_per_s,
            epoch_s,
            wall_s: started.elapsed().as_secs_f64(),
        };
        let test_part = match (metrics.test_loss, metrics.test_acc) {
            (Some(l), Some(a)) => format!(" test_loss={l:.4} test_acc={a:.4}"),
            _ => String::new(),
        };
        say(
            &mut log,
            observer,
            format!(
                "epoch {}/{epochs} step={step} train_loss={train_loss:.4}{test_part} samples/s={samples_per_s:.0} time={epoch_s:.1}s",
                epoch + 1
            ),
        )?;
        if rank == 0 {
            append_metrics(&config.telemetry.output, &metrics)?;
        }
    }

    let eval = match last_eval {
        Some(e) => e,
        None => evaluate(&engine, &*comm, &test)?,
    };
    let param_hash = verify_identical(&engine, &*comm)?;
    let checkpoint = if rank == 0 {
        let state = CheckpointState {
            step,
            epoch: at_epoch,
            step_in_epoch: at_step_in_epoch,
            config_hash: hash,
            model: spec.name.clone(),
            num_params: engine.num_params(),
            test_acc: Some(eval.accuracy()),
        };
        let dir = checkpoint::save(&config.telemetry.output, &engine, &state)?;
        log.line(&format!("checkpoint {}", dir.display()))?;
        Some(dir)
    } else {
        None
    };
    let train_s = train_started.elapsed().as_secs_f64();
    let summary = RunSummary {
        role: "peer",
        rank,
        world_size: world,
        test_acc: eval.accuracy(),
        test_loss: eval.loss(),
        train_loss,
        steps: step,
        wall_s: started.elapsed().as_secs_f64(),
        samples_per_s: trained_samples as f64 / train_s.max(1e-9),
        param_hash,
        checkpoint,
    };
    say(
        &mut log,
        observer,
        format!("parameters identical on all {world} ranks (xxh3 {param_hash:016x})"),
    )?;
    log.line(&summary.final_line())?;
    Ok(summary)
}

/// Runs this rank's role in a parameter-server topology.
#[allow(clippy::too_many_arguments)]
fn run_parameter_servers(
    config: &TrainConfig,
    topology: &Topology,
    comm: &Arc<dyn ProcessGroup>,
    log: &mut RunLog,
    observer: &mut dyn Observer,
    engine: &mut dyn Engine,
    spec: &flotilla_engine::ModelSpec,
    train: &ImageDataset,
    test: &ImageDataset,
    started: Instant,
) -> Result<RunSummary> {
    let rank = comm.rank();
    if rank == topology.root() {
        // The placement on this job's hosts when an inventory is given, else the roles.
        let described = match &config.topology.inventory {
            Some(path) => flotilla_cluster::Inventory::load(path)
                .and_then(|inv| flotilla_cluster::place(topology, &inv))
                .map(|p| p.describe())
                .unwrap_or_else(|_| topology.describe()),
            None => topology.describe(),
        };
        for line in described.lines() {
            log.line(line)?;
        }
    }
    let num_workers = topology.num_workers();
    let per_round = num_workers * config.data.batch_size * config.topology.local_steps.max(1);
    let rounds_per_epoch = (train.len() / per_round.max(1)).max(1) as u64;
    let rounds = config
        .schedule
        .num_server_rounds
        .or(config.schedule.max_steps)
        .unwrap_or(config.schedule.epochs.max(1) as u64 * rounds_per_epoch);
    let eval_every = config
        .schedule
        .eval_every
        .map_or(rounds_per_epoch, u64::from);
    let mut ctx = ps::PsContext {
        comm,
        config,
        engine,
        train,
        test,
        rank,
        num_workers,
        rounds,
        eval_every,
        log,
        observer,
        fault: Fault::from_env(rank),
        last_eval: None,
    };
    let outcome = ps::run_role(&mut ctx, topology)?;
    let wall_s = started.elapsed().as_secs_f64();
    let (role, steps, train_loss) = match &outcome {
        ps::PsOutcome::Root(o) => ("root", o.rounds, f64::NAN),
        ps::PsOutcome::Local(pushes) => ("local-server", *pushes, f64::NAN),
        ps::PsOutcome::Shard(updates) => ("shard-server", *updates, f64::NAN),
        ps::PsOutcome::Worker(w) => ("worker", w.rounds, w.loss as f64),
    };
    let mut summary = RunSummary {
        role,
        rank,
        world_size: topology.world_size(),
        test_acc: f64::NAN,
        test_loss: f64::NAN,
        train_loss,
        steps,
        wall_s,
        samples_per_s: 0.0,
        param_hash: 0,
        checkpoint: None,
    };
    if let ps::PsOutcome::Root(o) = &outcome {
        let eval = ps::evaluate_full(ctx.engine, test)?;
        let stats = comm.stats();
        ctx.log(&format!(
            "root: {} updates in {} rounds ({}), staleness max {} mean {:.2}, lost children [{}], received {:.0} bytes/round, {:.1} updates/s",
            o.updates,
            o.rounds,
            o.reason,
            o.max_staleness,
            o.mean_staleness,
            o.lost.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(", "),
            stats.bytes_received as f64 / o.rounds.max(1) as f64,
            o.updates.saturating_sub(1) as f64 / o.busy_s.max(1e-9)
        ))?;
        let state = CheckpointState {
            step: o.rounds,
            epoch: 0,
            step_in_epoch: o.rounds,
            config_hash: config.cluster_hash(spec),
            model: spec.name.clone(),
            num_params: ctx.engine.num_params(),
            test_acc: Some(eval.accuracy()),
        };
        let dir = checkpoint::save(&config.telemetry.output, &*ctx.engine, &state)?;
        ctx.log(&format!("checkpoint {}", dir.display()))?;
        summary.test_acc = eval.accuracy();
        summary.test_loss = eval.loss();
        summary.samples_per_s =
            (o.updates as usize * config.data.batch_size) as f64 / wall_s.max(1e-9);
        summary.checkpoint = Some(dir);
    }
    ctx.log.line(&summary.final_line())?;
    Ok(summary)
}

/// Evaluates on the whole test set, split across ranks (rank `r` takes samples `r, r+N, ...`)
/// and summed with one all-reduce: every rank gets the full-test-set figures.
fn evaluate(
    engine: &dyn Engine,
    comm: &dyn ProcessGroup,
    test: &ImageDataset,
) -> Result<EvalStats> {
    let (rank, world) = (comm.rank(), comm.size());
    let indices: Vec<usize> = (rank..test.len()).step_by(world).collect();
    let mut images = Vec::new();
    let mut labels = Vec::new();
    fill_batch(test, &indices, &mut images, &mut labels)?;
    let local = if indices.is_empty() {
        EvalStats::default()
    } else {
        engine.evaluate(&images, &labels, 1000)?
    };
    let mut sums = [
        local.loss_sum as f32,
        local.correct as f32,
        local.count as f32,
    ];
    comm.all_reduce_sum(&mut sums)?;
    Ok(EvalStats {
        loss_sum: sums[0] as f64,
        correct: sums[1].round() as usize,
        count: sums[2].round() as usize,
    })
}

/// Checks that every rank holds bitwise-identical parameters; returns their hash.
fn verify_identical(engine: &dyn Engine, comm: &dyn ProcessGroup) -> Result<u64> {
    let mut params = vec![0.0f32; engine.num_params()];
    engine.read_params(&mut params)?;
    let bytes: Vec<u8> = params.iter().flat_map(|v| v.to_le_bytes()).collect();
    let hash = xxhash_rust::xxh3::xxh3_64(&bytes);
    let all = comm.all_gather_u64(hash)?;
    let differing: Vec<String> = all
        .iter()
        .enumerate()
        .filter(|(_, h)| **h != all[0])
        .map(|(r, h)| format!("rank {r} has {h:016x}"))
        .collect();
    if differing.is_empty() {
        Ok(hash)
    } else {
        Err(TrainError::Divergence(format!(
            "rank 0 has {:016x}, {}",
            all[0],
            differing.join(", ")
        )))
    }
}
