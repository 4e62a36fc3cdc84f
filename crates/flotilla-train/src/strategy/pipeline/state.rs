//! A pipeline's checkpoints: the first replica's stages write their weights (one file per
//! stage) and their blocks of the merged weights file (the whole model in PyTorch's names,
//! `merged.rs`), and every rank its part of its stage's optimizer state (the stage's whole
//! state, or under ZeRO among the replicas each replica its shard), into rank 0's checkpoint
//! in progress: one atomic checkpoint that no rank holds whole. Resuming: `restore.rs`.

use std::path::{Path, PathBuf};
use std::time::Instant;

use std::os::unix::fs::FileExt;

use flotilla_engine::{FlatOptimizerState, ShardOptimizer, StageEngine, StatePart, WeightsPlan};
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
    Own(Vec<u8>),
    /// The replicas' shards, each at its ranges.
    Shards(Vec<StatePart<'a>>),
    /// The stage's whole state, taken apart (a re-cut's: `recut.rs`).
    Flat(FlatOptimizerState),
}

/// How a rank's stage's weights reach a checkpoint.
enum Weights {
    /// Whole (safetensors bytes), on the first replica.
    Whole(Vec<u8>),
    /// Under ZeRO-3 (every replica): the stage's weights file's layout. The stage's replicas
    /// that see the checkpoint write it, a share of the tensors each, as its groups are
    /// gathered ([`write_share`]); when none sees it, the stage is gathered whole and its
    /// first replica sends it.
    Sharded(WeightsPlan),
    /// None: another replica of a stage without ZeRO-3.
    None,
}

