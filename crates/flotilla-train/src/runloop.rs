//! The one run loop: drives any [`Strategy`] step by step and does, once for all of them, what
//! is not the role's business — counting progress against the plan, epochs and their
//! report lines, evaluation when due (collective or local; a text's loss also in bits per
//! byte), the target accuracy and loss, periodic and final checkpoints, progress for the
//! front end, injected faults, the cross-rank identity check and the summary.

use std::path::{Path, PathBuf};
use std::time::Instant;

use flotilla_engine::EvalStats;

use crate::batches::{Batches, Position};
use crate::checkpoint::CheckpointState;
use crate::divergence::{DivergenceCheck, Verdict};
use crate::error::{Result, TrainError};
use crate::fault::FaultAction;
use crate::history::{EvalPoint, History, LossPoint};
use crate::observe::StepEvent;
use crate::plan::{Cadence, LoopPlan};
use crate::runlog::{EpochMetrics, append_metrics};
use crate::strategy::{Cx, Evaluation, Step, Strategy};

/// How the loop ended on this rank.
#[derive(Debug, Clone)]
pub struct Finished {
    /// Units of progress in total (including those before a resume).
    pub progress: u64,
    /// The progress this process started from (a resumed checkpoint's step, else 0).
    pub resumed_at: u64,
    /// Units of progress this process itself made, counted step by step as they finished
    /// (so `progress - resumed_at` when a resumed run goes on exactly where it stood).
    pub steps_run: u64,
    /// The final evaluation, if this role evaluates.
    pub eval: Option<EvalStats>,
    /// Mean training loss of the last epoch (peers) or the last unit (others).
    pub train_loss: f64,
    /// Training samples per second over the run (all ranks).
    pub samples_per_s: f64,
    /// Training samples of this run (all ranks; those before a resume not counted).
    pub samples: u64,
    /// Every step's loss and every record (epoch ends, evaluations).
    pub history: History,
    /// The final checkpoint, if this rank writes them.
    pub checkpoint: Option<PathBuf>,
    /// XXH3 of the final parameters, checked identical on every rank (collective roles).
    pub param_hash: Option<u64>,
    /// Mean seconds a step waited for its batch (`None`: this role drew none).
    pub data_wait_s: Option<f64>,
    /// The most bytes of training samples this rank held (the set's own, and an epoch's
    /// shard).
    pub data_bytes: usize,
    /// The kernel's peak of this process's resident memory at the end of its last step
    /// (the start and every step, not the end of run's evaluation and checkpoint).
    pub steps_peak_resident_bytes: Option<f64>,
}

struct Epoch {
    started: Instant,
    loss_sum: f64,
    /// Steps that reported a loss (an async peer's step that applied nothing has none).
    steps: u64,
    /// Training samples (all ranks) of the epoch's steps.
    samples: u64,
}

impl Epoch {
    fn new() -> Self {
        Self {
            started: Instant::now(),
            loss_sum: 0.0,
            steps: 0,
            samples: 0,
        }
    }
}

/// The loop's progress between steps: kept by [`run`], or by a [`crate::run::Run`]
/// that its caller drives step by step.
pub(crate) struct LoopState {
    progress: u64,
    /// Steps this process made (see [`Finished::steps_run`]).
    steps_run: u64,
    epoch: Epoch,
    epochs: u32,
    train_loss: f64,
    samples: u64,
    last_eval: Option<EvalStats>,
    stopped: Option<String>,
    history: History,
    check: DivergenceCheck,
    /// When training started (before the role's start: its broadcast or first pull).
    train_started: Instant,
    /// The kernel's peak of this process's resident memory at the end of the last step.
    steps_peak: Option<f64>,
}

