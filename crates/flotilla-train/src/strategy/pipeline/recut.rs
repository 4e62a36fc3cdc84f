//! A pipeline checkpoint loaded at another cut (S stages written, S′ read), one new stage at
//! a time ([`Recut::stage`]), by the rank that runs it where it sees the checkpoint (else by
//! rank 0 for it: `restore.rs`). The weights come from the checkpoint's merged
//! `model.safetensors` (a spec's stages have disjoint tensor names: the whole model's), each
//! tensor's bytes read from its place; the optimizer state is taken apart per old stage
//! ([`FlatOptimizerState`], over each old stage's own layout, from its file or its replicas'
//! shards), the old stages the new one overlaps joined in the model's order of tensors and
//! cut again — the same bits, re-keyed; under ZeRO among the new stage's replicas, a
//! replica's shard alone is cut out of the old stages' state files, reading only what meets
//! it ([`Recut::stage_shard`], [`flotilla_engine::Remap`]). No rank reads more than the old
//! stages its new one overlaps. The stages are built for their layouts and names only,
//! released (their values drawn one layer at a time and let go): a new stage's weights file
//! is written into a scratch directory under the job's output directory, tensor by tensor
//! from the merged file at the places its plan gives ([`flotilla_engine::WeightsPlan`]), so a
//! ZeRO-3 replica reads its pieces there and no rank holds a stage's values whole. A
//! program's stage modules cannot be re-cut (their tensors are the program's, per module):
//! resume them with the same cut.

use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use flotilla_engine::{
    FlatOptimizerState, ModelSpec, ModelState, OptimizerSpec, ParamLayout, Remap, ShardRecut,
    ShardSink, Stage, StageCut,
};
use tempfile::TempDir;

use crate::checkpoint::{self, CheckpointState};
use crate::checkpoint_offer::scratch_dir;
use crate::error::{Result, TrainError};
use crate::strategy::pipeline::merged;

/// A stage's weights (safetensors bytes) and optimizer state, as the stage files hold them.
pub(super) type StageParts = [Vec<u8>; 2];

fn error(dir: &Path, message: impl Into<String>) -> TrainError {
    TrainError::Checkpoint {
        path: dir.to_path_buf(),
        message: message.into(),
    }
}

/// A checkpoint written at another cut, to be re-cut one new stage at a time.
pub(super) struct Recut {
    dir: PathBuf,
    state: CheckpointState,
    spec: ModelSpec,
    new_cut: StageCut,
    /// Each old stage's layout (its tensors' names and shapes, in order).
    old: Vec<ParamLayout>,
    /// Where each new stage's tensors start in the model's order, and the end.
    starts: Vec<usize>,
    /// Where the new stages' weights files are written (removed with it).
    scratch: TempDir,
}