/// Writes a checkpoint of the pipeline; collective over the world. The first replica's
/// stages write their weights file and their block of the merged weights file
/// (`merged.rs`) (under ZeRO-3 the stage's replicas, a share each as its groups are
/// gathered), and every rank its part of its stage's optimizer state (with ZeRO each replica
/// its shard, else the first replica the whole), into rank 0's checkpoint in progress where
/// they see it (`crate::checkpoint_offer`), all at once; a rank that does not see it sends
/// its part to rank 0 when asked, one after another. Rank 0 returns the checkpoint's
/// directory.
pub fn save(
    pipe: &mut Pipeline,
    output: &Path,
    state: &CheckpointState,
) -> Result<Option<PathBuf>> {
    let weights = match pipe.sharded_weights_plan()? {
        Some(plan) => Weights::Sharded(plan),
        None => pipe.stage_weights()?.map_or(Weights::None, Weights::Whole),
    };
    let merged_name = output.join("model.safetensors");
    let header = match (&weights, pipe.replica()) {
        (Weights::Whole(w), _) => Some(merged::header_of(w, &merged_name)?.to_vec()),
        (Weights::Sharded(plan), 0) => Some(plan.header().to_vec()),
        _ => None,
    };
    let world = pipe.world().clone();
    if world.rank() != 0 {
        if let Some(header) = &header {
            world.send_large(0, tag(HEADER), header)?;
            if let Some(manifest) = pipe.zero_manifest() {
                world.send_large(0, tag(MANIFEST), &manifest_bytes(&manifest)?)?;
            }
        }
        if matches!(weights, Weights::None) && !pipe.shards_optimizer() {
            return Ok(None);
        }
        return send_stage(pipe, weights, output).map(|()| None);
    }
    let Some(header) = header else {
        return Err(TrainError::config(
            "pipeline",
            "rank 0 holds no weights of its stage",
        ));
    };
    let (merged, headers) = merge_headers(pipe, header, &merged_name)?;
    let state = CheckpointState {
        num_params: merged.values(),
        stages: Some(recorded_ranges(pipe)),
        stage_zero: stage_manifests(pipe)?,
        ..state.clone()
    };
    checkpoint::save_with(output, &state, |tmp| {
        write_stages(pipe, tmp, (&merged, &headers), weights)
    })
    .map(Some)
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
/// other stage's (sent by the first replica's stages), and the headers; `out` names it in
/// errors.
fn merge_headers(
    pipe: &Pipeline,
    header: Vec<u8>,
    out: &Path,
) -> Result<(MergedWeights, Vec<Vec<u8>>)> {
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
    Ok((MergedWeights::new(&refs, out)?, headers))
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

/// Whether some replica of the stage of world rank `r` is one of `writers` (it sees the
/// checkpoint in progress).
fn stage_writes(pipe: &Pipeline, r: usize, writers: &[usize]) -> bool {
    let stages = pipe.cut().stages();
    writers.iter().any(|w| w % stages == r % stages)
}

/// Rank 0's part of a checkpoint in progress `tmp`: makes the merged weights file (and
/// under ZeRO-3 each stage's weights file, at their whole lengths), offers the directory to
/// every rank with a part, tells each its stage's block, writes its own part and then, one
/// at a time, the parts that come over the wire.
fn write_stages(
    pipe: &mut Pipeline,
    tmp: &Path,
    (merged, headers): (&MergedWeights, &[Vec<u8>]),
    weights: Weights,
) -> Result<()> {
    let world = pipe.world().clone();
    let stages = pipe.cut().stages();
    let block = |k: usize| merged.block(k, tmp);
    drop(merged.create(&tmp.join("model.safetensors"))?);
    let sharded = matches!(weights, Weights::Sharded(_));
    if sharded {
        for (k, header) in headers.iter().enumerate() {
            create_stage_file(tmp, k, header, block(k)?.1)?;
        }
    }
    let peers: Vec<usize> = match pipe.shards_optimizer() {
        true => (1..world.size()).collect(),
        false => (1..stages).collect(),
    };
    let offer = checkpoint_offer::offer_to(&*world, tmp, peers.clone())?;
    let writers = offer.writers(&*world)?;
    for &r in peers.iter().filter(|&&r| sharded || r < stages) {
        let (base, len) = block(r % stages)?;
        let bytes = [base.to_le_bytes(), len.to_le_bytes()].concat();
        world.send(r, tag(BLOCK), &bytes)?;
    }
    write_part((tmp, &writers), pipe, weights, block(0)?)?;
    let over_wire = offer.answers(&*world, |r| optimizer_file(pipe, r))?;
    let tmp = offer.close()?;
    let deadline = || Instant::now() + world.timeout();
    for r in over_wire {
        Offer::ask(&*world, r)?;
        if r < stages && !(sharded && stage_writes(pipe, r, &writers)) {
            let weights = receive_part(&*world, (r, WEIGHTS), "weights", deadline())?;
            write_weights(&tmp, r, &weights, block(r)?)?;
        }
        let path = tmp.join(optimizer_file(pipe, r));
        checkpoint_offer::receive_file(&*world, (r, tag(OPTIMIZER)), &path)?;
    }
    Ok(())
}

/// Makes stage `k`'s weights file in `dir` with its `header`, at its whole length (`data`
/// bytes of tensors after it, zero until written).
fn create_stage_file(dir: &Path, k: usize, header: &[u8], data: u64) -> Result<()> {
    let path = dir.join(&checkpoint::stage_files(k)[WEIGHTS]);
    let file = std::fs::File::create(&path).map_err(|e| TrainError::io(&path, e))?;
    file.write_all_at(header, 0)
        .and_then(|()| file.set_len(header.len() as u64 + data))
        .map_err(|e| TrainError::io(&path, e))
}

/// A rank's part of a checkpoint (not rank 0's): waits for rank 0's offer (and its stage's
/// block of the merged weights file), then writes its part into the offered directory when
/// it sees it, else sends it to rank 0 when asked.
fn send_stage(pipe: &mut Pipeline, weights: Weights, output: &Path) -> Result<()> {
    let world = pipe.world().clone();
    let offered = Offered::receive(&*world)?;
    let block = match weights {
        Weights::None => (0, 0),
        _ => receive_block(&*world)?,
    };
    let weights = match weights {
        // No replica of the stage sees the checkpoint: its first replica sends it whole.
        Weights::Sharded(_) if !stage_writes(pipe, world.rank(), &offered.writers) => {
            pipe.stage_weights()?.map_or(Weights::None, Weights::Whole)
        }
        w => w,
    };
    if let Some(dir) = offered.dir {
        let wrote = write_part((&dir, &offered.writers), pipe, weights, block);
        return checkpoint_offer::answer(&*world, wrote);
    }
    if let Weights::Sharded(plan) = &weights {
        // Its stage's replicas that see the checkpoint write it: this one gathers with them.
        write_share(pipe, plan, None, &offered.writers)?;
    }
    checkpoint_offer::answer_not_shared(&*world)?;
    let optimizer = pipe.optimizer_part()?;
    let scratch = match &optimizer {
        OptimizerPart::Shard(optimizer) => Some(ScratchShard::write(optimizer, output)?),
        _ => None,
    };
    checkpoint_offer::wait_ask(&*world)?;
    if let Weights::Whole(weights) = &weights {
        world.send_large(0, tag(WEIGHTS), weights)?;
    }
    match (&optimizer, scratch) {
        (OptimizerPart::Whole(bytes), _) => Ok(world.send_large(0, tag(OPTIMIZER), bytes)?),
        (_, Some(scratch)) => scratch.send(&*world, tag(OPTIMIZER)),
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

/// Writes this rank's part into the checkpoint in progress `dir` (which `writers` see): its
/// stage's weights (whole on the first replica: its file and `block` of the merged weights
/// file; under ZeRO-3 its share), then its part of the optimizer state.
fn write_part(
    (dir, writers): (&Path, &[usize]),
    pipe: &mut Pipeline,
    weights: Weights,
    block: (u64, u64),
) -> Result<()> {
    let k = pipe.stage_index();
    match &weights {
        Weights::Whole(w) => write_weights(dir, k, w, block)?,
        Weights::Sharded(plan) => write_share(pipe, plan, Some((dir, block)), writers)?,
        Weights::None => {}
    }
    let name = optimizer_file(pipe, pipe.world().rank());
    match pipe.optimizer_part()? {
        OptimizerPart::Whole(bytes) => checkpoint::write_part(dir, &name, &bytes),
        OptimizerPart::Shard(optimizer) => {
            let path = dir.join(name);
            optimizer.save_state(&path)?;
            checkpoint::sync_part(&path)
        }
        OptimizerPart::None => Ok(()),
    }
}

/// Under ZeRO-3: gathers the stage's groups with its replicas (collective) and, when this
/// rank is one of the stage's `writers` and given the checkpoint in progress and its stage's
/// block of the merged weights file (`target`), writes its share of the tensors (cut among
/// the stage's writers by bytes, `ParamLayout::writer_share`) into the stage's weights file
/// (made by rank 0) and the merged file, as each group arrives: no replica holds its stage.
fn write_share(
    pipe: &mut Pipeline,
    plan: &WeightsPlan,
    target: Option<(&Path, (u64, u64))>,
    writers: &[usize],
) -> Result<()> {
    let (me, stages, k) = (pipe.world().rank(), pipe.cut().stages(), pipe.stage_index());
    let ours: Vec<usize> = writers
        .iter()
        .copied()
        .filter(|w| w % stages == k)
        .collect();
    let (Some((dir, (base, _))), Some(i)) = (target, ours.iter().position(|&w| w == me)) else {
        return pipe.gather_groups(&mut |_, _| Ok(()))?;
    };
    let layout = pipe.stage().layout().clone();
    let mine = layout.writer_share(ours.len(), i);
    let paths = [
        dir.join(&checkpoint::stage_files(k)[WEIGHTS]),
        dir.join("model.safetensors"),
    ];
    let open = |p: &PathBuf| {
        let file = std::fs::OpenOptions::new().write(true).open(p);
        file.map_err(|e| TrainError::io(p, e))
    };
    let files = open(&paths[0]).and_then(|s| Ok([s, open(&paths[1])?]));
    let wrote = pipe.gather_groups(&mut |params, values| {
        let Ok(files) = &files else { return Ok(()) };
        let start = layout.params.get(params.start).map_or(0, |p| p.offset);
        for j in params.filter(|j| mine.contains(j)) {
            let p = &layout.params[j];
            let values = &values[p.offset - start..p.offset - start + p.len];
            plan.write_at((&files[0], &paths[0]), j, values)?;
            plan.write_data_at((&files[1], &paths[1]), base, j, values)?;
        }
        Ok(())
    })?;
    let files = files?;
    wrote?;
    if i == 0 {
        // The running statistics (batch norm), whole on every replica and averaged before
        // a checkpoint (`Pipeline::average_buffers`), are the first writer's.
        crate::model_file::each_buffer_tensor(pipe.stage(), &mut |j, values| {
            plan.write_at((&files[0], &paths[0]), j, values)?;
            Ok(plan.write_data_at((&files[1], &paths[1]), base, j, values)?)
        })?;
    }
    for (file, path) in files.iter().zip(&paths) {
        file.sync_all().map_err(|e| TrainError::io(path, e))?;
    }
    Ok(())
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
    let (merged, _) = merge_headers(pipe, header.to_vec(), path)?;
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
