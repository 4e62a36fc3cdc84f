//! A pipeline checkpoint loaded at another cut (S stages written, S′ read): rank 0 builds
//! the new stages' files from the old ones. The weights come from the checkpoint's merged
//! `model.safetensors` (a spec's stages have disjoint tensor names: the whole model's); the
//! optimizer state is taken apart per old stage ([`FlatOptimizerState`], over each old
//! stage's own layout), joined in the model's order of tensors and cut again by the new
//! stages' — the same bits, re-keyed. One stage is built at a time (for its layout and
//! names), never the whole model. A program's stage modules cannot be re-cut (their
//! tensors are the program's, per module): resume them with the same cut.

use std::ops::Range;
use std::path::Path;

use flotilla_engine::{
    FlatOptimizerState, ModelSpec, ModelState, OptimizerSpec, Stage, StageCut, StageEngine,
};
use safetensors::SafeTensors;
use safetensors::tensor::TensorView;

use crate::checkpoint::{self, CheckpointState};
use crate::error::{Result, TrainError};

/// A stage's weights (safetensors bytes) and optimizer state, as the stage files hold them.
pub(super) type StageParts = [Vec<u8>; 2];

fn error(dir: &Path, message: impl Into<String>) -> TrainError {
    TrainError::Checkpoint {
        path: dir.to_path_buf(),
        message: message.into(),
    }
}

fn read(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| TrainError::io(path, e))
}

/// The stage parts of checkpoint `dir` (whose `state.json` says `state`: written by a
/// pipeline of stages `old`) for a pipeline of stages `new` (layer ranges of the same
/// model).
pub(super) fn recut(
    dir: &Path,
    (state, old): (&CheckpointState, &[[usize; 2]]),
    new: &[Range<usize>],
) -> Result<Vec<StageParts>> {
    let merged = read(&dir.join("model.safetensors"))?;
    let spec = spec_of(dir, &merged)?;
    let old: Vec<Range<usize>> = old.iter().map(|&[a, b]| a..b).collect();
    let (old_cut, new_cut) = (
        StageCut::new(&spec, old)?,
        StageCut::new(&spec, new.to_vec())?,
    );
    let mut names = Vec::new();
    let mut flats = Vec::new();
    for k in 0..old_cut.stages() {
        let stage = build(&spec, &old_cut, k)?;
        flats.push(checkpoint::read_stage_flat_state(
            dir,
            state,
            k,
            stage.layout(),
        )?);
        names.extend(stage.layout().params.iter().map(|p| p.name.clone()));
    }
    let whole = FlatOptimizerState::concat(flats);
    let weights = SafeTensors::deserialize(&merged)
        .map_err(|e| error(dir, format!("model.safetensors: {e}")))?;
    let mut parts = Vec::with_capacity(new_cut.stages());
    let mut at = 0;
    for j in 0..new_cut.stages() {
        let stage = build(&spec, &new_cut, j)?;
        let layout = stage.layout();
        let params = at..at + layout.params.len();
        let theirs = names.get(params.clone()).unwrap_or_default();
        if layout.params.iter().map(|p| &p.name).ne(theirs.iter()) {
            return Err(error(
                dir,
                format!("stage {j} of the new cut does not hold the old stages' tensors in order"),
            ));
        }
        let state = whole
            .select(params)
            .ok_or_else(|| error(dir, format!("no optimizer state for stage {j}")))?;
        parts.push([stage_weights(dir, &*stage, &weights)?, state.whole(layout)?]);
        at += layout.params.len();
    }
    if at != whole.len() {
        return Err(error(
            dir,
            "the new cut does not hold every tensor of the old one",
        ));
    }
    Ok(parts)
}

/// The model the checkpoint's weights were written for (a spec's, in their metadata).
fn spec_of(dir: &Path, merged: &[u8]) -> Result<ModelSpec> {
    let (_, header) = SafeTensors::read_metadata(merged)
        .map_err(|e| error(dir, format!("model.safetensors: {e}")))?;
    let yaml = header
        .metadata()
        .as_ref()
        .and_then(|m| m.get("flotilla.model"))
        .ok_or_else(|| {
            error(
                dir,
                "was written by a program's stage modules, whose tensors only the program \
                 knows: resume with the same cut",
            )
        })?;
    Ok(ModelSpec::from_yaml(yaml, "the checkpoint's model")?)
}

/// Stage `k` of `cut`, built on the CPU for its layout and tensor names.
fn build(spec: &ModelSpec, cut: &StageCut, k: usize) -> Result<Box<dyn StageEngine>> {
    Ok(Box::new(Stage::new(
        spec,
        cut,
        k,
        &OptimizerSpec::default(),
        "flex",
        0,
    )?))
}

/// The weights file of `stage` with the values of the checkpoint's `weights` (its own
/// tensors, by name, and its metadata).
fn stage_weights(dir: &Path, stage: &dyn ModelState, weights: &SafeTensors<'_>) -> Result<Vec<u8>> {
    let own = stage.weights_bytes()?;
    let (_, header) = SafeTensors::read_metadata(&own).map_err(|e| error(dir, e.to_string()))?;
    let mine = SafeTensors::deserialize(&own).map_err(|e| error(dir, e.to_string()))?;
    let mut views: Vec<(String, TensorView<'_>)> = Vec::new();
    for (name, _) in mine.tensors() {
        let view = weights
            .tensor(&name)
            .map_err(|e| error(dir, format!("model.safetensors has no {name}: {e}")))?;
        views.push((name, view));
    }
    safetensors::serialize(views, header.metadata().clone())
        .map_err(|e| error(dir, format!("stage weights: {e}")))
}