impl Recut {
    /// Checkpoint `dir` (whose `state.json` says `state`, with its cut) for a pipeline of
    /// stages `new` (layer ranges of the same model): the old and new stages' layouts,
    /// built one stage at a time, checked to hold the same tensors. The new stages' weights
    /// files go to a scratch directory under `output`.
    pub(super) fn open(
        dir: &Path,
        state: &CheckpointState,
        new: &[Range<usize>],
        output: &Path,
    ) -> Result<Self> {
        let spec = spec_of(dir, &read_header(&dir.join("model.safetensors"))?)?;
        let (old_cut, new_cut) = (
            recorded_cut(&spec, state)?,
            StageCut::new(&spec, new.to_vec())?,
        );
        let old = (0..old_cut.stages())
            .map(|k| Ok(build(&spec, &old_cut, k)?.layout().clone()))
            .collect::<Result<Vec<_>>>()?;
        let mut starts = vec![0];
        for j in 0..new_cut.stages() {
            let n = build(&spec, &new_cut, j)?.layout().params.len();
            starts.push(starts[j] + n);
        }
        if starts.last() != Some(&old.iter().map(|l| l.params.len()).sum()) {
            return Err(error(
                dir,
                "the new cut does not hold every tensor of the old one",
            ));
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            state: state.clone(),
            spec,
            new_cut,
            old,
            starts,
            scratch: scratch_dir(output, ".recut-")?,
        })
    }

    /// New stage `j`'s weights and optimizer state as the stage files hold them
    /// ([`Recut::stage_flat`]'s, the state serialized).
    pub(super) fn stage(&self, j: usize) -> Result<StageParts> {
        let (weights, state, layout) = self.stage_flat(j)?;
        Ok([weights, state.whole(&layout)?])
    }

    /// New stage `j`'s weights file, optimizer state in flat form (to load without
    /// serializing it) and layout, from the old stages it overlaps: each old stage's state
    /// read and cut to the new stage's tensors before the next is read.
    pub(super) fn stage_flat(
        &self,
        j: usize,
    ) -> Result<(Vec<u8>, FlatOptimizerState, ParamLayout)> {
        let (layout, path) = self.new_stage(j)?;
        let weights = std::fs::read(&path).map_err(|e| TrainError::io(&path, e))?;
        std::fs::remove_file(&path).map_err(|e| TrainError::io(&path, e))?;
        let mut parts = Vec::new();
        for (k, mine, _) in self.overlapping(j) {
            let flat = checkpoint::read_stage_flat_state(&self.dir, &self.state, k, &self.old[k])?;
            let part = flat.select(mine).ok_or_else(|| {
                error(
                    &self.dir,
                    format!("stage {k}'s optimizer state has fewer tensors"),
                )
            })?;
            parts.push(part);
        }
        Ok((weights, FlatOptimizerState::concat(parts), layout))
    }

    /// The path of new stage `j`'s weights file (in the scratch directory, as long as this
    /// lives) and a replica's shard of its optimizer state (over its flat ranges `owned` of
    /// the stage), cut out of the state files of the old stages it overlaps, reading only
    /// what meets the shard: no replica (nor rank 0 for one) holds its new stage's whole
    /// state.
    pub(super) fn stage_shard(
        &self,
        j: usize,
        owned: &[Range<usize>],
    ) -> Result<(PathBuf, Vec<u8>)> {
        let (layout, weights_file) = self.new_stage(j)?;
        let mut recut = ShardRecut::new(&layout, owned)?;
        for (k, _, shift) in self.overlapping(j) {
            let remap = Remap {
                layout: &self.old[k],
                shift,
            };
            for (ranges, path) in checkpoint::stage_state_files(&self.dir, &self.state, k)? {
                recut.read_file_of(Some(&remap), ranges.as_deref(), &path)?;
            }
        }
        Ok((weights_file, recut.finish()?))
    }

    /// New stage `j`'s layout and the path of its weights file, written into the scratch
    /// directory (the stage built released for them and let go), checked to hold the old
    /// stages' tensors in order.
    fn new_stage(&self, j: usize) -> Result<(ParamLayout, PathBuf)> {
        let path = self.scratch.path().join(format!("stage-{j}.safetensors"));
        let layout = {
            let stage = build(&self.spec, &self.new_cut, j)?;
            write_stage_weights(&self.dir, &stage, &path)?;
            stage.layout().clone()
        };
        let names = (self.overlapping(j))
            .flat_map(|(k, mine, _)| self.old[k].params[mine].iter().map(|p| &p.name));
        if layout.params.iter().map(|p| &p.name).ne(names) {
            return Err(error(
                &self.dir,
                format!("stage {j} of the new cut does not hold the old stages' tensors in order"),
            ));
        }
        Ok((layout, path))
    }

    /// The old stages new stage `j` overlaps: each one's index, the range of its tensors the
    /// new stage holds, and where its tensors are among the new stage's (old tensor `i` is
    /// new tensor `i + shift`).
    fn overlapping(&self, j: usize) -> impl Iterator<Item = (usize, Range<usize>, isize)> + '_ {
        let want = self.starts[j]..self.starts[j + 1];
        let mut at = 0;
        (self.old.iter().enumerate()).filter_map(move |(k, old)| {
            let held = at..at + old.params.len();
            at = held.end;
            if held.start >= want.end || want.start >= held.end {
                return None;
            }
            let mine = want.start.max(held.start) - held.start..want.end.min(held.end) - held.start;
            Some((k, mine, held.start as isize - want.start as isize))
        })
    }
}

/// The optimizer state of pipeline checkpoint `dir` (whose `state.json` says `state`) over
/// the whole model `spec` in flat form, its stages' (their files or their replicas' shards)
/// joined in the model's order of tensors, with their names in that order (for a layout of
/// the whole model to check against).
pub(crate) fn model_flat_state(
    dir: &Path,
    state: &CheckpointState,
    spec: &ModelSpec,
) -> Result<(FlatOptimizerState, Vec<String>)> {
    let cut = recorded_cut(spec, state)?;
    let (mut flats, mut names) = (Vec::new(), Vec::new());
    for k in 0..cut.stages() {
        let stage = build(spec, &cut, k)?;
        let layout = stage.layout();
        flats.push(checkpoint::read_stage_flat_state(dir, state, k, layout)?);
        names.extend(layout.params.iter().map(|p| p.name.clone()));
    }
    Ok((FlatOptimizerState::concat(flats), names))
}

