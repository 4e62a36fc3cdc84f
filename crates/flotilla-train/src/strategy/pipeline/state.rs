//! A pipeline's checkpoints: the first replica's stages write their weights (one file per
//! stage) and their blocks of the merged weights file (the whole model in PyTorch's names,
//! `merged.rs`), and every rank its part of its stage's optimizer state (the stage's whole
//! state, or under ZeRO among the replicas each replica its shard), into rank 0's checkpoint
//! in progress: one atomic checkpoint that no rank holds whole. Resuming: `restore.rs`.

use std::path::{Path, PathBuf};
use std::time::Instant;

use flotilla_engine::{ShardOptimizer, StageEngine, StatePart};
use flotilla_tcp::{CommError, ProcessGroup};

use crate::checkpoint::{self, CheckpointState, ZeroManifest};
use crate::checkpoint_offer::{self, Offer, Offered, ScratchShard};
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
/// The part number of a stage's ZeRO manifest (how its replicas shard its optimizer state).
/// (4 and 5 are a restore's: `restore.rs`.)
const MANIFEST: usize = 6;

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

/// A rank's part of its stage's optimizer state in a checkpoint
/// ([`Pipeline::optimizer_part`]).
pub(super) enum OptimizerPart<'a> {
    /// The stage's whole state (replica 0 of a stage without ZeRO).
    Whole(Vec<u8>),
    /// This replica's shard (ZeRO among the replicas), written from its optimizer.
    Shard(&'a ShardOptimizer),
    /// None (another replica of a stage without ZeRO).
    None,
}

