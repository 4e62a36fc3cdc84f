//! A pipeline resumed from a checkpoint: every rank that sees rank 0's checkpoint reads its own
//! part there; rank 0 reads and sends the others theirs, one file at a time, so that no rank
//! holds every stage's state (a 57 M-parameter GPT's stages are 0.7 GB of weights and Adam
//! moments together).
//!
//! Rank 0 sends every rank the checkpoint's `state.json`; each works out the files it needs:
//! its stage's weights and optimizer state, which under ZeRO among the replicas is its own
//! shard's file when the checkpoint's replicas held the same shards, else its shard cut out of
//! the stage's state files (every replica's shard, or the whole state: another number of
//! replicas, another ZeRO stage, or none), reading only the tensors that meet it where it sees
//! them, folding each file in as it arrives where it does not. Rank 0 offers the checkpoint's
//! path with the bytes of its `checksums.json`; a rank sees it when the file at that path has
//! the same bytes and the files it needs there have the checksums it lists (the ranks of one
//! host, hosts that mount one output directory); the others name the files they need, which
//! rank 0 reads and sends, each read piece by piece from its file. Under ZeRO-3 a rank reads
//! its shard of its stage's weights file one tensor at a time ([`Pipeline::load_stage_file`]),
//! never the whole file: in the checkpoint where it sees it (rank 0 too), else in a scratch
//! copy it spools as the file arrives. A checkpoint written at another cut is re-cut stage by
//! stage (`recut.rs`): by each rank for its own where it sees it, by rank 0 for the others, one
//! at a time; for a replica under ZeRO, which names its shard in its answer, rank 0 cuts that
//! shard of the optimizer state alone and sends it after the new stage's weights file (spooled
//! under ZeRO-3), so that neither holds the replica's whole stage state.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Instant;

use flotilla_engine::ShardRecut;
use flotilla_tcp::{CommError, ProcessGroup};
use tempfile::TempDir;

use crate::checkpoint::{self, CheckpointState};
use crate::checkpoint_offer::{
    all_listed, offer_of, offered_dir, receive_file, scratch_dir, send_file,
};
use crate::error::{Result, TrainError};
use crate::strategy::pipeline::Pipeline;
use crate::strategy::pipeline::recut::Recut;
use crate::strategy::pipeline::state::{
    StageOptimizer, receive_parts, recorded_ranges, send_parts,
};
use crate::strategy::pipeline::wire::{self, Direction};

/// The part number of rank 0's offer of its checkpoint in a [`Direction::State`] tag.
const OFFER: usize = 4;
/// The part number of a rank's answer: whether it read its files itself, else which it needs.
const READ: usize = 5;
/// The part number of the checkpoint's `state.json` (6 is a stage's ZeRO manifest:
/// `state.rs`).
const STATE: usize = 7;
/// The part number of a file rank 0 sends a rank that does not see the checkpoint.
const FILE: usize = 8;

/// On rank 0: reads checkpoint `dir`'s state, sends it to every rank, offers the
/// checkpoint to every rank and sends each that does not see it the files it needs (or, a
/// checkpoint written at another cut, its stage re-cut: `recut.rs`). Every other rank:
/// reads (or re-cuts) or receives and loads its stage's part; a ZeRO-3 replica spools the
/// weights file it receives into a scratch directory under `output` (the job's output
/// directory on its host). Collective over the world.
pub fn restore(pipe: &mut Pipeline, dir: Option<&Path>, output: &Path) -> Result<()> {
    let world = pipe.world().clone();
    if world.rank() != 0 {
        let deadline = Instant::now() + world.timeout();
        let bytes = world.recv_large(0, tag(STATE), deadline)?;
        let state: CheckpointState =
            serde_json::from_slice(&bytes).map_err(|e| CommError::Protocol {
                peer: 0,
                detail: format!("a malformed checkpoint state: {e}"),
            })?;
        if state.stages.as_ref() != Some(&recorded_ranges(pipe)) {
            return recut_or_receive(pipe, &state, output);
        }
        return read_or_receive(pipe, &state, output);
    }
    let Some(dir) = dir else {
        return Err(TrainError::config("resume", "no checkpoint to restore"));
    };
    let state = read_state(dir)?;
    let bytes =
        serde_json::to_vec(&state).map_err(|e| TrainError::config("resume", e.to_string()))?;
    for r in 1..world.size() {
        world.send_large(r, tag(STATE), &bytes)?;
    }
    // `read_state` refused a checkpoint that records no cut.
    let cut = state.stages.clone().unwrap_or_default();
    if cut == recorded_ranges(pipe) {
        return send_read(pipe, dir, &state);
    }
    // Written at another cut: each rank re-cuts its own stage where it sees the checkpoint,
    // rank 0 the others' one at a time.
    let recut = Recut::open(dir, &state, &pipe.cut().ranges, output)?;
    let offer = offer_of(dir)?;
    for r in 1..world.size() {
        world.send(r, tag(OFFER), &offer)?;
    }
    let stages = pipe.cut().stages();
    for r in 1..world.size() {
        let read = world.recv(r, tag(READ), Instant::now() + world.timeout())?;
        match read.split_first() {
            Some((1, [])) => {}
            Some((0, [])) => send_parts(&*world, r, &recut.stage(r % stages)?)?,
            Some((2, owned)) => {
                let owned = decode_owned(r, owned)?;
                send_recut_shard(&*world, r, (&recut, r % stages), &owned)?;
            }
            _ => {
                let detail = "a malformed answer to the checkpoint's offer".to_string();
                return Err(CommError::Protocol { peer: r, detail }.into());
            }
        }
    }
    let (weights, optimizer) = recut_stage(pipe, &recut, 0)?;
    load_weights(pipe, weights, optimizer)
}

