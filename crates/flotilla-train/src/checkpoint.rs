//! Atomic checkpoints: `<output>/checkpoints/step-00000468/` holds `model.safetensors`
//! (PyTorch layout), `optimizer.bpk` (burn's burnpack) and `state.json`; the file
//! `<output>/checkpoints/latest` names the newest complete one.
//!
//! A pipeline's checkpoint holds, instead of `optimizer.bpk`, each stage's own
//! `stage-<k>.safetensors` and `stage-<k>.optimizer.bpk`, and `model.safetensors` is the
//! merge of the stage files (the whole model in PyTorch's names); `state.json` says how many
//! stages there are; when the stages' replicas shard their optimizer state (ZeRO), each
//! replica's `stage-<k>.optimizer-shard-<r>.bpk` stands for the stage's optimizer file and
//! `state.json` records their ranges. A ZeRO run's checkpoint holds, instead of
//! `optimizer.bpk`, each rank's optimizer-state shard `optimizer-shard-<r>.bpk`, and
//! `state.json` the world size and each shard's flat ranges ([`ZeroManifest`]).
//!
//! A checkpoint is written into a hidden temporary directory, flushed, and renamed into
//! place; only then is `latest` replaced (also by write-and-rename). A crash at any point
//! leaves the previous checkpoint intact and `latest` pointing at a complete directory. A step
//! saved again (a resumed run's first checkpoint) first renames its old copy aside
//! (`.aside-step-…`), removed only once the new one is in place: a crash between the two
//! renames leaves that copy, which resume takes.
//!
//! Every checkpoint ends with `checksums.json`: the XXH3-64 of each of its files, written
//! last. Resuming verifies them and passes over (with a warning) a checkpoint whose files no
//! longer match — a disk that flipped bits, a copy cut short, a file edited by hand — to the
//! newest one that is intact. (A checkpoint without the file, from before checksums, is used
//! unverified.)

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use flotilla_engine::{FlatOptimizerState, ModelState, ParamLayout, StateFile};
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
    /// A pipeline's stages as half-open layer ranges `[start, end)`; each stage has its own
    /// weight and optimizer files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stages: Option<Vec<[usize; 2]>>,
    /// A ZeRO run's optimizer state, by shard: instead of `optimizer.bpk`, each rank's
    /// state is `optimizer-shard-<r>.bpk` ([`zero_file`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zero: Option<ZeroManifest>,
    /// A pipeline whose stages' replicas shard their optimizer state (ZeRO among them): per
    /// stage, how its replicas split it (`world` the replicas, ranges in the stage's flat
    /// parameters). Stage `k`'s state is then each replica's
    /// `stage-<k>.optimizer-shard-<r>.bpk` ([`stage_zero_file`]), not one file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage_zero: Option<Vec<ZeroManifest>>,
}

/// How a ZeRO run's optimizer state is split: the world it ran on and the flat parameter
/// ranges each rank's shard holds (`shards[r]`, half-open `[start, end)`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ZeroManifest {
    /// The ZeRO stage (1 to 3).
    pub stage: u8,
    /// Number of ranks, one shard each.
    pub world: usize,
    /// Each rank's flat parameter ranges.
    pub shards: Vec<Vec<[usize; 2]>>,
}

impl ZeroManifest {
    /// Each shard's ranges.
    pub fn ranges(&self) -> Vec<Vec<std::ops::Range<usize>>> {
        (self.shards.iter())
            .map(|s| s.iter().map(|&[a, b]| a..b).collect())
            .collect()
    }
}

/// The optimizer-state file of rank `r`'s shard in a ZeRO checkpoint.
pub fn zero_file(r: usize) -> String {
    format!("optimizer-shard-{r}.bpk")
}

/// The weight and optimizer files of pipeline stage `k` in a checkpoint.
pub fn stage_files(k: usize) -> [String; 2] {
    [
        format!("stage-{k}.safetensors"),
        format!("stage-{k}.optimizer.bpk"),
    ]
}

/// The optimizer-state file of replica `r`'s shard of pipeline stage `k` in a checkpoint
/// whose stages' replicas shard it ([`CheckpointState::stage_zero`]).
pub fn stage_zero_file(k: usize, r: usize) -> String {
    format!("stage-{k}.optimizer-shard-{r}.bpk")
}

