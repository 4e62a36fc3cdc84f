//! Each rank's plain-text `run.log` and rank 0's `metrics.jsonl`.

use std::fs::{self, File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Serialize;

use crate::error::{Result, TrainError};

/// A rank's log: one timestamped line per event, flushed as written so that a crash loses
/// nothing already logged.
pub struct RunLog {
    path: PathBuf,
    file: BufWriter<File>,
    started: Instant,
}

impl RunLog {
    /// Opens (appending) `<output>/rank-<rank>/run.log`.
    pub fn open(output: &Path, rank: usize) -> Result<Self> {
        Self::open_in(output, &format!("rank-{rank}"))
    }

    /// Opens (appending) `<output>/<name>/run.log` (an elastic job's process: `slot-<k>`,
    /// its rank changing with each generation).
    pub fn open_in(output: &Path, name: &str) -> Result<Self> {
        let dir = output.join(name);
        fs::create_dir_all(&dir).map_err(|e| TrainError::io(&dir, e))?;
        let path = dir.join("run.log");
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| TrainError::io(&path, e))?;
        Ok(Self {
            path,
            file: BufWriter::new(file),
            started: Instant::now(),
        })
    }

    /// The log file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one line, prefixed with the seconds since the log was opened.
    pub fn line(&mut self, text: &str) -> Result<()> {
        let t = self.started.elapsed().as_secs_f64();
        writeln!(self.file, "[{t:9.3}s] {text}")
            .and_then(|()| self.file.flush())
            .map_err(|e| TrainError::io(&self.path, e))
    }
}

/// One epoch's figures, as a line of `metrics.jsonl` (for plots).
#[derive(Debug, Clone, Serialize)]
pub struct EpochMetrics {
    /// 1-based epoch number.
    pub epoch: u32,
    /// Optimizer steps so far.
    pub step: u64,
    /// Mean global training loss over the epoch's steps.
    pub train_loss: f64,
    /// Test loss, when evaluated.
    pub test_loss: Option<f64>,
    /// Test accuracy, when evaluated.
    pub test_acc: Option<f64>,
    /// Global training samples per second during the epoch.
    pub samples_per_s: f64,
    /// Seconds the epoch took (training only).
    pub epoch_s: f64,
    /// Seconds since the run started.
    pub wall_s: f64,
    /// Mean seconds a step of the epoch waited for its batch (this rank's).
    pub data_wait_s: f64,
    /// This rank's resident memory at the line (`VmRSS`, after its evaluation), in bytes;
    /// `None` where the kernel does not say.
    pub resident_bytes: Option<f64>,
}

/// Appends a JSON line to `<output>/metrics.jsonl`.
pub fn append_metrics(output: &Path, m: &EpochMetrics) -> Result<()> {
    let path = output.join("metrics.jsonl");
    let line = serde_json::to_string(m).map_err(|e| TrainError::Checkpoint {
        path: path.clone(),
        message: e.to_string(),
    })?;
    let mut f = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .map_err(|e| TrainError::io(&path, e))?;
    writeln!(f, "{line}").map_err(|e| TrainError::io(&path, e))
}
