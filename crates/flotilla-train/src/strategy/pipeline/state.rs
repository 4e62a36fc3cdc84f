//! A pipeline's checkpoints: the first replica's stages write their weights and optimizer
//! state (one file pair per stage) and their blocks of the merged weights file (the whole
//! model in PyTorch's names, `merged.rs`) into rank 0's checkpoint in progress, one atomic
//! checkpoint; on resume, rank 0 reads them and sends every rank its stage's pair.

use std::path::{Path, PathBuf};
use std::time::Instant;

use flotilla_engine::StageEngine;
use flotilla_tcp::{CommError, ProcessGroup};

use crate::checkpoint::{self, CheckpointState};
use crate::checkpoint_offer::{self, Offer, Offered};
use crate::error::{Result, TrainError};
use crate::strategy::pipeline::Pipeline;
use crate::strategy::pipeline::merged::{self, MergedWeights};
use crate::strategy::pipeline::wire::{self, Direction};

/// The part numbers of a stage's state in a [`Direction::State`] tag.
const WEIGHTS: usize = 0;
const OPTIMIZER: usize = 1;
/// The part number of a stage's weights header, sent ahead for the merged file's layout.
const HEADER: usize = 2;
/// The part number of a stage's block of the merged weights file (its start and length).
const BLOCK: usize = 3;

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
    let part = |p: usize| receive_part(world, (from, p), "state", deadline);
    Ok([part(WEIGHTS)?, part(OPTIMIZER)?])
}