/// The files of pipeline stage `k` in a checkpoint of `state`: its weights, then its
/// optimizer state's (one file, or its replicas' shards).
pub fn stage_parts(state: &CheckpointState, k: usize) -> Vec<String> {
    let [weights, optimizer] = stage_files(k);
    let shards = state.stage_zero.as_ref().and_then(|z| z.get(k));
    match shards {
        None => vec![weights, optimizer],
        Some(m) => std::iter::once(weights)
            .chain((0..m.world).map(|r| stage_zero_file(k, r)))
            .collect(),
    }
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

/// Writes a checkpoint of `model` (its weights and optimizer state) atomically and returns
/// its directory.
pub fn save(output: &Path, model: &dyn ModelState, state: &CheckpointState) -> Result<PathBuf> {
    let state = CheckpointState {
        num_params: model.num_params(),
        ..state.clone()
    };
    save_with(output, &state, |tmp| {
        let weights = tmp.join("model.safetensors");
        model.save_weights(&weights)?;
        sync_file(&weights)?;
        write_synced(&tmp.join("optimizer.bpk"), &model.optimizer_state()?)
    })
}

/// Flushes a file written into a checkpoint in progress by other means than
/// [`write_part`] (the directory given to [`save_with`]'s writer).
pub fn sync_part(path: &Path) -> Result<()> {
    sync_file(path)
}

/// Writes a file of a checkpoint in progress (into the directory given to
/// [`save_with`]'s writer) and flushes it.
pub fn write_part(dir: &Path, name: &str, bytes: &[u8]) -> Result<()> {
    write_synced(&dir.join(name), bytes)
}

/// Writes a checkpoint atomically: `write` fills a temporary directory with the tensors,
/// then `state.json` is added and the directory renamed into place and named by `latest`.
pub fn save_with(
    output: &Path,
    state: &CheckpointState,
    write: impl FnOnce(&Path) -> Result<()>,
) -> Result<PathBuf> {
    let root = checkpoints_dir(output);
    fs::create_dir_all(&root).map_err(|e| TrainError::io(&root, e))?;
    let name = format!("step-{:08}", state.step);
    let tmp = root.join(format!(".{name}.tmp-{}", std::process::id()));
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(|e| TrainError::io(&tmp, e))?;
    }
    fs::create_dir(&tmp).map_err(|e| TrainError::io(&tmp, e))?;
    write(&tmp)?;
    let json = serde_json::to_vec_pretty(state).map_err(|e| ck_err(&tmp, e.to_string()))?;
    write_synced(&tmp.join("state.json"), &json)?;
    write_checksums(&tmp)?;

    let dest = root.join(&name);
    let aside = move_aside(&root, &name)?;
    crash_point();
    fs::rename(&tmp, &dest).map_err(|e| TrainError::io(&dest, e))?;
    if let Some(aside) = aside {
        sync_dir(&root);
        fs::remove_dir_all(&aside).map_err(|e| TrainError::io(&aside, e))?;
    }
    let latest_tmp = root.join(format!(".latest.tmp-{}", std::process::id()));
    write_synced(&latest_tmp, name.as_bytes())?;
    let latest = root.join("latest");
    fs::rename(&latest_tmp, &latest).map_err(|e| TrainError::io(&latest, e))?;
    sync_dir(&root);
    prune(&root, &name)?;
    Ok(dest)
}

