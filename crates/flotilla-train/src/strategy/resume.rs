//! Where a run resumes from, as every strategy's [`super::Strategy::restore`] takes it: rank 0
//! finds the newest complete checkpoint ([`Resume::find`]), loads it the strategy's way, and
//! every rank learns its state ([`Resume::share`]): its step and place in the data. What
//! else travels (parameters, optimizer state, a pipeline's stages) is the strategy's business.

use std::path::{Path, PathBuf};

use super::context::Cx;
use crate::checkpoint::{self, CheckpointState};
use crate::error::{Result, TrainError};

/// The most bytes of a checkpoint's state (`state.json`: counters, a pipeline's stage
/// ranges, a ZeRO run's shard ranges, a few KiB for most runs, ranks times parameter
/// tensors for ZeRO) the other ranks take from rank 0.
const MAX_STATE_BYTES: usize = 64 << 20;

/// The checkpoint a run resumes from, found on rank 0.
#[derive(Debug, Clone, PartialEq)]
pub struct Resume {
    /// On rank 0: the newest complete checkpoint, when the job resumes; `None` elsewhere and
    /// for a fresh start.
    dir: Option<PathBuf>,
    /// This job's config hash (a checkpoint of another config is restored with a warning).
    config_hash: u64,
    /// This process replaced a lost worker of a running job: it missed the job's collectives
    /// and takes part in no resume.
    rejoined: bool,
}

impl Resume {
    /// On rank 0 with `schedule.resume`: the newest complete checkpoint of the output
    /// directory (each one passed over is logged as a warning). `rejoined`: this process
    /// replaced a lost worker and resumes nothing.
    pub fn find(cx: &mut Cx<'_>, config_hash: u64, rejoined: bool) -> Result<Self> {
        let dir = if cx.rank == 0 && cx.config.schedule.resume && !rejoined {
            let (dir, warnings) = checkpoint::newest_complete(&cx.config.telemetry.output)?;
            for w in warnings {
                cx.log(&format!("warning: not resuming from it: {w}"))?;
            }
            dir
        } else {
            None
        };
        Ok(Self {
            dir,
            config_hash,
            rejoined,
        })
    }

    /// On rank 0: the checkpoint the job resumes from, if it does; `None` elsewhere.
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// Whether this process replaced a lost worker of a running job (it takes part in no
    /// collective of the job's start).
    pub fn rejoined(&self) -> bool {
        self.rejoined
    }

    /// Collective over the world (but for a rejoined process, which returns `None` at once):
    /// rank 0 `load`s the checkpoint it found, logs where it resumes from, and every rank
    /// gets its state; `None` for a fresh start.
    pub fn share(
        &self,
        cx: &mut Cx<'_>,
        load: impl FnOnce(&Path) -> Result<CheckpointState>,
    ) -> Result<Option<CheckpointState>> {
        if self.rejoined {
            return Ok(None);
        }
        let mut bytes = Vec::new();
        if let Some(dir) = &self.dir {
            let state = load(dir)?;
            if state.config_hash != self.config_hash {
                cx.log(&format!(
                    "warning: {} was written by a run with another config",
                    dir.display()
                ))?;
            }
            cx.log(&format!(
                "resuming from {} (step {})",
                dir.display(),
                state.step
            ))?;
            bytes = serde_json::to_vec(&state).map_err(|e| TrainError::Checkpoint {
                path: dir.clone(),
                message: e.to_string(),
            })?;
        }
        cx.comm.broadcast_bytes(&mut bytes, 0, MAX_STATE_BYTES)?;
        if bytes.is_empty() {
            return Ok(None);
        }
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| TrainError::Checkpoint {
                path: cx.config.telemetry.output.clone(),
                message: format!("resume state from rank 0: {e}"),
            })
    }
}