/// The cut of `spec` a checkpoint of `state` was written at.
fn recorded_cut(spec: &ModelSpec, state: &CheckpointState) -> Result<StageCut> {
    let recorded = state.stages.as_deref().unwrap_or_default();
    Ok(StageCut::new(
        spec,
        recorded.iter().map(|&[a, b]| a..b).collect(),
    )?)
}

/// The length prefix and JSON header of the safetensors file at `path`, read alone.
fn read_header(path: &Path) -> Result<Vec<u8>> {
    let file = std::fs::File::open(path).map_err(|e| TrainError::io(path, e))?;
    let mut len = [0u8; 8];
    file.read_exact_at(&mut len, 0)
        .map_err(|e| TrainError::io(path, e))?;
    let n = usize::try_from(u64::from_le_bytes(len))
        .ok()
        .filter(|&n| n as u64 <= file.metadata().map_or(0, |m| m.len()))
        .ok_or_else(|| error(path, "its header's length is past its end"))?;
    let mut header = vec![0u8; 8 + n];
    file.read_exact_at(&mut header, 0)
        .map_err(|e| TrainError::io(path, e))?;
    Ok(header)
}

/// The model the checkpoint's weights were written for (a spec's, in their `header`'s
/// metadata).
fn spec_of(dir: &Path, header: &[u8]) -> Result<ModelSpec> {
    let json: serde_json::Value = header
        .get(8..)
        .and_then(|text| serde_json::from_slice(text).ok())
        .ok_or_else(|| error(dir, "model.safetensors: the header is not JSON"))?;
    let yaml = json["__metadata__"]["flotilla.model"]
        .as_str()
        .ok_or_else(|| {
            error(
                dir,
                "was written by a program's stage modules, whose tensors only the program \
             knows: resume with the same cut",
            )
        })?;
    Ok(ModelSpec::from_yaml(yaml, "the checkpoint's model")?)
}

/// Stage `k` of `cut`, built on the CPU for its layout, tensor names and weights file's
/// plan, released: each layer's values drawn in turn and let go ([`Discard`]).
fn build(spec: &ModelSpec, cut: &StageCut, k: usize) -> Result<Stage> {
    let optimizer = OptimizerSpec::default();
    Ok(Stage::new_released(
        spec,
        (cut, k),
        &optimizer,
        ("flex", 0),
        0,
        &mut Discard,
    )?)
}

/// A [`ShardSink`] that keeps nothing: a stage built for its layout alone.
struct Discard;

impl ShardSink for Discard {
    fn plan(&mut self, _: &ParamLayout, _: &[Range<usize>]) -> flotilla_engine::Result<()> {
        Ok(())
    }

    fn values(&mut self, _: usize, _: &[f32]) -> flotilla_engine::Result<()> {
        Ok(())
    }
}

/// Writes the weights file of `stage` (its own tensors' names, shapes and metadata) at
/// `path`, each tensor's bytes copied from its place in the checkpoint `dir`'s merged
/// `model.safetensors` to its place in the file, one tensor at a time.
fn write_stage_weights(dir: &Path, stage: &Stage, path: &Path) -> Result<()> {
    let merged = dir.join("model.safetensors");
    let header = read_header(&merged)?;
    let theirs = merged::tensor_places(&header, &merged)?;
    let plan = stage.weights_plan()?;
    let from = std::fs::File::open(&merged).map_err(|e| TrainError::io(&merged, e))?;
    let to = plan.create(path)?;
    let mut bytes = Vec::new();
    for (i, t) in plan.tensors().iter().enumerate() {
        let place = plan.place(i).unwrap_or_default();
        let len = place.end - place.start;
        let &(a, _) = (theirs.get(&t.name))
            .filter(|(a, b)| b - a == len)
            .ok_or_else(|| {
                error(
                    dir,
                    format!("model.safetensors has no {} of its size", t.name),
                )
            })?;
        bytes.resize(len as usize, 0);
        from.read_exact_at(&mut bytes, header.len() as u64 + a)
            .map_err(|e| TrainError::io(&merged, e))?;
        to.write_all_at(&bytes, place.start)
            .map_err(|e| TrainError::io(path, e))?;
    }
    Ok(())
}