/// Persists the renames in `dir` themselves; not every platform supports syncing a directory.
fn sync_dir(dir: &Path) {
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

/// The prefix of a checkpoint directory moved aside while its step is written again:
/// `.aside-step-00000468`.
const ASIDE: &str = ".aside-";

/// Makes room for checkpoint `name`: an existing one is renamed to `.aside-<name>` (and
/// returned, to be removed once the new one is in place), so that a crash between the two
/// renames leaves it whole under that name ([`newest_complete`] takes it there). An aside copy
/// that an earlier crash left behind is put back first when `name` is missing (it is the
/// newest complete copy of the step), else removed.
fn move_aside(root: &Path, name: &str) -> Result<Option<PathBuf>> {
    let (dest, aside) = (root.join(name), root.join(format!("{ASIDE}{name}")));
    if aside.exists() {
        if dest.exists() {
            fs::remove_dir_all(&aside).map_err(|e| TrainError::io(&aside, e))?;
        } else {
            fs::rename(&aside, &dest).map_err(|e| TrainError::io(&dest, e))?;
        }
    }
    if !dest.exists() {
        return Ok(None);
    }
    fs::rename(&dest, &aside).map_err(|e| TrainError::io(&aside, e))?;
    Ok(Some(aside))
}

#[cfg(test)]
thread_local! {
    /// Tests: the next save on this thread stops between its two renames, as a crash would.
    static CRASH_BETWEEN_RENAMES: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Tests: panics (a crash) where [`CRASH_BETWEEN_RENAMES`] asks; nothing otherwise.
fn crash_point() {
    #[cfg(test)]
    if CRASH_BETWEEN_RENAMES.with(|c| c.replace(false)) {
        panic!("crash between the renames");
    }
}

/// Deletes all but the newest [`KEEP`] checkpoints, never the current one (an aside copy
/// counts as its step's checkpoint; see [`step_dirs`]).
fn prune(root: &Path, current: &str) -> Result<()> {
    let dirs = step_dirs(root).map_err(|e| TrainError::io(root, e))?;
    let excess = dirs.len().saturating_sub(KEEP);
    for (_, p) in dirs.into_iter().take(excess).filter(|(n, _)| n != current) {
        fs::remove_dir_all(&p).map_err(|e| TrainError::io(&p, e))?;
    }
    Ok(())
}

/// The checkpoint directories under `root` by step name (`step-00000468`), oldest first: each
/// `step-*` directory, and an aside copy ([`move_aside`]) whose step has no directory (a
/// crash between the two renames of a save left it there).
fn step_dirs(root: &Path) -> std::io::Result<Vec<(String, PathBuf)>> {
    let names: std::collections::BTreeSet<String> = fs::read_dir(root)?
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    let mut dirs: Vec<(String, PathBuf)> = names
        .iter()
        .filter_map(|n| {
            let step = n.strip_prefix(ASIDE).unwrap_or(n);
            let own = n == step;
            (step.starts_with("step-") && (own || !names.contains(step)))
                .then(|| (step.to_owned(), root.join(n)))
        })
        .collect();
    dirs.sort();
    Ok(dirs)
}

/// The files every complete checkpoint directory holds.
const PARTS: [&str; 3] = ["model.safetensors", "optimizer.bpk", "state.json"];

/// The checksums file of a checkpoint directory.
pub const CHECKSUMS: &str = "checksums.json";

/// The checksum of `bytes` as [`CHECKSUMS`] records a file's (`xxh3_64`, in hex).
pub fn checksum_of(bytes: &[u8]) -> String {
    format!("{:016x}", xxhash_rust::xxh3::xxh3_64(bytes))
}

/// The checksum of the file at `path` (`xxh3_64`, in hex), read piece by piece: a file of
/// a large model's checkpoint (its weights, an optimizer shard) is never whole in memory.
pub(crate) fn file_checksum(path: &Path) -> std::io::Result<String> {
    let mut file = File::open(path)?;
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    let mut piece = vec![0u8; 1 << 20];
    loop {
        match std::io::Read::read(&mut file, &mut piece) {
            Ok(0) => break,
            Ok(n) => hasher.update(&piece[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(format!("{:016x}", hasher.digest()))
}

/// Writes `checksums.json`: the XXH3-64 (hex) of every other file in `dir`, by name.
fn write_checksums(dir: &Path) -> Result<()> {
    let mut sums = std::collections::BTreeMap::new();
    for entry in fs::read_dir(dir).map_err(|e| TrainError::io(dir, e))? {
        let path = entry.map_err(|e| TrainError::io(dir, e))?.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if name == CHECKSUMS || !path.is_file() {
            continue;
        }
        let sum = file_checksum(&path).map_err(|e| TrainError::io(&path, e))?;
        sums.insert(name.to_owned(), sum);
    }
    let json = serde_json::to_vec_pretty(&sums).map_err(|e| ck_err(dir, e.to_string()))?;
    write_synced(&dir.join(CHECKSUMS), &json)
}

/// Why `dir` cannot be resumed from, if it cannot: a file that does not match its checksum,
/// or a part missing (a pipeline's: every stage's files; a ZeRO run's: every shard). The
/// checksums are verified before `state.json` is read, and the stage or shard count it gives
/// is checked against the files there are before any list of them is made: a corrupt count is
/// a reason, never a huge allocation.
fn unusable(dir: &Path) -> Option<String> {
    if let Some(why) = checksum_mismatch(dir) {
        return Some(why);
    }
    // A state that does not parse is the loader's error to report (`read_state`); here it is
    // a checkpoint of the plain parts.
    let files = fs::read_dir(dir).map_or(0, |d| d.count());
    let parts = match read_state(dir).ok().map(|s| part_files(&s, files)) {
        Some(Err(why)) => return Some(why),
        Some(Ok(parts)) => parts,
        None => Vec::new(),
    };
    let common: &[&str] = if parts.is_empty() {
        &PARTS
    } else {
        &["model.safetensors", "state.json"]
    };
    let mut all = common.iter().map(|p| p.to_string()).chain(parts);
    all.find(|p| !dir.join(p).is_file())
        .map(|missing| format!("is incomplete (no {missing})"))
}

/// The files a checkpoint of `state` holds besides `model.safetensors` and `state.json`
/// (none named for one of the plain parts, [`PARTS`]), or why it cannot: its stage or shard
/// count is checked against the `files` there are before any list is made, so a corrupt
/// count is a reason, never a huge allocation.
fn part_files(state: &CheckpointState, files: usize) -> std::result::Result<Vec<String>, String> {
    let count = match (&state.stages, &state.zero, &state.stage_zero) {
        (Some(stages), _, Some(z)) if z.len() != stages.len() => {
            let (z, n) = (z.len(), stages.len());
            return Err(format!("is corrupt (state.json shards {z} stages of {n})"));
        }
        (Some(stages), _, Some(z)) => {
            (z.iter()).fold(stages.len(), |n, m| n.saturating_add(m.world))
        }
        (Some(stages), _, None) => stages.len().saturating_mul(2),
        (None, Some(z), _) => z.world,
        (None, None, _) => return Ok(Vec::new()),
    };
    if count > files {
        return Err(format!(
            "is incomplete (state.json names {count} files of stages or shards, for {files} \
             files)"
        ));
    }
    Ok(match &state.stages {
        Some(stages) => (0..stages.len())
            .flat_map(|k| stage_parts(state, k))
            .collect(),
        None => (0..count).map(zero_file).collect(),
    })
}

/// The first file of `dir` that does not match `checksums.json` (or why that file cannot be
/// read); `None` when all match or the checkpoint has no checksums.
fn checksum_mismatch(dir: &Path) -> Option<String> {
    let bytes = match fs::read(dir.join(CHECKSUMS)) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => return Some(format!("has an unreadable {CHECKSUMS}: {e}")),
    };
    let sums: std::collections::BTreeMap<String, String> = match serde_json::from_slice(&bytes) {
        Ok(s) => s,
        Err(e) => return Some(format!("has a corrupt {CHECKSUMS}: {e}")),
    };
    for (name, want) in sums {
        if name.contains('/') || name.contains("..") {
            return Some(format!("has a corrupt {CHECKSUMS} (names {name:?})"));
        }
        let got = file_checksum(&dir.join(&name));
        match got {
            Ok(got) if got == want => {}
            Ok(got) => {
                return Some(format!(
                    "is corrupt: {name} has checksum {got}, {CHECKSUMS} says {want}"
                ));
            }
            Err(e) => return Some(format!("is corrupt: {name} cannot be read ({e})")),
        }
    }
    None
}

/// The newest complete checkpoint under `output`, if any (see [`newest_complete`]).
pub fn latest(output: &Path) -> Result<Option<PathBuf>> {
    Ok(newest_complete(output)?.0)
}

/// The checkpoint to resume from, and a warning for everything passed over.
///
/// `latest` names the newest checkpoint when the last write finished. A crash can leave a
/// hidden `.step-*.tmp-*` directory (ignored), a step's old copy moved aside
/// (`.aside-step-*`, taken for its step when the step has no directory), a `latest` naming a
/// directory that is missing or incomplete, or step directories without all their files:
/// each is passed over with a warning, and the newest complete `step-*` directory is used
/// instead.
pub fn newest_complete(output: &Path) -> Result<(Option<PathBuf>, Vec<String>)> {
    let root = checkpoints_dir(output);
    let mut warnings = Vec::new();
    let pointer = root.join("latest");
    match fs::read_to_string(&pointer) {
        Ok(n) => {
            let name = n.trim();
            let valid = name.starts_with("step-") && !name.contains('/') && !name.contains("..");
            // A crash between the two renames of a save left the step's old copy aside.
            let aside = root.join(format!("{ASIDE}{name}"));
            let dir = if valid && !root.join(name).exists() && aside.is_dir() {
                aside
            } else {
                root.join(name)
            };
            let why = if valid {
                unusable(&dir)
            } else {
                Some("is not a checkpoint directory".into())
            };
            match why {
                None => return Ok((Some(dir), warnings)),
                Some(why) => warnings.push(format!(
                    "{} names {name:?}, which is not a usable checkpoint: it {why}",
                    pointer.display()
                )),
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(TrainError::io(&pointer, e)),
    }
    let mut dirs = match step_dirs(&root) {
        Ok(dirs) => dirs,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((None, warnings)),
        Err(e) => return Err(TrainError::io(&root, e)),
    };
    while let Some((_, dir)) = dirs.pop() {
        match unusable(&dir) {
            None => return Ok((Some(dir), warnings)),
            Some(why) => warnings.push(format!("{} {why}", dir.display())),
        }
    }
    Ok((None, warnings))
}

/// File `name` of checkpoint `dir`, whole.
pub(crate) fn read_file(dir: &Path, name: &str) -> Result<Vec<u8>> {
    let path = dir.join(name);
    fs::read(&path).map_err(|e| TrainError::io(&path, e))
}

/// Reads a checkpoint's state without touching any engine. Its checksum (when the checkpoint
/// has `checksums.json`) is verified before it is parsed: a corrupt file is an error.
pub fn read_state(dir: &Path) -> Result<CheckpointState> {
    let path = dir.join("state.json");
    let bytes = read_file(dir, "state.json")?;
    if let Some(want) = recorded_checksum(dir, "state.json")? {
        let got = format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&bytes));
        if got != want {
            return Err(ck_err(
                &path,
                format!("is corrupt: checksum {got}, {CHECKSUMS} says {want}"),
            ));
        }
    }
    serde_json::from_slice(&bytes).map_err(|e| ck_err(&path, e.to_string()))
}

/// The checksum `checksums.json` of `dir` records for `name`; `None` when the checkpoint has
/// no checksums (one from before them) or none for `name`.
fn recorded_checksum(dir: &Path, name: &str) -> Result<Option<String>> {
    let path = dir.join(CHECKSUMS);
    let bytes = match fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(TrainError::io(&path, e)),
    };
    let mut sums: std::collections::BTreeMap<String, String> =
        serde_json::from_slice(&bytes).map_err(|e| ck_err(&path, e.to_string()))?;
    Ok(sums.remove(name))
}

/// Loads a checkpoint's weights and optimizer state into `model` and returns its state.
/// A checkpoint of another model is an error and leaves the model unchanged.
pub fn load(dir: &Path, model: &mut dyn ModelState) -> Result<CheckpointState> {
    let state = read_state(dir)?;
    if state.num_params != model.num_params() {
        return Err(ck_err(
            dir,
            format!(
                "holds {} parameters ({}) but the model has {}",
                state.num_params,
                state.model,
                model.num_params()
            ),
        ));
    }
    let bytes = match &state.zero {
        None => {
            let optimizer = dir.join("optimizer.bpk");
            fs::read(&optimizer).map_err(|e| TrainError::io(&optimizer, e))?
        }
        Some(_) => read_flat_state(dir, &state, model.layout())?.whole(model.layout())?,
    };
    model.load_weights(&dir.join("model.safetensors"))?;
    model.load_optimizer_state(&bytes)?;
    Ok(state)
}

/// The optimizer state of the checkpoint in `dir` (whose `state.json` says `state`) over a
/// model of `layout`, in whole-model flat form: `optimizer.bpk`, or a ZeRO run's shards
/// put together by their manifest's ranges. What re-sharding cuts anew.
pub fn read_flat_state(
    dir: &Path,
    state: &CheckpointState,
    layout: &ParamLayout,
) -> Result<FlatOptimizerState> {
    match &state.zero {
        None => read_one_state(dir, "optimizer.bpk", layout),
        Some(z) => read_shards(dir, z, zero_file, layout),
    }
}

/// The optimizer state of pipeline stage `k` of the checkpoint in `dir` (whose `state.json`
/// says `state`) over the stage's `layout`, in flat form: its `stage-<k>.optimizer.bpk`, or
/// its replicas' shards put together by their manifest's ranges.
pub fn read_stage_flat_state(
    dir: &Path,
    state: &CheckpointState,
    k: usize,
    layout: &ParamLayout,
) -> Result<FlatOptimizerState> {
    match state.stage_zero.as_ref().map(|z| z.get(k)) {
        None => read_one_state(dir, &stage_files(k)[1], layout),
        Some(Some(z)) => read_shards(dir, z, |r| stage_zero_file(k, r), layout),
        Some(None) => Err(ck_err(dir, format!("its manifest has no stage {k}"))),
    }
}

/// The optimizer state file `name` of checkpoint `dir` over `layout`, in flat form.
fn read_one_state(dir: &Path, name: &str, layout: &ParamLayout) -> Result<FlatOptimizerState> {
    let bytes = read_file(dir, name)?;
    FlatOptimizerState::gather(layout, &[(None, &bytes)]).map_err(|e| ck_err(dir, e.to_string()))
}

/// The optimizer state files of the checkpoint in `dir` (whose `state.json` says `state`),
/// each with the flat ranges it was written over: its `optimizer.bpk` over the whole model,
/// or every rank's shard by its manifest. What [`flotilla_engine::ShardRecut`] reads to cut
/// one shard without the whole state.
pub fn state_files(dir: &Path, state: &CheckpointState) -> Result<Vec<StateFile>> {
    match &state.zero {
        None => Ok(vec![(None, dir.join("optimizer.bpk"))]),
        Some(z) => shard_files(dir, z, zero_file),
    }
}

/// [`state_files`] of pipeline stage `k`, over the stage's parameters.
pub fn stage_state_files(dir: &Path, state: &CheckpointState, k: usize) -> Result<Vec<StateFile>> {
    match state.stage_zero.as_ref().map(|z| z.get(k)) {
        None => Ok(vec![(None, dir.join(&stage_files(k)[1]))]),
        Some(Some(z)) => shard_files(dir, z, |r| stage_zero_file(k, r)),
        Some(None) => Err(ck_err(dir, format!("its manifest has no stage {k}"))),
    }
}

/// The files `name(r)` of checkpoint `dir` of the shards manifest `z` lays out, with their
/// ranges.
fn shard_files(
    dir: &Path,
    z: &ZeroManifest,
    name: impl Fn(usize) -> String,
) -> Result<Vec<StateFile>> {
    // Checked before the files are read: the manifest's count is only a number.
    if z.shards.len() != z.world {
        return Err(ck_err(
            dir,
            format!(
                "its manifest has {} shards for {} ranks",
                z.shards.len(),
                z.world
            ),
        ));
    }
    let ranges = z.ranges().into_iter().map(Some);
    Ok(ranges
        .enumerate()
        .map(|(r, ranges)| (ranges, dir.join(name(r))))
        .collect())
}

/// The shards of optimizer state that manifest `z` lays out, in files `name(r)` of
/// checkpoint `dir`, put together over `layout`.
fn read_shards(
    dir: &Path,
    z: &ZeroManifest,
    name: impl Fn(usize) -> String,
    layout: &ParamLayout,
) -> Result<FlatOptimizerState> {
    let files = shard_files(dir, z, name)?;
    let bytes = (files.iter())
        .map(|(_, path)| fs::read(path).map_err(|e| TrainError::io(path, e)))
        .collect::<Result<Vec<_>>>()?;
    let parts: Vec<_> = (files.iter().zip(&bytes))
        .map(|((r, _), f)| (r.as_deref(), f.as_slice()))
        .collect();
    FlatOptimizerState::gather(layout, &parts).map_err(|e| ck_err(dir, e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_checkpoint(root: &Path, name: &str, parts: &[&str]) {
        let dir = root.join(name);
        fs::create_dir_all(&dir).expect("mkdir");
        for p in parts {
            fs::write(dir.join(p), b"x").expect("write");
        }
    }

    #[test]
    fn resume_passes_over_what_a_crash_leaves_behind() {
        let out = tempfile::tempdir().expect("tempdir");
        let root = checkpoints_dir(out.path());
        assert_eq!(newest_complete(out.path()).expect("empty").0, None);
        fake_checkpoint(&root, "step-00000010", &PARTS);
        fake_checkpoint(&root, "step-00000020", &PARTS);
        // A crash during the next save: a hidden temporary directory, a step directory
        // without its optimizer state, and `latest` already naming it.
        fake_checkpoint(&root, ".step-00000040.tmp-77", &PARTS);
        fake_checkpoint(&root, "step-00000030", &["model.safetensors", "state.json"]);
        fs::write(root.join("latest"), "step-00000030").expect("latest");
        let (dir, warnings) = newest_complete(out.path()).expect("newest");
        assert_eq!(dir, Some(root.join("step-00000020")));
        assert_eq!(warnings.len(), 2, "{warnings:?}");
        assert!(warnings[0].contains("step-00000030") && warnings[0].contains("latest"));
        assert!(warnings[1].contains("step-00000030") && warnings[1].contains("incomplete"));
        // `latest` naming a complete checkpoint wins, without warnings.
        fs::write(root.join("latest"), "step-00000010").expect("latest");
        let (dir, warnings) = newest_complete(out.path()).expect("newest");
        assert_eq!(dir, Some(root.join("step-00000010")));
        assert!(warnings.is_empty());
        // A pointer outside the directory is never followed.
        fs::write(root.join("latest"), "../../etc").expect("latest");
        let (dir, warnings) = newest_complete(out.path()).expect("newest");
        assert_eq!(dir, Some(root.join("step-00000020")));
        assert_eq!(warnings.len(), 2);
    }

    fn save_fake(out: &Path, step: u64) -> Result<PathBuf> {
        save_fake_with(out, step, step as u8)
    }

    fn save_fake_with(out: &Path, step: u64, byte: u8) -> Result<PathBuf> {
        let state = CheckpointState {
            step,
            epoch: 0,
            step_in_epoch: step,
            config_hash: 1,
            model: "m".into(),
            num_params: 2,
            test_acc: None,
            stages: None,
            zero: None,
            stage_zero: None,
        };
        save_with(out, &state, |dir| {
            write_part(dir, "model.safetensors", &[byte; 64])?;
            write_part(dir, "optimizer.bpk", &[7; 16])
        })
    }

    /// A save of a step that exists already moves the old copy aside before it renames the
    /// new one in: a crash between the two renames leaves the old copy, which resume takes,
    /// and the next save of the step puts things in order.
    #[test]
    fn a_crash_while_a_step_is_saved_again_keeps_its_old_copy() -> Result<()> {
        let out = tempfile::tempdir().map_err(|e| TrainError::io(Path::new("tmp"), e))?;
        save_fake(out.path(), 10)?;
        let first = save_fake(out.path(), 20)?;
        let weights = |dir: &Path| fs::read(dir.join("model.safetensors")).ok();
        let old = weights(&first);
        CRASH_BETWEEN_RENAMES.with(|c| c.set(true));
        let crashed = std::panic::catch_unwind(|| save_fake_with(out.path(), 20, 99));
        assert!(crashed.is_err(), "the save went past the crash point");
        let (dir, _) = newest_complete(out.path())?;
        let dir = dir.expect("a checkpoint to resume from");
        assert!(
            dir.ends_with("step-00000020") || dir.ends_with(".aside-step-00000020"),
            "{dir:?}"
        );
        assert_eq!(weights(&dir), old, "resume takes step 20's old copy");
        assert_eq!(read_state(&dir)?.step, 20);
        // The next save of the step replaces it and leaves no aside copy behind.
        let again = save_fake_with(out.path(), 20, 77)?;
        assert_eq!(weights(&again), Some(vec![77; 64]));
        assert_eq!(newest_complete(out.path())?, (Some(again), vec![]));
        let names: Vec<String> = fs::read_dir(checkpoints_dir(out.path()))
            .map_err(|e| TrainError::io(out.path(), e))?
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.starts_with(ASIDE))
            .collect();
        assert!(names.is_empty(), "{names:?}");
        Ok(())
    }

    /// A `state.json` whose shard or stage count is corrupt (huge) is an error or a reason to
    /// pass the checkpoint over, with or without checksums: never a panic or an allocation of
    /// that size.
    #[test]
    fn a_corrupt_state_is_an_error_not_a_huge_allocation() -> Result<()> {
        let out = tempfile::tempdir().map_err(|e| TrainError::io(Path::new("tmp"), e))?;
        let older = save_fake(out.path(), 10)?;
        let newer = save_fake(out.path(), 20)?;
        let path = newer.join("state.json");
        let mut state = read_state(&newer)?;
        state.zero = Some(ZeroManifest {
            stage: 1,
            world: usize::MAX / 2,
            shards: vec![],
        });
        let corrupt = serde_json::to_vec(&state).map_err(|e| ck_err(&path, e.to_string()))?;
        fs::write(&path, &corrupt).map_err(|e| TrainError::io(&path, e))?;
        // With checksums: state.json no longer matches; read_state refuses to parse it.
        let e = read_state(&newer).expect_err("a corrupt state.json");
        assert!(e.to_string().contains("is corrupt: checksum"), "{e}");
        let (dir, warnings) = newest_complete(out.path())?;
        assert_eq!(dir, Some(older.clone()));
        assert!(
            warnings
                .iter()
                .any(|w| w.contains("state.json has checksum"))
        );
        // Without checksums (a checkpoint from before them): the count is checked against
        // the files there are.
        let sums = newer.join(CHECKSUMS);
        fs::remove_file(&sums).map_err(|e| TrainError::io(&sums, e))?;
        let (dir, warnings) = newest_complete(out.path())?;
        assert_eq!(dir, Some(older));
        assert!(
            warnings
                .iter()
                .any(|w| w.contains("is incomplete (state.json names")),
            "{warnings:?}"
        );
        let layout = ParamLayout::of_lengths(&[2]);
        let e = read_flat_state(&newer, &read_state(&newer)?, &layout).map(|_| ());
        assert!(e.is_err());
        Ok(())
    }

    /// A flipped byte in the newest checkpoint: resume takes the one before and says why.
    #[test]
    fn a_corrupt_checkpoint_is_passed_over_by_its_checksums() -> Result<()> {
        let out = tempfile::tempdir().map_err(|e| TrainError::io(Path::new("tmp"), e))?;
        let older = save_fake(out.path(), 10)?;
        let newer = save_fake(out.path(), 20)?;
        assert!(newer.join(CHECKSUMS).is_file());
        assert_eq!(newest_complete(out.path())?, (Some(newer.clone()), vec![]));
        let weights = newer.join("model.safetensors");
        let mut bytes = fs::read(&weights).map_err(|e| TrainError::io(&weights, e))?;
        bytes[17] ^= 0x10;
        fs::write(&weights, bytes).map_err(|e| TrainError::io(&weights, e))?;
        let (dir, warnings) = newest_complete(out.path())?;
        assert_eq!(dir, Some(older));
        assert!(
            warnings
                .iter()
                .any(|w| w.contains("is corrupt: model.safetensors has checksum")),
            "{warnings:?}"
        );
        Ok(())
    }
}
