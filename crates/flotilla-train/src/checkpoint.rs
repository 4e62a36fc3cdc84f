//! Atomic checkpoints: `<output>/checkpoints/step-00000468/` holds `model.safetensors`
//! (PyTorch layout), `optimizer.bpk` (burn's burnpack) and `state.json`; the file
//! `<output>/checkpoints/latest` names the newest complete one.
//!
//! A checkpoint is written into a hidden temporary directory, flushed, and renamed into
//! place; only then is `latest` replaced (also by write-and-rename). A crash at any point
//! leaves the previous checkpoint intact and `latest` pointing at a complete directory.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use flotilla_engine::Engine;
use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};

/// How many checkpoints to keep (older ones are deleted after a new one is in place).
pub const KEEP: usize = 3;

/// What a checkpoint says besides the tensors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointState {
    /// Optimizer steps taken so far.
    pub step: u64,
    /// The epoch in progress when the checkpoint was taken (0-based).
    pub epoch: u32,
    /// Steps of that epoch already done.
    pub step_in_epoch: u64,
    /// The cluster config hash of the run that wrote it.
    pub config_hash: u64,
    /// The model's name.
    pub model: String,
    /// Number of parameters.
    pub num_params: usize,
    /// Test accuracy at the time, when known.
    pub test_acc: Option<f64>,
}

/// The checkpoint directory under a run's output directory.
pub fn checkpoints_dir(output: &Path) -> PathBuf {
    output.join("checkpoints")
}

fn ck_err(path: &Path, message: impl Into<String>) -> TrainError {
    TrainError::Checkpoint {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = File::create(path).map_err(|e| TrainError::io(path, e))?;
    f.write_all(bytes).map_err(|e| TrainError::io(path, e))?;
    f.sync_all().map_err(|e| TrainError::io(path, e))
}

fn sync_file(path: &Path) -> Result<()> {
    File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(|e| TrainError::io(path, e))
}

/// Writes a checkpoint of `engine` atomically and returns its directory.
pub fn save(output: &Path, engine: &dyn Engine, state: &CheckpointState) -> Result<PathBuf> {
    let root = checkpoints_dir(output);
    fs::create_dir_all(&root).map_err(|e| TrainError::io(&root, e))?;
    let name = format!("step-{:08}", state.step);
    let tmp = root.join(format!(".{name}.tmp-{}", std::process::id()));
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(|e| TrainError::io(&tmp, e))?;
    }
    fs::create_dir(&tmp).map_err(|e| TrainError::io(&tmp, e))?;

    let model = tmp.join("model.safetensors");
    engine.save_weights(&model)?;
    sync_file(&model)?;
    write_synced(&tmp.join("optimizer.bpk"), &engine.optimizer_state()?)?;
    let json = serde_json::to_vec_pretty(state).map_err(|e| ck_err(&tmp, e.to_string()))?;
    write_synced(&tmp.join("state.json"), &json)?;

    let dest = root.join(&name);
    if dest.exists() {
        fs::remove_dir_all(&dest).map_err(|e| TrainError::io(&dest, e))?;
    }
    fs::rename(&tmp, &dest).map_err(|e| TrainError::io(&dest, e))?;
    let latest_tmp = root.join(format!(".latest.tmp-{}", std::process::id()));
    write_synced(&latest_tmp, name.as_bytes())?;
    let latest = root.join("latest");
    fs::rename(&latest_tmp, &latest).map_err(|e| TrainError::io(&latest, e))?;
    if let Ok(d) = File::open(&root) {
        // Persist the renames themselves; not every platform supports syncing a directory.
        let _ = d.sync_all();
    }
    prune(&root, &name)?;
    Ok(dest)
}

/// Deletes all but the newest [`KEEP`] checkpoints, never the current one.
fn prune(root: &Path, current: &str) -> Result<()> {
    let mut names: Vec<String> = fs::read_dir(root)
        .map_err(|e| TrainError::io(root, e))?
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.starts_with("step-"))
        .collect();
    names.sort();
    let excess = names.len().saturating_sub(KEEP);
    for n in names.into_iter().take(excess).filter(|n| n != current) {
        let p = root.join(n);
        fs::remove_dir_all(&p).map_err(|e| TrainError::io(&p, e))?;
    }
    Ok(())
}

/// The newest complete checkpoint under `output`, if any.
pub fn latest(output: &Path) -> Result<Option<PathBuf>> {
    let root = checkpoints_dir(output);
    let pointer = root.join("latest");
    let name = match fs::read_to_string(&pointer) {
        Ok(n) => n.trim().to_string(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(TrainError::io(&pointer, e)),
    };
    if name.is_empty() || name.contains('/') || name.contains("..") {
        return Err(ck_err(
            &pointer,
            format!("names an invalid checkpoint {name:?}"),
        ));
    }
    let dir = root.join(&name);
    if !dir.join("state.json").is_file() {
        return Err(ck_err(&dir, "named by `latest` but incomplete or missing"));
    }
    Ok(Some(dir))
}

/// Reads a checkpoint's state without touching any engine.
pub fn read_state(dir: &Path) -> Result<CheckpointState> {
    let path = dir.join("state.json");
    let bytes = fs::read(&path).map_err(|e| TrainError::io(&path, e))?;
    serde_json::from_slice(&bytes).map_err(|e| ck_err(&path, e.to_string()))
}

/// Loads a checkpoint's weights and optimizer state into `engine` and returns its state.
/// A checkpoint of another model is an error and leaves the engine unchanged.
pub fn load(dir: &Path, engine: &mut dyn Engine) -> Result<CheckpointState> {
    let state = read_state(dir)?;
    if state.num_params != engine.num_params() {
        return Err(ck_err(
            dir,
            format!(
                "holds {} parameters ({}) but the model has {}",
                state.num_params,
                state.model,
                engine.num_params()
            ),
        ));
    }
    let optimizer = dir.join("optimizer.bpk");
    let bytes = fs::read(&optimizer).map_err(|e| TrainError::io(&optimizer, e))?;
    engine.load_weights(&dir.join("model.safetensors"))?;
    engine.load_optimizer_state(&bytes)?;
    Ok(state)
}