impl LoopState {
    /// The state before the first step of `role` on `data` under `plan`.
    pub(crate) fn new(role: &dyn Strategy, data: &Batches, plan: &LoopPlan, cx: &Cx<'_>) -> Self {
        let epochs = plan.total.div_ceil(data.steps_per_epoch().max(1)) as u32;
        // Roles that do not evaluate (workers, local and shard servers) leave "not learning"
        // to the rank that does; a NaN or infinite loss is divergence wherever it shows.
        let check_after = if role.evaluation() == Evaluation::None {
            0
        } else {
            cx.config.schedule.divergence_check_rounds
        };
        LoopState {
            progress: plan.resumed_at,
            steps_run: 0,
            epoch: Epoch::new(),
            epochs,
            train_loss: f64::NAN,
            samples: 0,
            last_eval: None,
            stopped: None,
            history: History::default(),
            check: DivergenceCheck::new(check_after, cx.test.classes().max(2)),
            train_started: Instant::now(),
            steps_peak: None,
        }
    }

    /// Units of progress in total (including those before a resume).
    pub(crate) fn progress(&self) -> u64 {
        self.progress
    }

    /// Counts on from `progress` units (an elastic job's next generation resumes at its
    /// rank 0's steps: one more than this process's when its last step was lost with a
    /// member but went through elsewhere).
    pub(crate) fn resume_at(&mut self, progress: u64) {
        self.progress = progress;
    }

    /// Why the run stopped, once it has.
    pub(crate) fn stopped(&self) -> Option<&str> {
        self.stopped.as_deref()
    }

    /// The newest training loss: the last step's, or an epoch's mean at its end.
    pub(crate) fn train_loss(&self) -> f64 {
        self.train_loss
    }

    /// The last evaluation, if this role evaluates and has.
    pub(crate) fn last_eval(&self) -> Option<EvalStats> {
        self.last_eval
    }
}

/// One run's loop over the parts it borrows for a turn.
pub(crate) struct Loop<'r, 'c> {
    pub(crate) role: &'r mut dyn Strategy,
    pub(crate) data: &'r mut Batches,
    pub(crate) plan: &'r LoopPlan,
    pub(crate) cx: &'r mut Cx<'c>,
    pub(crate) s: &'r mut LoopState,
}

/// Runs `role` to the end of the plan (or until its server stops it).
pub fn run(
    role: &mut dyn Strategy,
    mut data: Batches,
    plan: &LoopPlan,
    cx: &mut Cx<'_>,
) -> Result<Finished> {
    let mut s = LoopState::new(role, &data, plan, cx);
    let l = &mut Loop {
        role,
        data: &mut data,
        plan,
        cx,
        s: &mut s,
    };
    l.role.start(l.cx)?;
    while l.turn()?.is_some() {}
    l.finish()
}

/// The step's metrics (Prometheus, when an exporter is installed) and the traffic counters of
/// the timeline.
fn record_step(step: &Step, seconds: f64, comm: &dyn flotilla_tcp::ProcessGroup) {
    if !step.progressed {
        return;
    }
    metrics::histogram!("flotilla_step_seconds").record(seconds);
    metrics::counter!("flotilla_steps_total").increment(1);
    metrics::counter!("flotilla_samples_total").increment(step.samples);
    metrics::gauge!("flotilla_samples_per_second").set(step.samples as f64 / seconds.max(1e-9));
    if let Some(loss) = step.loss {
        metrics::gauge!("flotilla_train_loss").set(f64::from(loss));
    }
    let traffic = comm.stats();
    // `flotilla_telemetry::COUNTER_TARGET`: a counter series in the timeline.
    tracing::trace!(
        target: "flotilla::counter",
        counter = "bytes",
        sent = traffic.bytes_sent,
        received = traffic.bytes_received
    );
}

impl Loop<'_, '_> {
    /// One turn of the loop: the role's next step and what follows it (counting, epoch
    /// lines, evaluation, checkpoints); `None` when the run has ended before a step (stopped,
    /// or a role that stops itself has done the planned progress).
    pub(crate) fn turn(&mut self) -> Result<Option<Step>> {
        if self.s.stopped.is_some() {
            return Ok(None);
        }
        if self.role.stops_itself() && self.s.progress >= self.plan.total {
            let reason = format!("{} rounds done", self.s.progress);
            self.stop(reason)?;
            return Ok(None);
        }
        let started = Instant::now();
        let step = {
            let _span =
                tracing::info_span!(target: "flotilla::train", "step", step = self.s.progress + 1)
                    .entered();
            self.role.step(self.cx, self.data, self.s.progress)?
        };
        self.s.steps_peak = crate::resident::peak_resident_bytes();
        record_step(&step, started.elapsed().as_secs_f64(), &**self.cx.comm);
        self.after_step(step.clone())?;
        Ok(Some(step))
    }