/// A stage's optimizer state as read from a checkpoint ([`Pipeline::load_stage`]).
pub(super) enum StageOptimizer<'a> {
    /// The stage's whole state.
    Whole(&'a [u8]),
    /// This replica's own shard, at the ranges it holds.
    Own(&'a [u8]),
    /// The replicas' shards, each at its ranges.
    Shards(Vec<StatePart<'a>>),
}

/// Writes a checkpoint of the pipeline; collective over the world. The first replica's
/// stages write their weights file and their block of the merged weights file
/// (`merged.rs`), and every rank its part of its stage's optimizer state (with ZeRO each
/// replica its shard, else the first replica the whole), into rank 0's checkpoint in
/// progress where they see it (`crate::checkpoint_offer`), all at once; a rank that does not
/// see it sends its part to rank 0 when asked, one after another. Rank 0 returns the
/// checkpoint's directory.
pub fn save(
    pipe: &mut Pipeline,
    output: &Path,
    state: &CheckpointState,
) -> Result<Option<PathBuf>> {
    let weights = pipe.stage_weights()?;
    let merged_name = output.join("model.safetensors");
    let world = &**pipe.world();
    if let Some(weights) = &weights {
        let header = merged::header_of(weights, &merged_name)?;
        if world.rank() != 0 {
            world.send_large(0, tag(HEADER), header)?;
            if let Some(manifest) = pipe.zero_manifest() {
                world.send_large(0, tag(MANIFEST), &manifest_bytes(&manifest)?)?;
            }
        }
    }
    let part = pipe.optimizer_part()?;
    if world.rank() != 0 {
        let mine = Part {
            weights: weights.as_deref(),
            optimizer: part,
        };
        if matches!(mine.optimizer, OptimizerPart::None) {
            return Ok(None);
        }
        return send_stage(pipe, &mine, output).map(|()| None);
    }
    let Some(weights) = weights else {
        return Err(TrainError::config(
            "pipeline",
            "rank 0 holds no weights of its stage",
        ));
    };
    let header = merged::header_of(&weights, &merged_name)?.to_vec();
    let merged = merge_headers(pipe, header, &merged_name)?;
    let state = CheckpointState {
        num_params: merged.values(),
        stages: Some(recorded_ranges(pipe)),
        stage_zero: stage_manifests(pipe)?,
        ..state.clone()
    };
    let mine = Part {
        weights: Some(&weights),
        optimizer: part,
    };
    checkpoint::save_with(output, &state, |tmp| {
        write_stages(pipe, tmp, &merged, &mine)
    })
    .map(Some)
}

/// A rank's part of a pipeline checkpoint: its stage's weights (on the first replica) and
/// its part of the optimizer state.
struct Part<'a> {
    weights: Option<&'a [u8]>,
    optimizer: OptimizerPart<'a>,
}

/// The tag of a checkpoint's message `part`.
fn tag(part: usize) -> flotilla_tcp::Tag {
    wire::tag(Direction::State, part, 0)
}

/// A stage's ZeRO manifest as sent to rank 0.
fn manifest_bytes(manifest: &ZeroManifest) -> Result<Vec<u8>> {
    serde_json::to_vec(manifest).map_err(|e| TrainError::config("pipeline", e.to_string()))
}

/// On rank 0: every stage's ZeRO manifest (its own, and those the first replica's other
/// stages send), or `None` when the stages' replicas do not shard their optimizer state.
fn stage_manifests(pipe: &Pipeline) -> Result<Option<Vec<ZeroManifest>>> {
    let Some(own) = pipe.zero_manifest() else {
        return Ok(None);
    };
    let world = &**pipe.world();
    let deadline = Instant::now() + world.timeout();
    let mut all = vec![own];
    for s in 1..pipe.cut().stages() {
        let bytes = receive_part(world, (s, MANIFEST), "ZeRO manifest", deadline)?;
        let manifest = serde_json::from_slice(&bytes).map_err(|e| CommError::Protocol {
            peer: s,
            detail: format!("a malformed ZeRO manifest: {e}"),
        })?;
        all.push(manifest);
    }
    Ok(Some(all))
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

/// The file world rank `r`'s part of the optimizer state goes to: with ZeRO its replica's
/// shard of its stage's, else its stage's.
fn optimizer_file(pipe: &Pipeline, r: usize) -> String {
    let stages = pipe.cut().stages();
    match pipe.shards_optimizer() {
        true => checkpoint::stage_zero_file(r % stages, r / stages),
        false => checkpoint::stage_files(r % stages)[OPTIMIZER].clone(),
    }
}

/// Rank 0's part of a checkpoint in progress `tmp`: makes the merged weights file, offers
/// the directory to every rank with a part, tells each first-replica stage its block,
/// writes its own part and then, one at a time, the parts that come over the wire.
fn write_stages(pipe: &Pipeline, tmp: &Path, merged: &MergedWeights, mine: &Part) -> Result<()> {
    let world = &**pipe.world();
    let stages = pipe.cut().stages();
    let block = |k: usize| merged.block(k, tmp);
    drop(merged.create(&tmp.join("model.safetensors"))?);
    let peers = match pipe.shards_optimizer() {
        true => (1..world.size()).collect(),
        false => (1..stages).collect(),
    };
    let offer = checkpoint_offer::offer_to(world, tmp, peers)?;
    offer.writers(world)?;
    for s in 1..stages {
        let (base, len) = block(s)?;
        let bytes = [base.to_le_bytes(), len.to_le_bytes()].concat();
        world.send(s, tag(BLOCK), &bytes)?;
    }
    write_part(tmp, pipe, mine, block(0)?)?;
    let over_wire = offer.answers(world, |r| optimizer_file(pipe, r))?;
    let tmp = offer.close()?;
    let deadline = || Instant::now() + world.timeout();
    for r in over_wire {
        Offer::ask(world, r)?;
        if r < stages {
            let weights = receive_part(world, (r, WEIGHTS), "weights", deadline())?;
            write_weights(&tmp, r, &weights, block(r)?)?;
        }
        let path = tmp.join(optimizer_file(pipe, r));
        checkpoint_offer::receive_file(world, (r, tag(OPTIMIZER)), &path)?;
    }
    Ok(())
}

/// A rank's part of a checkpoint (not rank 0's): waits for rank 0's offer (and, on the
/// first replica, its block of the merged weights file), then writes its part into the
/// offered directory when it sees it, else sends it to rank 0 when asked.
fn send_stage(pipe: &Pipeline, mine: &Part, output: &Path) -> Result<()> {
    let world = &**pipe.world();
    let offered = Offered::receive(world)?;
    let block = match mine.weights {
        Some(_) => receive_block(world)?,
        None => (0, 0),
    };
    if let Some(dir) = offered.dir {
        return checkpoint_offer::answer(world, write_part(&dir, pipe, mine, block));
    }
    checkpoint_offer::answer_not_shared(world)?;
    let scratch = match &mine.optimizer {
        OptimizerPart::Shard(optimizer) => Some(ScratchShard::write(optimizer, output)?),
        _ => None,
    };
    checkpoint_offer::wait_ask(world)?;
    if let Some(weights) = mine.weights {
        world.send_large(0, tag(WEIGHTS), weights)?;
    }
    match (&mine.optimizer, scratch) {
        (OptimizerPart::Whole(bytes), _) => Ok(world.send_large(0, tag(OPTIMIZER), bytes)?),
        (_, Some(scratch)) => scratch.send(world, tag(OPTIMIZER)),
        _ => Ok(()),
    }
}

/// The block of the merged weights file rank 0 gives this stage (its start and length).
fn receive_block(world: &dyn ProcessGroup) -> Result<(u64, u64)> {
    let deadline = Instant::now() + world.timeout();
    let bytes = world.recv(0, tag(BLOCK), deadline)?;
    let word = |i: usize| {
        bytes
            .get(8 * i..8 * i + 8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
    };
    match (word(0), word(1)) {
        (Some(base), Some(len)) => Ok((base, len)),
        _ => {
            let detail = format!("a block of the merged weights in {} bytes", bytes.len());
            Err(CommError::Protocol { peer: 0, detail }.into())
        }
    }
}

/// Writes this rank's part into the checkpoint in progress `dir`: on the first replica its
/// stage's weights file and `block` of the merged weights file, and its optimizer part.
fn write_part(dir: &Path, pipe: &Pipeline, mine: &Part, block: (u64, u64)) -> Result<()> {
    let k = pipe.stage_index();
    if let Some(weights) = mine.weights {
        write_weights(dir, k, weights, block)?;
    }
    let name = optimizer_file(pipe, pipe.world().rank());
    match &mine.optimizer {
        OptimizerPart::Whole(bytes) => checkpoint::write_part(dir, &name, bytes),
        OptimizerPart::Shard(optimizer) => {
            let path = dir.join(name);
            optimizer.save_state(&path)?;
            checkpoint::sync_part(&path)
        }
        OptimizerPart::None => Ok(()),
    }
}

/// Writes stage `k`'s weights file and its `block` of the merged weights file into the
/// checkpoint in progress `dir`.
fn write_weights(dir: &Path, k: usize, weights: &[u8], block: (u64, u64)) -> Result<()> {
    checkpoint::write_part(dir, &checkpoint::stage_files(k)[WEIGHTS], weights)?;
    let path = dir.join("model.safetensors");
    merged::write_block(&path, block, merged::data_of(weights, &path)?)
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
