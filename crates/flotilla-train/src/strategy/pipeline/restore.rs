//! A pipeline resumed from a checkpoint: every rank that sees rank 0's checkpoint reads its
//! own stage's files there; rank 0 reads and sends the others theirs, one at a time, so that
//! no rank holds every stage's state (a 57 M-parameter GPT's stages are 0.7 GB of weights
//! and Adam moments together).
//!
//! Rank 0 offers the checkpoint's path with the bytes of its `checksums.json`; a rank sees it
//! when the file at that path has the same bytes and its stage's files there have the
//! checksums it lists (the ranks of one host, hosts that mount one output directory). A
//! checkpoint written at another cut is re-cut on rank 0 (`recut.rs`) and sent to every
//! rank.

use std::path::{Path, PathBuf};
use std::time::Instant;

use flotilla_tcp::{CommError, ProcessGroup};

use crate::checkpoint::{self, CHECKSUMS, CheckpointState};
use crate::error::{Result, TrainError};
use crate::strategy::pipeline::Pipeline;
use crate::strategy::pipeline::state::{receive_parts, recorded_ranges, send_parts};
use crate::strategy::pipeline::wire::{self, Direction};

/// The part number of rank 0's offer of its checkpoint in a [`Direction::State`] tag.
const OFFER: usize = 4;
/// The part number of a rank's answer: whether it read its stage's files itself.
const READ: usize = 5;

/// On rank 0: reads the stage files of checkpoint `dir` for this pipeline (re-cut when the
/// checkpoint recorded another cut: `recut.rs`), loads stage 0's and sends every other rank
/// that did not read its own (see the module docs) its stage's.
/// Every other rank: reads or receives and loads its stage's. Collective over the world.
pub fn restore(pipe: &mut Pipeline, dir: Option<&Path>) -> Result<()> {
    let world = pipe.world().clone();
    if world.rank() != 0 {
        let offer = world.recv(0, tag(OFFER), Instant::now() + world.timeout())?;
        let read = read_offered(&offer, pipe.stage_index());
        world.send(0, tag(READ), &[u8::from(read.is_some())])?;
        let parts = match read {
            Some(parts) => parts,
            None => receive_parts(&*world, 0)?,
        };
        return pipe.load_stage_state(&parts);
    }
    let Some(dir) = dir else {
        return Err(TrainError::config("resume", "no checkpoint to restore"));
    };
    // `read_state` refused a checkpoint that records no cut.
    let cut = read_state(dir)?.stages.unwrap_or_default();
    if cut == recorded_ranges(pipe) {
        return send_read(pipe, dir);
    }
    // Written at another cut: its stages' state re-cut for this one.
    let per_stage = super::recut::recut(dir, &cut, &pipe.cut().ranges)?;
    let stages = per_stage.len();
    for r in 1..world.size() {
        world.send(r, tag(OFFER), &[])?;
        answer(&*world, r)?;
        send_parts(&*world, r, &per_stage[r % stages])?;
    }
    pipe.load_stage_state(&per_stage[0])
}

/// The state of checkpoint `dir`, refused unless a pipeline wrote it (on rank 0, before
/// every rank learns it).
pub(super) fn read_state(dir: &Path) -> Result<CheckpointState> {
    let state = checkpoint::read_state(dir)?;
    if state.stages.is_none() {
        return Err(TrainError::Checkpoint {
            path: dir.to_path_buf(),
            message: "was written by a run that was not a pipeline".into(),
        });
    }
    Ok(state)
}

/// Rank 0's side of a checkpoint written at this pipeline's cut: offers it to every other
/// rank, then reads and sends the stage files of each rank that did not read its own.
fn send_read(pipe: &mut Pipeline, dir: &Path) -> Result<()> {
    let world = pipe.world().clone();
    let stages = pipe.cut().stages();
    let sums_path = dir.join(CHECKSUMS);
    let sums = std::fs::read(&sums_path).map_err(|e| TrainError::io(&sums_path, e))?;
    // A path that is not UTF-8 is not offered: every stage goes over the wire.
    let offer = match dir.to_str() {
        Some(path) => [path.as_bytes(), b"\n", &sums].concat(),
        None => Vec::new(),
    };
    for r in 1..world.size() {
        world.send(r, tag(OFFER), &offer)?;
    }
    for r in 1..world.size() {
        if !answer(&*world, r)? {
            send_parts(&*world, r, &read_stage(dir, r % stages)?)?;
        }
    }
    pipe.load_stage_state(&read_stage(dir, 0)?)
}

/// Rank `r`'s answer to the offer: whether it read its stage's files itself.
fn answer(world: &dyn ProcessGroup, r: usize) -> Result<bool> {
    match world.recv(r, tag(READ), Instant::now() + world.timeout())?[..] {
        [read] => Ok(read == 1),
        _ => {
            let detail = "a malformed answer to the checkpoint's offer".to_string();
            Err(CommError::Protocol { peer: r, detail }.into())
        }
    }
}

/// Stage `k`'s files of the checkpoint rank 0 offered, when this rank sees the same
/// checkpoint at that path and the files have the checksums it lists.
fn read_offered(offer: &[u8], k: usize) -> Option<[Vec<u8>; 2]> {
    #[cfg(test)]
    if crate::checkpoint_offer::BLIND.with(std::cell::Cell::get) {
        return None;
    }
    let split = offer.iter().position(|&b| b == b'\n')?;
    let dir = PathBuf::from(std::str::from_utf8(&offer[..split]).ok()?);
    let sums = &offer[split + 1..];
    if std::fs::read(dir.join(CHECKSUMS)).ok()? != sums {
        return None;
    }
    let sums: std::collections::BTreeMap<String, String> = serde_json::from_slice(sums).ok()?;
    let parts = read_stage(&dir, k).ok()?;
    let names = checkpoint::stage_files(k);
    let sound = names
        .iter()
        .zip(&parts)
        .all(|(name, bytes)| sums.get(name) == Some(&checkpoint::checksum_of(bytes)));
    sound.then_some(parts)
}

/// Stage `k`'s files of checkpoint `dir`.
fn read_stage(dir: &Path, k: usize) -> Result<[Vec<u8>; 2]> {
    let mut parts: [Vec<u8>; 2] = Default::default();
    for (slot, name) in parts.iter_mut().zip(checkpoint::stage_files(k)) {
        let path = dir.join(name);
        *slot = std::fs::read(&path).map_err(|e| TrainError::io(&path, e))?;
    }
    Ok(parts)
}

/// The tag of a restore's message `part`.
fn tag(part: usize) -> flotilla_tcp::Tag {
    wire::tag(Direction::State, part, 0)
}