    /// Ends the run for `reason` (the role tells those below it).
    pub(crate) fn stop(&mut self, reason: String) -> Result<()> {
        self.role.stop(self.cx, &reason)?;
        self.s.stopped = Some(reason);
        Ok(())
    }

    /// Warns about a verdict of the divergence check (once per kind), or stops the run with
    /// it when `abort_on_divergence` says so.
    fn judge(&mut self, verdict: Option<Verdict>) -> Result<()> {
        let Some(verdict) = verdict else {
            return Ok(());
        };
        let advice =
            crate::divergence::advice(&verdict, self.cx.config.base_lr(), self.plan.async_momentum);
        if crate::divergence::aborts(&verdict, self.cx.config.schedule.abort_on_divergence) {
            return Err(TrainError::NotLearning { verdict, advice });
        }
        // Once, on stderr (which the launcher shows) and in the run log.
        let line = format!("warning: {verdict}; {advice}");
        eprintln!("[rank {}] {line}", self.cx.rank);
        self.cx.log_quiet(&line)
    }

    fn after_step(&mut self, step: Step) -> Result<()> {
        if let Some(loss) = step.loss {
            // A loss of a step that completed nothing (a refused push) counts too.
            let at = self.s.progress + u64::from(step.progressed);
            let verdict = self.s.check.loss(at, loss);
            self.judge(verdict)?;
        }
        if let Some(reason) = step.done {
            self.s.stopped = Some(reason);
            return Ok(());
        }
        if !step.progressed {
            return Ok(());
        }
        self.s.progress += 1;
        self.s.steps_run += 1;
        let at = self.s.progress;
        if let Some(f) = &self.cx.fault
            && f.at(at) == Some(FaultAction::Perturb)
        {
            self.perturb()?;
        }
        if let Some(loss) = step.loss.filter(|l| l.is_finite()) {
            self.s.epoch.loss_sum += f64::from(loss);
            self.s.epoch.steps += 1;
            self.s.train_loss = f64::from(loss);
            self.s.history.losses.push(LossPoint {
                step: at,
                wall_s: self.plan.started.elapsed().as_secs_f64(),
                loss: f64::from(loss),
            });
        }
        self.s.samples += step.samples;
        self.s.epoch.samples += step.samples;
        // A step without a loss of its own shows the newest one.
        self.observe(self.s.train_loss as f32);
        self.periodic_checkpoint()?;
        match self.plan.cadence {
            Cadence::Epochs { every } => {
                let last = at >= self.plan.total;
                if self.data.epoch_done() || last {
                    self.end_epoch(every, last)?;
                } else if self.steps_due(at) {
                    self.evaluate_steps(at)?;
                }
            }
            Cadence::Rounds { every } => {
                let evaluates = self.role.evaluation() != Evaluation::None;
                if evaluates && every > 0 && at.is_multiple_of(every) && at < self.plan.total {
                    self.evaluate_rounds(at)?;
                }
            }
        }
        Ok(())
    }

    fn observe(&mut self, loss: f32) {
        let p = self.data.position();
        let (epoch, step_in_epoch, steps_per_epoch, epochs) = match self.plan.cadence {
            // The source moves to the next epoch only when the next batch is drawn.
            Cadence::Epochs { .. } => (
                p.epoch,
                p.step_in_epoch,
                self.data.steps_per_epoch(),
                self.s.epochs,
            ),
            Cadence::Rounds { .. } => (0, self.s.progress, self.plan.total, 1),
        };
        self.cx.observer.step(&StepEvent {
            epoch,
            epochs,
            step_in_epoch,
            steps_per_epoch,
            step: self.s.progress,
            total_steps: self.plan.total,
            loss,
        });
    }

    fn position(&self) -> Position {
        self.data.position()
    }

