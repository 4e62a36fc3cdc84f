//! The `telemetry:` section: where a run writes what it reports.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Where a run writes what it reports.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetrySection {
    /// Directory for checkpoints, metrics and each rank's `run.log`.
    pub output: PathBuf,
    /// Write a Chrome trace of the job here: each rank records
    /// `<output>/rank-N/timeline.jsonl`, and `flotilla launch` merges them into this file at
    /// the end (`flotilla trace merge` does it for ranks started otherwise).
    pub timeline_path: Option<PathBuf>,
    /// Serve Prometheus metrics: rank `r` on port `metrics_port + r`, at `/metrics`.
    pub metrics_port: Option<u16>,
    /// The interface `/metrics` listens on: `127.0.0.1` (this machine only) unless widened,
    /// e.g. to `0.0.0.0` for a Prometheus server elsewhere (anyone who reaches the port reads
    /// the job's metrics).
    pub metrics_addr: String,
}

/// The default of [`TelemetrySection::metrics_addr`]: loopback only.
pub const DEFAULT_METRICS_ADDR: &str = "127.0.0.1";

impl Default for TelemetrySection {
    fn default() -> Self {
        Self {
            output: PathBuf::from("runs/latest"),
            timeline_path: None,
            metrics_port: None,
            metrics_addr: DEFAULT_METRICS_ADDR.to_string(),
        }
    }
}
