//! The binary's telemetry: the `tracing` subscriber (`RUST_LOG` for stderr, default `warn`),
//! a rank's timeline file and its `/metrics` endpoint.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use flotilla_telemetry::{Recorder, Timeline};
use flotilla_train::TrainConfig;
use tracing_subscriber::filter::{EnvFilter, LevelFilter, Targets};
use tracing_subscriber::prelude::*;

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
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        // A resumed job, or a worker replaced while the job runs, goes on in the same file.
        let opening = if config.schedule.resume || flotilla_train::rejoin::asked_to_rejoin() {
            flotilla_telemetry::Opening::Continue
        } else {
            flotilla_telemetry::Opening::Fresh
        };
        let (timeline, layer) = flotilla_telemetry::timeline(&path, opening)
            .with_context(|| format!("creating the timeline {}", path.display()))?;
        telemetry.timeline = Some(timeline);
        timeline_layer = Some(
            layer.with_filter(
                Targets::new()
                    .with_target("flotilla", LevelFilter::TRACE)
                    .with_default(LevelFilter::OFF),
            ),
        );
    }
    tracing_subscriber::registry()
        .with(fmt)
        .with(timeline_layer)
        .try_init()
        .context("installing the tracing subscriber")?;
    if let Some((config, _)) = train
        && config.telemetry.metrics_port.is_some()
    {
        telemetry.recorder = Some(flotilla_telemetry::install()?);
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
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let report = flotilla_telemetry::merge(&files, dest)?;
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