/// Rank 0's re-cut of world rank `r`'s new stage for a replica under ZeRO that does not see
/// the checkpoint: the stage's weights file, sent piece by piece from the scratch directory,
/// then that replica's shard of the optimizer state alone, cut for its flat ranges `owned`.
fn send_recut_shard(
    world: &dyn ProcessGroup,
    r: usize,
    (recut, k): (&Recut, usize),
    owned: &[Range<usize>],
) -> Result<()> {
    let (path, shard) = recut.stage_shard(k, owned)?;
    send_file(world, (r, tag(FILE)), &path)?;
    world.send_large(r, tag(FILE), &shard)?;
    std::fs::remove_file(&path).map_err(|e| TrainError::io(&path, e))
}

/// A blind replica's answer under ZeRO: 2, then its shard's flat ranges of its new stage,
/// each end a little-endian `u64` (1: it re-cut its stage itself; 0: it takes the whole).
fn encode_owned(owned: &[Range<usize>]) -> Vec<u8> {
    let mut answer = vec![2];
    let ends = owned.iter().flat_map(|r| [r.start, r.end]);
    ends.for_each(|v| answer.extend_from_slice(&(v as u64).to_le_bytes()));
    answer
}

/// What [`encode_owned`] wrote, from rank `r` (whose ranges the re-cut checks against its
/// stage: `ShardRecut::new`).
fn decode_owned(r: usize, bytes: &[u8]) -> Result<Vec<Range<usize>>> {
    let malformed = || CommError::Protocol {
        peer: r,
        detail: "a malformed shard in its answer to the checkpoint's offer".into(),
    };
    if !bytes.len().is_multiple_of(16) {
        return Err(malformed().into());
    }
    let values = (bytes.chunks_exact(8))
        .map(|b| usize::try_from(u64::from_le_bytes(b.try_into().unwrap_or_default())))
        .collect::<std::result::Result<Vec<usize>, _>>()
        .map_err(|_| malformed())?;
    let owned = values
        .chunks_exact(2)
        .map(|e| e[0]..e[1])
        .collect::<Vec<_>>();
    if owned.iter().any(|r| r.start > r.end) {
        return Err(malformed().into());
    }
    Ok(owned)
}

/// New stage `k` of `recut` for `pipe`'s stage: its weights file and its optimizer state,
/// under ZeRO among its replicas this replica's shard alone, and under ZeRO-3 the weights
/// file in `recut`'s scratch directory, read a piece at a time.
fn recut_stage(
    pipe: &Pipeline,
    recut: &Recut,
    k: usize,
) -> Result<(WeightsFrom, StageOptimizer<'static>)> {
    if let Some(owned) = pipe.zero_owned() {
        let (path, state) = recut.stage_shard(k, owned)?;
        let weights = match pipe.shards_params() {
            true => WeightsFrom::File(path),
            false => {
                WeightsFrom::Bytes(std::fs::read(&path).map_err(|e| TrainError::io(&path, e))?)
            }
        };
        return Ok((weights, StageOptimizer::Own(state)));
    }
    let (weights, flat, _) = recut.stage_flat(k)?;
    Ok((WeightsFrom::Bytes(weights), StageOptimizer::Flat(flat)))
}