    /// A `perturb` fault: this rank's first parameter changes (a rank that holds no model of
    /// its own has none to change).
    fn perturb(&mut self) -> Result<()> {
        let Some(model) = self.role.model() else {
            return Ok(());
        };
        let mut params = vec![0.0f32; model.num_params()];
        model.read_params(&mut params)?;
        if let Some(p) = params.first_mut() {
            *p += 1e-3;
        }
        model.write_params(&params)?;
        self.cx
            .log("FLOTILLA_FAULT: changed parameter 0 on this rank")
    }

    /// A checkpoint, on every rank (the role decides who writes what).
    pub(crate) fn checkpoint(&mut self) -> Result<Option<PathBuf>> {
        let _span =
            tracing::info_span!(target: "flotilla::train", "checkpoint", step = self.s.progress)
                .entered();
        let p = self.position();
        let state = CheckpointState {
            step: self.s.progress,
            epoch: p.epoch,
            step_in_epoch: p.step_in_epoch,
            config_hash: self.plan.config_hash,
            model: self.plan.model.clone(),
            // What the model holds is known where it is written (`checkpoint::save`, the
            // pipeline's `state::save`), which fills these in.
            num_params: 0,
            test_acc: self.s.last_eval.map(|e| e.accuracy()),
            stages: None,
            zero: None,
            stage_zero: None,
        };
        let dir = self.role.save_checkpoint(self.cx, &state)?;
        if let Some(dir) = &dir {
            self.cx
                .log_quiet(&format!("checkpoint {}", dir.display()))?;
        }
        Ok(dir)
    }

    /// The whole model's parameters written to `path`, on every rank (the role decides who
    /// writes and how the parameters reach it).
    pub(crate) fn save_model(&mut self, path: &Path) -> Result<Option<PathBuf>> {
        let _span =
            tracing::info_span!(target: "flotilla::train", "save_model", step = self.s.progress)
                .entered();
        let written = self.role.save_model(self.cx, path)?;
        if let Some(file) = &written {
            self.cx.log_quiet(&format!("model {}", file.display()))?;
        }
        Ok(written)
    }

    fn periodic_checkpoint(&mut self) -> Result<()> {
        let every = self.cx.config.schedule.checkpoint_every;
        if every > 0 && self.s.progress.is_multiple_of(every) {
            self.checkpoint()?;
        }
        Ok(())
    }

    /// Evaluates the role's model (callers check that the role evaluates).
    pub(crate) fn evaluate(&mut self) -> Result<EvalStats> {
        let _span = tracing::info_span!(target: "flotilla::train", "eval", step = self.s.progress)
            .entered();
        // Only evaluating roles get here (see `after_step` and `finish`).
        let stats = self.role.evaluate(self.cx)?;
        metrics::gauge!("flotilla_test_accuracy").set(stats.accuracy());
        metrics::gauge!("flotilla_test_loss").set(stats.loss());
        if let Some(bpb) = crate::eval::bits_per_byte(&stats, self.cx.test) {
            metrics::gauge!("flotilla_test_bits_per_byte").set(bpb);
        }
        self.s.last_eval = Some(stats);
        // An evaluation that counted no sample (a model validated elsewhere, as burn's
        // `Learner` validates its own) is no evidence of learning or not.
        if stats.count > 0 {
            let verdict = self.s.check.accuracy(self.s.progress, stats.accuracy());
            self.judge(verdict)?;
        }
        Ok(stats)
    }

    /// A parameter-server root's evaluation every so many rounds, and its target.
    fn evaluate_rounds(&mut self, round: u64) -> Result<()> {
        let stats = self.evaluate()?;
        self.record_rounds(stats);
        let figures = self.eval_part(stats);
        self.cx.log(&format!("eval round {round}{figures}"))?;
        if let Some(reason) = self.target_reached(stats) {
            self.stop(reason)?;
        }
        Ok(())
    }

    /// Whether a data-parallel peer evaluates after step `at` within an epoch
    /// (`eval_every_steps`).
    fn steps_due(&self, at: u64) -> bool {
        let every = self.cx.config.schedule.eval_every_steps.unwrap_or(0);
        let evaluates = self.role.evaluation() != Evaluation::None;
        evaluates && every > 0 && at.is_multiple_of(every)
    }

