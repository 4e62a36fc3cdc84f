//! A process's telemetry: the `tracing` subscriber (`RUST_LOG` for stderr, default `warn`),
//! a rank's timeline file and its `/metrics` endpoint.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use flotilla_telemetry::{Recorder, Timeline};
use flotilla_train::TrainConfig;
use tracing_subscriber::filter::{EnvFilter, LevelFilter, Targets};
use tracing_subscriber::prelude::*;

use crate::error::{RankError, Result};

/// The file a rank records its timeline into, before `flotilla launch` merges them.
pub const RANK_TIMELINE: &str = "timeline.jsonl";

/// What a rank's telemetry holds while it runs.
#[derive(Default)]
pub struct RankTelemetry {
    /// The timeline, when one is recorded.
    pub timeline: Option<Timeline>,
    /// The metrics recorder, when metrics are served.
    pub recorder: Option<Recorder>,
}

/// Where rank `rank`'s timeline goes: `<output>/rank-N/timeline.jsonl`, or, while the rank is
/// not known yet (assigned by rank 0), a file named by the process id.
pub fn rank_timeline_path(output: &Path, rank: Option<usize>) -> PathBuf {
    match rank {
        Some(r) => output.join(format!("rank-{r}")).join(RANK_TIMELINE),
        None => output.join(format!("timeline-pid{}.jsonl", std::process::id())),
    }
}

/// Installs the subscriber: formatted `RUST_LOG` events on stderr, and for a training rank
/// whose config asks for it, the timeline of every `flotilla*` span; installs the metrics
/// recorder when `metrics_port` is set.
pub fn init(train: Option<(&TrainConfig, Option<usize>)>) -> Result<RankTelemetry> {
    let env = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"));
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(true)
        .with_filter(env);
    let mut telemetry = RankTelemetry::default();
    let mut timeline_layer = None;
    if let Some((config, rank)) = train
        && config.telemetry.timeline_path.is_some()
    {
        let path = rank_timeline_path(&config.telemetry.output, rank);
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)
                .map_err(|e| RankError::file("create the directory", dir, e))?;
        }
        // A resumed job, or a worker replaced while the job runs, goes on in the same file.
        let opening = if config.schedule.resume || flotilla_train::rejoin::asked_to_rejoin() {
            flotilla_telemetry::Opening::Continue
        } else {
            flotilla_telemetry::Opening::Fresh
        };
        let (timeline, layer) = flotilla_telemetry::timeline(&path, opening)
            .map_err(|e| RankError::file("create the timeline", &path, e))?;
        telemetry.timeline = Some(timeline);
        timeline_layer = Some(
            layer.with_filter(
                Targets::new()
                    .with_target("flotilla", LevelFilter::TRACE)
                    .with_default(LevelFilter::OFF),
            ),
        );
    }
    let wants_timeline = timeline_layer.is_some();
    let installed = tracing_subscriber::registry()
        .with(fmt)
        .with(timeline_layer)
        .try_init();
    // A program may have installed its own subscriber: it keeps it, and only a timeline
    // (which records through Flotilla's) cannot be had.
    if let Err(e) = installed
        && wants_timeline
    {
        return Err(RankError::Telemetry(format!(
            "a timeline (telemetry.timeline_path) records through Flotilla's tracing \
             subscriber, and this process installed its own ({e}): unset the timeline or \
             leave the subscriber to Flotilla"
        )));
    }
    if let Some((config, _)) = train
        && config.telemetry.metrics_port.is_some()
    {
        let recorder = flotilla_telemetry::install();
        telemetry.recorder = Some(recorder.map_err(|e| RankError::Telemetry(e.to_string()))?);
    }
    Ok(telemetry)
}

/// Merges the ranks' timeline files under `output` into `dest`; says what it did.
pub fn merge_rank_timelines(output: &Path, ranks: usize, dest: &Path) -> Result<String> {
    let files: Vec<PathBuf> = (0..ranks)
        .map(|r| rank_timeline_path(output, Some(r)))
        .filter(|p| p.is_file())
        .collect();
    if let Some(dir) = dest.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .map_err(|e| RankError::file("create the directory", dir, e))?;
    }
    let report =
        flotilla_telemetry::merge(&files, dest).map_err(|e| RankError::Telemetry(e.to_string()))?;
    let mut line = format!(
        "timeline: {} events of {} ranks in {}",
        report.events,
        report.files,
        dest.display()
    );
    if report.files < ranks {
        line.push_str(&format!(
            " ({} ranks wrote no timeline)",
            ranks - report.files
        ));
    }
    for t in &report.truncated {
        line.push_str(&format!("; {} ends mid-line (the rank died)", t.display()));
    }
    Ok(line)
}
