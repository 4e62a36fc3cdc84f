//! What a rank shows while it trains: an indicatif bar on a terminal, JSON-lines events for a
//! supervising launcher ([`RankEvent`]), plain lines otherwise; and, once the rank knows its
//! place, its timeline's process name and its `/metrics` endpoint.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use flotilla_telemetry::{MetricsServer, RankEvent};
use flotilla_train::{Observer, StepEvent};
use indicatif::{ProgressBar, ProgressStyle};

use crate::telemetry::RankTelemetry;

/// Environment variable telling a rank to print event lines for its launcher.
pub const PROGRESS_ENV: &str = "FLOTILLA_PROGRESS";

/// A progress bar over the run's steps, if stderr is a terminal.
pub fn step_bar(total: u64) -> Option<ProgressBar> {
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = ProgressBar::new(total);
    let style = ProgressStyle::with_template(
        "{spinner} [{elapsed_precise}] {bar:40.cyan/blue} {pos}/{len} steps  {msg}",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar());
    bar.set_style(style);
    bar.enable_steady_tick(Duration::from_millis(200));
    Some(bar)
}

/// The observer of a rank run by `flotilla train`: log lines to stdout, and either a bar (on a
/// terminal) or throttled progress events (under `flotilla launch`).
pub struct TrainObserver {
    bar: Option<ProgressBar>,
    emit_progress: bool,
    last_emit: Option<Instant>,
    telemetry: RankTelemetry,
    metrics_port: Option<u16>,
    metrics_addr: String,
    metrics: Option<MetricsServer>,
}

impl TrainObserver {
    /// Chooses the display from the environment; `metrics_port` is the base port of the
    /// ranks' `/metrics` endpoints, served on the interface `metrics_addr`.
    pub fn new(telemetry: RankTelemetry, metrics_port: Option<u16>, metrics_addr: &str) -> Self {
        let emit_progress = std::env::var(PROGRESS_ENV).is_ok_and(|v| v == "1");
        Self {
            bar: None,
            emit_progress,
            last_emit: None,
            telemetry,
            metrics_port,
            metrics_addr: metrics_addr.to_string(),
            metrics: None,
        }
    }

    /// Whether a launcher reads this rank's events.
    pub fn emits_events(&self) -> bool {
        self.emit_progress
    }

    /// Removes the bar, stops serving metrics, and writes out the timeline.
    pub fn finish(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
        self.metrics = None;
        if let Some(t) = &self.telemetry.timeline {
            t.close();
        }
    }
}

impl Observer for TrainObserver {
    fn started(&mut self, rank: usize, _world: usize, role: &str) {
        if let Some(t) = &self.telemetry.timeline {
            t.set_process(rank, role);
        }
        if let (Some(recorder), Some(base)) = (&self.telemetry.recorder, self.metrics_port) {
            let port = base.saturating_add(u16::try_from(rank).unwrap_or(u16::MAX));
            match recorder.serve(&self.metrics_addr, port) {
                Ok(server) => {
                    let addr = &self.metrics_addr;
                    println!("metrics: http://{addr}:{}/metrics", server.port());
                    self.metrics = Some(server);
                }
                // Training goes on without its endpoint; the reason is shown.
                Err(e) => tracing::warn!(target: "flotilla::metrics", error = %e, "no /metrics"),
            }
        }
    }

    fn step(&mut self, e: &StepEvent) {
        if self.emit_progress {
            let due = self
                .last_emit
                .is_none_or(|t| t.elapsed() >= Duration::from_millis(250));
            if due || e.step == e.total_steps {
                self.last_emit = Some(Instant::now());
                let event = RankEvent::Progress {
                    step: e.step,
                    total: e.total_steps,
                    epoch: e.epoch + 1,
                    epochs: e.epochs,
                    loss: e.loss,
                };
                println!("{}", event.line());
            }
            return;
        }
        if self.bar.is_none() {
            self.bar = step_bar(e.total_steps);
        }
        if let Some(bar) = &self.bar {
            bar.set_position(e.step);
            bar.set_message(format!(
                "epoch {}/{} loss {:.4}",
                e.epoch + 1,
                e.epochs,
                e.loss
            ));
        }
    }

    fn message(&mut self, line: &str) {
        match &self.bar {
            Some(bar) => bar.println(line),
            None => println!("{line}"),
        }
    }
}