    /// A peer's evaluation within an epoch (every `eval_every_steps`), and its targets.
    fn evaluate_steps(&mut self, at: u64) -> Result<()> {
        let stats = self.evaluate()?;
        self.s.history.records.push(EvalPoint {
            step: at,
            wall_s: self.plan.started.elapsed().as_secs_f64(),
            train_loss: Some(self.s.train_loss).filter(|l| l.is_finite()),
            test_loss: Some(stats.loss()),
            test_acc: Some(stats.accuracy()),
            samples_per_s: None,
        });
        let figures = self.eval_part(stats);
        let rss = crate::resident::rss_field(crate::resident::resident_bytes());
        self.cx.log(&format!("eval step {at}{figures}{rss}"))?;
        match self.target_reached(stats) {
            Some(reason) => self.stop_at_target(reason),
            None => Ok(()),
        }
    }

    /// Stops a data-parallel run at a target, saying so.
    fn stop_at_target(&mut self, reason: String) -> Result<()> {
        self.cx
            .log(&format!("stopping at step {}: {reason}", self.s.progress))?;
        self.stop(reason)
    }

    /// Why the run stops at evaluation `stats`: `target_accuracy` or `target_loss` reached.
    fn target_reached(&self, stats: EvalStats) -> Option<String> {
        let s = &self.cx.config.schedule;
        if let Some(target) = s.target_accuracy
            && stats.accuracy() >= target
        {
            return Some(format!(
                "test accuracy {:.4} reached target {target}",
                stats.accuracy()
            ));
        }
        self.loss_target_reached(stats)
    }

    /// Why the run stops at evaluation `stats`: `target_loss` reached (checked at every
    /// evaluation, epoch ends included).
    fn loss_target_reached(&self, stats: EvalStats) -> Option<String> {
        match self.cx.config.schedule.target_loss {
            Some(target) if stats.loss() <= target => Some(format!(
                "test loss {:.4} reached target {target}",
                stats.loss()
            )),
            _ => None,
        }
    }

    /// An evaluation's figures in a report line: loss and accuracy, and for byte tokens
    /// the loss in bits per byte.
    fn eval_part(&self, e: EvalStats) -> String {
        let bpb = crate::eval::bits_per_byte(&e, self.cx.test)
            .map_or(String::new(), |b| format!(" bpb={b:.4}"));
        format!(
            " test_loss={:.4} test_acc={:.4}{bpb}",
            e.loss(),
            e.accuracy()
        )
    }

    /// For samples that are token windows, the throughput in tokens (one per label, the
    /// window's positions) in a report line; nothing for images.
    fn tokens_part(&self, samples_per_s: f64) -> String {
        let tokens = self.cx.test.labels_per_sample();
        if tokens > 1 {
            format!(" tokens/s={:.0}", samples_per_s * tokens as f64)
        } else {
            String::new()
        }
    }

    /// The record of the rounds since the previous one, ending with evaluation `stats`.
    fn record_rounds(&mut self, stats: EvalStats) {
        let e = std::mem::replace(&mut self.s.epoch, Epoch::new());
        let seconds = e.started.elapsed().as_secs_f64().max(1e-9);
        self.s.history.records.push(EvalPoint {
            step: self.s.progress,
            wall_s: self.plan.started.elapsed().as_secs_f64(),
            train_loss: (e.steps > 0).then(|| e.loss_sum / e.steps as f64),
            test_loss: Some(stats.loss()),
            test_acc: Some(stats.accuracy()),
            samples_per_s: (e.samples > 0).then(|| e.samples as f64 / seconds),
        });
    }