/// A rank's side (not rank 0's) of a checkpoint written at another cut: re-cuts its own
/// stage where it sees rank 0's checkpoint, else receives it from rank 0.
fn recut_or_receive(pipe: &mut Pipeline, state: &CheckpointState, output: &Path) -> Result<()> {
    let world = pipe.world().clone();
    let offer = world.recv(0, tag(OFFER), Instant::now() + world.timeout())?;
    let k = pipe.stage_index();
    // What fails here is rank 0's to meet again, and report, when it re-cuts the stage. The
    // re-cut lives until the stage is loaded: its scratch directory holds the weights file.
    let own = offered_dir(&offer).and_then(|(dir, _)| {
        let recut = Recut::open(&dir, state, &pipe.cut().ranges, output).ok()?;
        let parts = recut_stage(pipe, &recut, k).ok()?;
        Some((recut, parts))
    });
    let answer = match (&own, pipe.zero_owned()) {
        (Some(_), _) => vec![1],
        (None, None) => vec![0],
        (None, Some(owned)) => encode_owned(owned),
    };
    world.send(0, tag(READ), &answer)?;
    match own {
        Some((_recut, (weights, optimizer))) => load_weights(pipe, weights, optimizer),
        None if pipe.zero_owned().is_some() => {
            // Its new stage's weights file (spooled under ZeRO-3), then its shard alone.
            let (weights, _scratch) = receive_weights(pipe, output)?;
            let deadline = Instant::now() + world.timeout();
            let shard = world.recv_large(0, tag(FILE), deadline)?;
            load_weights(pipe, weights, StageOptimizer::Own(shard))
        }
        None => pipe.load_stage_state(&receive_parts(&*world, 0)?),
    }
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

/// What this rank's stage needs of a checkpoint of `state` at its cut: the files, its
/// weights first, and how its optimizer state is in them.
struct Needs {
    files: Vec<String>,
    optimizer: Held,
}

/// How a rank's optimizer state is in the files it needs ([`Needs`]).
enum Held {
    /// The stage's whole state, in one file.
    Whole,
    /// This replica's own shard, in one file.
    Own,
    /// Every replica's shard, at these ranges, one file each.
    Shards(Vec<Vec<std::ops::Range<usize>>>),
}

/// What `pipe`'s rank needs of a checkpoint of `state` written at its cut.
fn needs(pipe: &Pipeline, state: &CheckpointState) -> Result<Needs> {
    let k = pipe.stage_index();
    let [weights, optimizer] = checkpoint::stage_files(k);
    let (files, optimizer) = match state.stage_zero.as_ref().map(|z| z.get(k)) {
        None => (vec![weights, optimizer], Held::Whole),
        Some(Some(m)) if pipe.holds_shard(m) => {
            let own = checkpoint::stage_zero_file(k, pipe.replica());
            (vec![weights, own], Held::Own)
        }
        Some(Some(m)) if m.shards.len() == m.world => {
            let shards = (0..m.world).map(|r| checkpoint::stage_zero_file(k, r));
            let files = std::iter::once(weights).chain(shards).collect();
            (files, Held::Shards(m.ranges()))
        }
        Some(_) => {
            return Err(TrainError::config(
                "resume",
                format!("the checkpoint's manifest of stage {k}'s shards is corrupt"),
            ));
        }
    };
    Ok(Needs { files, optimizer })
}

/// Where a rank's stage weights come from: the file's bytes, or, for a ZeRO-3 stage whose
/// rank sees the checkpoint, the file itself, read a piece at a time
/// ([`Pipeline::load_stage_file`]: no replica holds its whole stage).
enum WeightsFrom {
    Bytes(Vec<u8>),
    File(PathBuf),
}

/// The stage's optimizer state in `rest`, the files after the weights that `needs` named.
/// An own shard's file is taken out of `rest`.
fn stage_optimizer<'a>(needs: &'a Needs, rest: &'a mut [Vec<u8>]) -> Result<StageOptimizer<'a>> {
    let files = rest.len();
    Ok(match (&needs.optimizer, rest) {
        (Held::Whole, [one]) => StageOptimizer::Whole(one),
        (Held::Own, [one]) => StageOptimizer::Own(std::mem::take(one)),
        (Held::Shards(ranges), shards) if shards.len() == ranges.len() => StageOptimizer::Shards(
            (ranges.iter().zip(shards))
                .map(|(r, s)| (Some(r.as_slice()), s.as_slice()))
                .collect(),
        ),
        _ => {
            let detail = format!("{files} files of the stage's optimizer state");
            return Err(TrainError::config("resume", detail));
        }
    })
}

/// Loads the stage's `weights` and `optimizer` state into `pipe`'s stage.
fn load_weights(
    pipe: &mut Pipeline,
    weights: WeightsFrom,
    optimizer: StageOptimizer<'_>,
) -> Result<()> {
    match weights {
        WeightsFrom::Bytes(bytes) => pipe.load_stage(&bytes, optimizer),
        WeightsFrom::File(path) => pipe.load_stage_file(&path, optimizer),
    }
}

/// Loads `pipe`'s stage from the files `needs` names in checkpoint `dir` (of `state`), which
/// this rank sees: under ZeRO-3 its weights a piece at a time ([`Pipeline::load_stage_file`]);
/// under ZeRO, when the checkpoint's shards are not this replica's, its optimizer shard cut
/// out of the stage's state files, reading only what meets it. So no replica holds its
/// whole stage's state.
fn load_dir(pipe: &mut Pipeline, needs: &Needs, dir: &Path, state: &CheckpointState) -> Result<()> {
    let Some((weights, rest)) = needs.files.split_first() else {
        return Err(TrainError::config("resume", "no weights file of the stage"));
    };
    let weights = match pipe.shards_params() {
        true => WeightsFrom::File(dir.join(weights)),
        false => WeightsFrom::Bytes(checkpoint::read_file(dir, weights)?),
    };
    if let Some(mut recut) = shard_recut(pipe, needs)? {
        for (ranges, path) in checkpoint::stage_state_files(dir, state, pipe.stage_index())? {
            recut.read_file(ranges.as_deref(), &path)?;
        }
        return load_weights(pipe, weights, StageOptimizer::Own(recut.finish()?));
    }
    let mut rest =
        (rest.iter().map(|name| checkpoint::read_file(dir, name))).collect::<Result<Vec<_>>>()?;
    load_weights(pipe, weights, stage_optimizer(needs, &mut rest)?)
}

/// This replica's optimizer shard to cut out of the checkpoint's state files, when its stage
/// shards the state (ZeRO among its replicas) and the checkpoint's shards are not its own.
fn shard_recut(pipe: &Pipeline, needs: &Needs) -> Result<Option<ShardRecut>> {
    match needs.optimizer {
        Held::Own => Ok(None),
        Held::Whole | Held::Shards(_) => pipe.shard_recut(),
    }
}

/// The directory of the checkpoint rank 0 offered, when this rank sees it
/// ([`offered_dir`]) and every file `needs` names there has the checksum it lists (read
/// streaming, never whole).
fn seen(offer: &[u8], needs: &Needs) -> Option<PathBuf> {
    let (dir, sums) = offered_dir(offer)?;
    all_listed(&dir, &sums, needs.files.iter()).then_some(dir)
}

/// A rank's side (not rank 0's) of a checkpoint written at its pipeline's cut: reads the
/// files it needs where it sees rank 0's checkpoint, else names them and receives them.
fn read_or_receive(pipe: &mut Pipeline, state: &CheckpointState, output: &Path) -> Result<()> {
    let world = pipe.world().clone();
    let needs = needs(pipe, state)?;
    let offer = world.recv(0, tag(OFFER), Instant::now() + world.timeout())?;
    if let Some(dir) = seen(&offer, &needs) {
        world.send(0, tag(READ), &[1])?;
        return load_dir(pipe, &needs, &dir, state);
    }
    let names = needs.files.join("\n");
    world.send(0, tag(READ), &[&[0], names.as_bytes()].concat())?;
    let (weights, _scratch) = receive_weights(pipe, output)?;
    let deadline = Instant::now() + world.timeout();
    if let Some(mut recut) = shard_recut(pipe, &needs)? {
        // Each state file, folded into the shard as it comes.
        let ranges = match &needs.optimizer {
            Held::Shards(ranges) => ranges.iter().map(|r| Some(r.as_slice())).collect(),
            _ => vec![None],
        };
        for ranges in ranges {
            recut.read_bytes(ranges, world.recv_large(0, tag(FILE), deadline)?)?;
        }
        let mine = recut.finish()?;
        return load_weights(pipe, weights, StageOptimizer::Own(mine));
    }
    let mut rest = (needs.files.iter().skip(1))
        .map(|_| Ok(world.recv_large(0, tag(FILE), deadline)?))
        .collect::<Result<Vec<_>>>()?;
    load_weights(pipe, weights, stage_optimizer(&needs, &mut rest)?)
}

/// The stage's weights file as rank 0 sends it to a rank that does not see the checkpoint:
/// under ZeRO-3 spooled into a scratch file under `output` as it arrives, to be read a piece
/// at a time as a seen one is ([`Pipeline::load_stage_file`]: the replica never holds its
/// whole stage), the file removed with the returned directory; otherwise its bytes.
fn receive_weights(pipe: &Pipeline, output: &Path) -> Result<(WeightsFrom, Option<TempDir>)> {
    let world = pipe.world();
    if !pipe.shards_params() {
        let deadline = Instant::now() + world.timeout();
        return Ok((
            WeightsFrom::Bytes(world.recv_large(0, tag(FILE), deadline)?),
            None,
        ));
    }
    let scratch = scratch_dir(output, ".stage-weights-")?;
    let path = scratch.path().join("stage.bpk");
    receive_file(&**world, (0, tag(FILE)), &path)?;
    Ok((WeightsFrom::File(path), Some(scratch)))
}

/// Rank 0's side of a checkpoint written at this pipeline's cut: offers it to every other
/// rank, then sends, one at a time and each read piece by piece from its file, the files
/// each rank that does not see it names (only the checkpoint's stage files), and loads its
/// own stage's.
fn send_read(pipe: &mut Pipeline, dir: &Path, state: &CheckpointState) -> Result<()> {
    let world = pipe.world().clone();
    let offer = offer_of(dir)?;
    for r in 1..world.size() {
        world.send(r, tag(OFFER), &offer)?;
    }
    let stages = pipe.cut().stages();
    let files: std::collections::BTreeSet<String> = (0..stages)
        .flat_map(|k| checkpoint::stage_parts(state, k))
        .collect();
    for r in 1..world.size() {
        for name in answer(&*world, r)? {
            if !files.contains(&name) {
                let detail = format!("asked for {name:?}, not a file of the checkpoint's stages");
                return Err(CommError::Protocol { peer: r, detail }.into());
            }
            send_file(&*world, (r, tag(FILE)), &dir.join(&name))?;
        }
    }
    let needs = needs(pipe, state)?;
    load_dir(pipe, &needs, dir, state)
}

/// Rank `r`'s answer to the offer: the files it needs sent (none when it read them).
fn answer(world: &dyn ProcessGroup, r: usize) -> Result<Vec<String>> {
    let answer = world.recv(r, tag(READ), Instant::now() + world.timeout())?;
    match answer.split_first() {
        Some((1, [])) => Ok(Vec::new()),
        Some((0, names)) => match std::str::from_utf8(names) {
            Ok(names) => Ok(names.split('\n').map(str::to_owned).collect()),
            Err(_) => Err(CommError::Protocol {
                peer: r,
                detail: "file names that are not UTF-8".into(),
            }
            .into()),
        },
        _ => {
            let detail = "a malformed answer to the checkpoint's offer".to_string();
            Err(CommError::Protocol { peer: r, detail }.into())
        }
    }
}

/// The tag of a restore's message `part`.
fn tag(part: usize) -> flotilla_tcp::Tag {
    wire::tag(Direction::State, part, 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replicas_shard_in_its_answer_decodes_as_it_was_encoded_and_garbage_is_refused() {
        let owned = vec![0..3, 10..10, 12..40];
        let answer = encode_owned(&owned);
        assert_eq!(answer[0], 2);
        assert_eq!(decode_owned(1, &answer[1..]).expect("decode"), owned);
        assert_eq!(
            decode_owned(1, &[]).expect("none"),
            Vec::<Range<usize>>::new()
        );
        let short = &answer[1..answer.len() - 1];
        let backwards = encode_owned(&[5..9, 10..12])
            .into_iter()
            .skip(1)
            .rev()
            .collect::<Vec<_>>();
        for bad in [short, &answer[1..9], &backwards] {
            let err = decode_owned(3, bad).expect_err("garbage");
            assert!(err.to_string().contains("malformed shard"), "{err}");
        }
    }
}