/// Part `part` of the stage at world rank `from` (`what` names it in the error).
fn receive_part(
    world: &dyn ProcessGroup,
    (from, part): (usize, usize),
    what: &str,
    deadline: Instant,
) -> Result<Vec<u8>> {
    world
        .recv_large(from, wire::tag(Direction::State, part, 0), deadline)
        .map_err(|e| TrainError::Peer {
            peer: from,
            message: format!("waiting for the {what} of the stage at rank {from}: {e}"),
        })
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
pub(super) fn recorded_ranges(pipe: &Pipeline) -> Vec<[usize; 2]> {
    pipe.cut().ranges.iter().map(|r| [r.start, r.end]).collect()
}

/// Writes a checkpoint of the pipeline; collective over the world. The first replica's
/// stages (with ZeRO, gathered first from their replicas: [`Pipeline::stage_state`]) write
/// their own files into rank 0's checkpoint in progress where they see it
/// (`crate::checkpoint_offer`), each its block of the merged weights file too
/// (`merged.rs`), all at once; a stage that does not see it sends its state to rank 0 when
/// asked, one stage after another. Rank 0 returns the checkpoint's directory.
pub fn save(
    pipe: &mut Pipeline,
    output: &Path,
    state: &CheckpointState,
) -> Result<Option<PathBuf>> {
    let Some(mine) = pipe.stage_state()? else {
        return Ok(None);
    };
    let world = &**pipe.world();
    let merged_name = output.join("model.safetensors");
    let header = merged::header_of(&mine[WEIGHTS], &merged_name)?;
    if world.rank() != 0 {
        world.send_large(0, wire::tag(Direction::State, HEADER, 0), header)?;
        return send_stage(world, pipe.stage_index(), &mine).map(|()| None);
    }
    let merged = merge_headers(pipe, header.to_vec(), &merged_name)?;
    let state = CheckpointState {
        num_params: merged.values(),
        stages: Some(recorded_ranges(pipe)),
        ..state.clone()
    };
    checkpoint::save_with(output, &state, |tmp| {
        write_stages(pipe, tmp, &merged, &mine)
    })
    .map(Some)
}

/// On rank 0: the merged weights file's layout from its own stage's `header` and every
/// other stage's (sent by the first replica's stages); `out` names it in errors.
fn merge_headers(pipe: &Pipeline, header: Vec<u8>, out: &Path) -> Result<MergedWeights> {
    let world = &**pipe.world();
    let mut headers = vec![header];
    let deadline = Instant::now() + world.timeout();
    for s in 1..pipe.cut().stages() {
        headers.push(receive_part(
            world,
            (s, HEADER),
            "weights header",
            deadline,
        )?);
    }
    let refs: Vec<&[u8]> = headers.iter().map(Vec::as_slice).collect();
    MergedWeights::new(&refs, out)
}

/// Rank 0's part of a checkpoint in progress `tmp`: makes the merged weights file, offers
/// the directory to the other stages of the first replica, tells each its block, writes its
/// own stage and then, one at a time, the stages that came over the wire.
fn write_stages(
    pipe: &Pipeline,
    tmp: &Path,
    merged: &MergedWeights,
    mine: &[Vec<u8>; 2],
) -> Result<()> {
    let world = &**pipe.world();
    let stages = pipe.cut().stages();
    let block = |k: usize| merged.block(k, tmp);
    drop(merged.create(&tmp.join("model.safetensors"))?);
    let offer = checkpoint_offer::offer_to(world, tmp, (1..stages).collect())?;
    offer.writers(world)?;
    for s in 1..stages {
        let (base, len) = block(s)?;
        let bytes = [base.to_le_bytes(), len.to_le_bytes()].concat();
        world.send(s, wire::tag(Direction::State, BLOCK, 0), &bytes)?;
    }
    write_stage(tmp, 0, mine, block(0)?)?;
    let over_wire = offer.answers(world, |r| checkpoint::stage_files(r)[0].clone())?;
    let tmp = offer.close()?;
    for r in over_wire {
        Offer::ask(world, r)?;
        let parts = receive_parts(world, r)?;
        write_stage(&tmp, r, &parts, block(r)?)?;
    }
    Ok(())
}

/// A first-replica stage's part of a checkpoint (not rank 0's): waits for rank 0's offer
/// and its block of the merged weights file, then writes its files and block into the
/// offered directory when it sees it, else sends them to rank 0 when asked.
fn send_stage(world: &dyn ProcessGroup, k: usize, parts: &[Vec<u8>; 2]) -> Result<()> {
    let offered = Offered::receive(world)?;
    let deadline = Instant::now() + world.timeout();
    let bytes = world.recv(0, wire::tag(Direction::State, BLOCK, 0), deadline)?;
    let word = |i: usize| {
        bytes
            .get(8 * i..8 * i + 8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
    };
    let (Some(base), Some(len)) = (word(0), word(1)) else {
        let detail = format!("a block of the merged weights in {} bytes", bytes.len());
        return Err(CommError::Protocol { peer: 0, detail }.into());
    };
    match offered.dir {
        Some(dir) => checkpoint_offer::answer(world, write_stage(&dir, k, parts, (base, len))),
        None => {
            checkpoint_offer::answer_not_shared(world)?;
            checkpoint_offer::wait_ask(world)?;
            send_parts(world, 0, parts)
        }
    }
}

/// Writes stage `k`'s files and its `block` of the merged weights file into the checkpoint
/// in progress `dir`.
fn write_stage(dir: &Path, k: usize, parts: &[Vec<u8>; 2], block: (u64, u64)) -> Result<()> {
    for (name, bytes) in checkpoint::stage_files(k).iter().zip(parts) {
        checkpoint::write_part(dir, name, bytes)?;
    }
    let path = dir.join("model.safetensors");
    merged::write_block(&path, block, merged::data_of(&parts[WEIGHTS], &path)?)
}

/// Writes the whole model's parameters to `path` (collective over the world): the first
/// replica's stages send their weights to rank 0, which writes each stage's block of the
/// merged file (a checkpoint's `model.safetensors`, `merged.rs`) as it arrives, one stage
/// in memory at a time, and puts the file in place atomically. Returns the file on rank 0.
pub fn save_model(pipe: &Pipeline, path: &Path) -> Result<Option<PathBuf>> {
    if pipe.replica() != 0 {
        return Ok(None);
    }
    let world = &**pipe.world();
    let mine = pipe.stage().weights_bytes()?;
    let header = merged::header_of(&mine, path)?;
    if world.rank() != 0 {
        world.send_large(0, wire::tag(Direction::State, HEADER, 0), header)?;
        world.send_large(0, wire::tag(Direction::State, WEIGHTS, 0), &mine)?;
        return Ok(None);
    }
    let merged = merge_headers(pipe, header.to_vec(), path)?;
    crate::model_file::write(path, |tmp| {
        drop(merged.create(tmp)?);
        merged::write_block(tmp, merged.block(0, path)?, merged::data_of(&mine, path)?)?;
        let deadline = Instant::now() + world.timeout();
        for s in 1..pipe.cut().stages() {
            let weights = receive_part(world, (s, WEIGHTS), "weights", deadline)?;
            merged::write_block(
                tmp,
                merged.block(s, path)?,
                merged::data_of(&weights, path)?,
            )?;
        }
        Ok(())
    })
    .map(Some)
}