    /// The line (and metrics record) of a finished epoch, with its evaluation when due.
    fn end_epoch(&mut self, every: u32, last: bool) -> Result<()> {
        let epoch_no = self.position().epoch + 1;
        let epoch_s = self.s.epoch.started.elapsed().as_secs_f64();
        let steps = self.s.epoch.steps;
        self.s.train_loss = if steps > 0 {
            self.s.epoch.loss_sum / steps as f64
        } else {
            f64::NAN
        };
        let evaluates = self.role.evaluation() != Evaluation::None;
        let eval_now = evaluates && (last || (every > 0 && epoch_no.is_multiple_of(every)));
        let eval = if eval_now {
            Some(self.evaluate()?)
        } else {
            None
        };
        let global_batch = self.data.batch_size() * self.plan.workers;
        let samples_per_s = (steps as f64 * global_batch as f64) / epoch_s.max(1e-9);
        let data_wait_s = self.data.take_wait().map_or(0.0, |w| w.as_secs_f64());
        let metrics = EpochMetrics {
            epoch: epoch_no,
            step: self.s.progress,
            train_loss: self.s.train_loss,
            test_loss: eval.map(|e| e.loss()),
            test_acc: eval.map(|e| e.accuracy()),
            samples_per_s,
            epoch_s,
            wall_s: self.plan.started.elapsed().as_secs_f64(),
            data_wait_s,
            resident_bytes: crate::resident::resident_bytes(),
        };
        let test_part = eval.map_or(String::new(), |e| self.eval_part(e));
        let tokens_part = self.tokens_part(samples_per_s);
        let rss_part = crate::resident::rss_field(metrics.resident_bytes);
        self.cx.log(&format!(
            "epoch {epoch_no}/{} step={} train_loss={:.4}{test_part} samples/s={samples_per_s:.0}{tokens_part} time={epoch_s:.1}s data_wait={:.3}ms{rss_part}",
            self.s.epochs,
            self.s.progress,
            self.s.train_loss,
            data_wait_s * 1e3
        ))?;
        if self.role.writes_checkpoints() {
            append_metrics(&self.cx.config.telemetry.output, &metrics)?;
        }
        self.s.history.records.push(EvalPoint {
            step: metrics.step,
            wall_s: metrics.wall_s,
            train_loss: Some(metrics.train_loss).filter(|l| l.is_finite()),
            test_loss: metrics.test_loss,
            test_acc: metrics.test_acc,
            samples_per_s: Some(metrics.samples_per_s),
        });
        self.s.epoch = Epoch::new();
        if let Some(reason) = eval.and_then(|e| self.loss_target_reached(e))
            && !last
        {
            self.stop_at_target(reason)?;
        }
        Ok(())
    }

    /// The end of the run: the final evaluation, the identity check, the last lines and
    /// checkpoint.
    pub(crate) fn finish(&mut self) -> Result<Finished> {
        let train_s = self.s.train_started.elapsed().as_secs_f64();
        let eval = match (self.role.evaluation(), self.s.last_eval) {
            (Evaluation::None, _) => None,
            (Evaluation::Collective, Some(e)) => Some(e),
            _ => {
                let stats = self.evaluate()?;
                let recorded = self.s.history.records.last().is_some_and(|r| {
                    r.step == self.s.progress && r.test_acc == Some(stats.accuracy())
                });
                if !recorded {
                    self.record_rounds(stats);
                }
                Some(stats)
            }
        };
        let param_hash = self.role.verify_identical(self.cx)?;
        if let Some(line) = self.role.report(self.cx) {
            self.cx.log(&line)?;
        }
        if let Some(e) = &eval {
            self.cx.log_quiet(&format!(
                "final eval count={} correct={} test_loss={:.6} test_acc={:.6}",
                e.count,
                e.correct,
                e.loss(),
                e.accuracy()
            ))?;
        }
        let traffic = self.cx.comm.stats();
        self.cx.log_quiet(&format!(
            "traffic bytes_sent={} bytes_received={} collectives={} frames_compressed={} shm_bytes={} bytes_sent_inter_host={}",
            traffic.bytes_sent,
            traffic.bytes_received,
            traffic.collectives,
            traffic.frames_compressed,
            traffic.shm_bytes,
            traffic.bytes_sent_inter_host
        ))?;
        let checkpoint = self.checkpoint()?;
        Ok(Finished {
            progress: self.s.progress,
            resumed_at: self.plan.resumed_at,
            steps_run: self.s.steps_run,
            eval,
            train_loss: self.s.train_loss,
            samples_per_s: self.s.samples as f64 / train_s.max(1e-9),
            samples: self.s.samples,
            checkpoint,
            param_hash,
            history: std::mem::take(&mut self.s.history),
            data_wait_s: self.data.run_wait().map(|w| w.as_secs_f64()),
            data_bytes: self.data.peak_held_bytes(),
            steps_peak_resident_bytes: self.s.steps_peak,
        })
    }
}
