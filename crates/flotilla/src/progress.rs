//! Progress display: an indicatif bar on a terminal, `@progress` lines for a supervising
//! launcher, plain lines otherwise.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use flotilla_train::{Observer, StepEvent};
use indicatif::{ProgressBar, ProgressStyle};

/// Prefix of the machine-readable progress lines a rank prints for its launcher.
pub const PROGRESS_PREFIX: &str = "@progress ";

/// Environment variable telling a rank to print `@progress` lines.
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
/// terminal) or throttled `@progress` lines (under `flotilla launch`).
pub struct TrainObserver {
    bar: Option<ProgressBar>,
    emit_progress: bool,
    last_emit: Option<Instant>,
}

impl TrainObserver {
    /// Chooses the display from the environment.
    pub fn new() -> Self {
        let emit_progress = std::env::var(PROGRESS_ENV).is_ok_and(|v| v == "1");
        Self {
            bar: None,
            emit_progress,
            last_emit: None,
        }
    }

    /// Removes the bar, if any.
    pub fn finish(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }
}

impl Default for TrainObserver {
    fn default() -> Self {
        Self::new()
    }
}

impl Observer for TrainObserver {
    fn step(&mut self, e: &StepEvent) {
        if self.emit_progress {
            let due = self
                .last_emit
                .is_none_or(|t| t.elapsed() >= Duration::from_millis(250));
            if due || e.step == e.total_steps {
                self.last_emit = Some(Instant::now());
                println!(
                    "{PROGRESS_PREFIX}{} {} {} {} {:.5}",
                    e.step,
                    e.total_steps,
                    e.epoch + 1,
                    e.epochs,
                    e.loss
                );
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

/// A parsed `@progress` line.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Progress {
    /// Steps done.
    pub step: u64,
    /// Steps in the run.
    pub total: u64,
    /// 1-based epoch.
    pub epoch: u32,
    /// Epochs.
    pub epochs: u32,
    /// Loss of the last step.
    pub loss: f32,
}

/// Parses the rest of an `@progress` line.
pub fn parse_progress(rest: &str) -> Option<Progress> {
    let mut it = rest.split_whitespace();
    Some(Progress {
        step: it.next()?.parse().ok()?,
        total: it.next()?.parse().ok()?,
        epoch: it.next()?.parse().ok()?,
        epochs: it.next()?.parse().ok()?,
        loss: it.next()?.parse().ok()?,
    })
}
