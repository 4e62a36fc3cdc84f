//! What the launcher does with its ranks' lines: rank 0's progress events drive a progress
//! bar (on a terminal), its `final ...` line is kept for the end, and every other line is shown
//! with its rank's label.

use std::io::IsTerminal;

use flotilla_telemetry::RankEvent;
use indicatif::ProgressBar;

use crate::launch::{RankLine, Stream};
use flotilla_rank::progress::step_bar;

/// What the launcher does with the ranks' lines.
pub(crate) struct Relay {
    labels: Vec<String>,
    interactive: bool,
    /// `None` until rank 0's first progress event; `Some(None)` when not on a terminal.
    bar: Option<Option<ProgressBar>>,
    /// Rank 0's `final ...` line, once seen.
    pub(crate) final_line: Option<String>,
    /// Keep any process's `final ...` line (an elastic job's: its rank 0 at the end may be
    /// any of them, and every member prints the same).
    pub(crate) any_final_line: bool,
}

impl Relay {
    /// A relay labelling each rank's lines with `labels[rank]`.
    pub(crate) fn new(labels: Vec<String>) -> Self {
        Self {
            labels,
            interactive: std::io::stderr().is_terminal(),
            bar: None,
            final_line: None,
            any_final_line: false,
        }
    }

    /// Events update the bar or the summary; every other line is shown with its rank.
    pub(crate) fn on_line(&mut self, line: &RankLine) {
        if line.stream == Stream::Stdout {
            // A malformed event is shown as the text it is.
            if let Some(Ok(event)) = RankEvent::parse(&line.text) {
                return self.on_event(line.rank, event);
            }
            if (line.rank == 0 || self.any_final_line) && line.text.starts_with("final ") {
                self.final_line = Some(line.text.clone());
            }
        }
        let text = match self.labels.get(line.rank) {
            Some(label) => format!("[{label}] {}", line.text),
            None => format!("[rank {}] {}", line.rank, line.text),
        };
        match (&self.bar, line.stream) {
            (Some(Some(b)), _) => b.println(text),
            (_, Stream::Stdout) => println!("{text}"),
            (_, Stream::Stderr) => eprintln!("{text}"),
        }
    }

    fn on_event(&mut self, rank: usize, event: RankEvent) {
        match event {
            RankEvent::Progress {
                step,
                total,
                epoch,
                epochs,
                loss,
            } if rank == 0 && self.interactive => {
                let b = self.bar.get_or_insert_with(|| step_bar(total));
                if let Some(b) = b {
                    b.set_position(step);
                    b.set_message(format!("epoch {epoch}/{epochs} loss {loss:.4}"));
                }
            }
            // Failures are read by the supervisor itself; rank 0 reports the finished ranks
            // in its `summary.json`.
            RankEvent::Progress { .. } | RankEvent::Failed { .. } | RankEvent::Finished { .. } => {}
        }
    }

    /// Removes the progress bar, if one is shown.
    pub(crate) fn clear_bar(&mut self) {
        if let Some(Some(b)) = self.bar.take() {
            b.finish_and_clear();
        }
    }
}
