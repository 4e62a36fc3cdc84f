//! A pipeline's checkpoints: the first replica's stages send their weights and optimizer
//! state to rank 0, which writes them (one file pair per stage) and their merge (the whole
//! model in PyTorch's names) as one atomic checkpoint; on resume, rank 0 reads them and sends
//! every rank its stage's pair.

use std::path::{Path, PathBuf};
use std::time::Instant;

use flotilla_engine::StageEngine;
use flotilla_tcp::ProcessGroup;

use crate::checkpoint::{self, CheckpointState};
use crate::error::{Result, TrainError};
use crate::strategy::pipeline::Pipeline;
use crate::strategy::pipeline::wire::{self, Direction};

/// The part numbers of a stage's state in a [`Direction::State`] tag.
const WEIGHTS: usize = 0;
const OPTIMIZER: usize = 1;

/// A stage's weights as safetensors bytes and its optimizer state. Both stay in memory: no
/// file in a shared directory that another local user could read, replace or plant a link
/// at.
pub(super) fn stage_parts(stage: &dyn StageEngine) -> Result<[Vec<u8>; 2]> {
    Ok([stage.weights_bytes()?, stage.optimizer_state()?])
}

/// Replaces a stage's weights and optimizer state with `parts` (from [`stage_parts`]).
pub(super) fn load_parts(stage: &mut dyn StageEngine, parts: &[Vec<u8>; 2]) -> Result<()> {
    stage.load_weights_bytes(&parts[WEIGHTS])?;
    stage.load_optimizer_state(&parts[OPTIMIZER])?;
    Ok(())
}

/// A stage's state from world rank `from` (sent by [`send_parts`]).
pub(super) fn receive_parts(world: &dyn ProcessGroup, from: usize) -> Result<[Vec<u8>; 2]> {
    let deadline = Instant::now() + world.timeout();
    let part = |p: usize| {
        world
            .recv_large(from, wire::tag(Direction::State, p, 0), deadline)
            .map_err(|e| TrainError::Peer {
                peer: from,
                message: format!("waiting for the state of the stage at rank {from}: {e}"),
            })
    };
    Ok([part(WEIGHTS)?, part(OPTIMIZER)?])
}

/// Sends a stage's state to world rank `to` (in pieces: a large stage's state is more than a
/// frame).
pub(super) fn send_parts(world: &dyn ProcessGroup, to: usize, parts: &[Vec<u8>; 2]) -> Result<()> {
    for (p, bytes) in parts.iter().enumerate() {
        world.send_large(to, wire::tag(Direction::State, p, 0), bytes)?;
    }
    Ok(())
}

/// The layer ranges of a pipeline, as a checkpoint records them.
fn recorded_ranges(pipe: &Pipeline) -> Vec<[usize; 2]> {
    pipe.cut().ranges.iter().map(|r| [r.start, r.end]).collect()
}

/// Writes a checkpoint of the pipeline; collective over the world. Rank 0 writes it and
/// returns its directory; the other stages of replica 0 send their state to rank 0 (with
/// ZeRO, gathered first from their replicas: [`Pipeline::stage_state`]).
pub fn save(
    pipe: &mut Pipeline,
    output: &Path,
    state: &CheckpointState,
) -> Result<Option<PathBuf>> {
    let rank = pipe.world().rank();
    let stages = pipe.cut().stages();
    let Some(mine) = pipe.stage_state()? else {
        return Ok(None);
    };
    if rank != 0 {
        send_parts(&**pipe.world(), 0, &mine)?;
        return Ok(None);
    }
    let mut all = vec![mine];
    for s in 1..stages {
        all.push(receive_parts(&**pipe.world(), s)?);
    }
    let weights: Vec<&[u8]> = all.iter().map(|p| p[WEIGHTS].as_slice()).collect();
    let (merged, num_params) =
        checkpoint::merge_stage_weights(&weights, &output.join("model.safetensors"))?;
    let state = CheckpointState {
        num_params,
        stages: Some(recorded_ranges(pipe)),
        ..state.clone()
    };
    let dir = checkpoint::save_with(output, &state, |tmp| {
        for (k, parts) in all.iter().enumerate() {
            for (name, bytes) in checkpoint::stage_files(k).iter().zip(parts) {
                checkpoint::write_part(tmp, name, bytes)?;
            }
        }
        checkpoint::write_part(tmp, "model.safetensors", &merged)
    })?;
    Ok(Some(dir))
}

