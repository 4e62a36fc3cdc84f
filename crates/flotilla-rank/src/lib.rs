//! One rank of a Flotilla job as a process runs it — `flotilla train` and a user's program
//! (`flotilla_burn::train`) alike: its telemetry ([`telemetry`]: tracing, the timeline, the
//! `/metrics` endpoint), its display ([`progress`]: a bar, plain lines, or events for a
//! supervising launcher), the run itself ([`flotilla_train::run`]), and rank 0's report
//! ([`report`]: `summary.json` and the plots of [`plots`]).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod error;
pub mod plots;
pub mod progress;
pub mod report;
pub mod telemetry;

use flotilla_telemetry::RankEvent;
use flotilla_train::{ModelSource, RunSummary, TrainConfig};

pub use error::{RankError, Result};

/// Runs this process's rank of the job `config` describes, training `model`: telemetry
/// started, progress shown, and at the end the checkpoint's place, rank 0's report and the
/// final line printed (the launcher reads them). `rank`: this process's rank (`None`:
/// assigned at the rendezvous).
pub fn run(
    config: &TrainConfig,
    model: &dyn ModelSource,
    rank: Option<usize>,
) -> Result<RunSummary> {
    let rank_telemetry = telemetry::init(Some((config, rank)))?;
    let t = &config.telemetry;
    let mut observer =
        progress::TrainObserver::new(rank_telemetry, t.metrics_port, &t.metrics_addr);
    let result = flotilla_train::run(config, model, rank, &mut observer);
    observer.finish();
    if let Err(e) = &result
        && let Some(blamed) = e.blamed_rank()
    {
        // Tells a supervising launcher which rank this failure points at.
        println!("{}", RankEvent::Failed { blamed }.line());
    }
    let summary = result?;
    if let Some(dir) = &summary.checkpoint {
        println!("checkpoint: {}", dir.display());
    }
    if summary.rank == 0 {
        // Rank 0 has the evaluations and every rank's traffic: the run's report is its job.
        let written = report::write_run(config, &summary)?;
        let paths: Vec<String> = written.iter().map(|p| p.display().to_string()).collect();
        println!("report: {}", paths.join(", "));
    }
    if observer.emits_events() {
        let event = RankEvent::Finished {
            role: summary.role.to_string(),
            figures: summary.figures.clone(),
        };
        println!("{}", event.line());
    }
    println!("{}", summary.final_line());
    Ok(summary)
}