/// Writes the whole model's parameters to `path` (collective over the world): the first
/// replica's stages send their weights to rank 0, which merges them as a checkpoint's
/// `model.safetensors` and writes them atomically. Returns the file on rank 0.
pub fn save_model(pipe: &Pipeline, path: &Path) -> Result<Option<PathBuf>> {
    if pipe.replica() != 0 {
        return Ok(None);
    }
    let world = &**pipe.world();
    let mine = pipe.stage().weights_bytes()?;
    if world.rank() != 0 {
        world.send_large(0, wire::tag(Direction::State, WEIGHTS, 0), &mine)?;
        return Ok(None);
    }
    let mut all = vec![mine];
    let deadline = Instant::now() + world.timeout();
    for s in 1..pipe.cut().stages() {
        let weights = world
            .recv_large(s, wire::tag(Direction::State, WEIGHTS, 0), deadline)
            .map_err(|e| TrainError::Peer {
                peer: s,
                message: format!("waiting for the weights of the stage at rank {s}: {e}"),
            })?;
        all.push(weights);
    }
    let parts: Vec<&[u8]> = all.iter().map(Vec::as_slice).collect();
    let (merged, _) = checkpoint::merge_stage_weights(&parts, path)?;
    crate::model_file::write(path, |tmp| {
        std::fs::write(tmp, &merged).map_err(|e| TrainError::io(tmp, e))
    })
    .map(Some)
}

/// On rank 0: reads the stage files of checkpoint `dir` for this pipeline (re-cut when the
/// checkpoint recorded another cut: `recut.rs`), loads stage 0's and sends every other
/// rank its stage's.
/// Every other rank: receives and loads its stage's. Collective over the world.
pub fn restore(pipe: &mut Pipeline, dir: Option<&Path>) -> Result<()> {
    let (rank, size) = (pipe.world().rank(), pipe.world().size());
    let stages = pipe.cut().stages();
    if rank != 0 {
        let parts = receive_parts(&**pipe.world(), 0)?;
        return pipe.load_stage_state(&parts);
    }
    let Some(dir) = dir else {
        return Err(TrainError::config("resume", "no checkpoint to restore"));
    };
    let state = checkpoint::read_state(dir)?;
    let want = recorded_ranges(pipe);
    let per_stage = match &state.stages {
        Some(cut) if *cut == want => read_parts(dir, stages)?,
        // Written at another cut: its stages' state re-cut for this one.
        Some(cut) => super::recut::recut(dir, cut, &pipe.cut().ranges)?,
        None => {
            return Err(TrainError::Checkpoint {
                path: dir.to_path_buf(),
                message: format!(
                    "was written by a run that was not a pipeline; this pipeline has stages \
                     {want:?}"
                ),
            });
        }
    };
    for r in 1..size {
        send_parts(&**pipe.world(), r, &per_stage[r % stages])?;
    }
    pipe.load_stage_state(&per_stage[0])
}

/// The stage files of checkpoint `dir`, written at this pipeline's cut of `stages` stages.
fn read_parts(dir: &Path, stages: usize) -> Result<Vec<[Vec<u8>; 2]>> {
    let mut per_stage = Vec::with_capacity(stages);
    for k in 0..stages {
        let mut parts: [Vec<u8>; 2] = Default::default();
        for (slot, name) in parts.iter_mut().zip(checkpoint::stage_files(k)) {
            let path = dir.join(name);
            *slot = std::fs::read(&path).map_err(|e| TrainError::io(&path, e))?;
        }
        per_stage.push(parts);
    }
    Ok(per_stage)
}
