//! The whole model's parameters written to a file a program names ([`crate::run::Run::save_model`]):
//! safetensors under the model's own names, the file a checkpoint holds as
//! `model.safetensors`, written atomically; and such a file's tensors handed out or read a
//! piece at a time, for the sharded writers and readers of ZeRO-3.

use std::fs;
use std::path::{Path, PathBuf};

use flotilla_engine::{
    ModelState, ParamLayout, SavedTensor, ShardPiece, WeightsPlan, WeightsReader,
};

use crate::error::{Result, TrainError};

/// Writes the file at `path` atomically: `write` fills a temporary file beside it (the same
/// directory, so the rename stays on one file system), which is flushed and renamed into
/// place; a failed write leaves `path` as it was and no temporary file. Returns `path`.
pub fn write(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<PathBuf> {
    let name = path.file_name().ok_or_else(|| {
        TrainError::config("model file", format!("{} names no file", path.display()))
    })?;
    let parent = match path.parent() {
        Some(p) if p.as_os_str().is_empty() => Path::new("."),
        Some(p) => p,
        None => Path::new("/"),
    };
    if !parent.is_dir() {
        return Err(TrainError::config(
            "model file",
            format!(
                "{}: {} is not a directory",
                path.display(),
                parent.display()
            ),
        ));
    }
    let tmp = path.with_file_name(format!(
        ".{}.tmp-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let written = write(&tmp).and_then(|()| {
        fs::File::open(&tmp)
            .and_then(|f| f.sync_all())
            .map_err(|e| TrainError::io(&tmp, e))?;
        fs::rename(&tmp, path).map_err(|e| TrainError::io(path, e))
    });
    if written.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    written.map(|()| path.to_path_buf())
}

/// Hands `write` each of `model`'s buffers (held whole by every rank, never released) as a
/// tensor of its weights file: tensor `params.len() + j` of its `WeightsPlan` is buffer
/// `j`, after the parameters. Free without buffers.
pub(crate) fn each_buffer_tensor(
    model: &dyn ModelState,
    write: &mut dyn FnMut(usize, &[f32]) -> Result<()>,
) -> Result<()> {
    let layout = model.buffer_layout();
    if layout.total == 0 {
        return Ok(());
    }
    let mut values = vec![0.0; layout.total];
    model.read_buffers(&mut values)?;
    let first = model.layout().params.len();
    for (j, b) in layout.params.iter().enumerate() {
        write(first + j, &values[b.offset..b.offset + b.len])?;
    }
    Ok(())
}

/// The values of `pieces` (in flat order) read from `reader`, one tensor at a time.
pub(crate) fn shard_values(
    reader: &WeightsReader,
    weights: &WeightsPlan,
    layout: &ParamLayout,
    pieces: &[ShardPiece],
) -> Result<Vec<f32>> {
    let mut out = Vec::with_capacity(pieces.iter().map(|p| p.range.len()).sum());
    let mut held: Option<(usize, Vec<f32>)> = None;
    for piece in pieces {
        if held.as_ref().map(|h| h.0) != Some(piece.param) {
            held = Some((piece.param, reader.read(tensor(weights, piece.param)?)?));
        }
        let tensor = held.as_ref().map_or(&[][..], |h| &h.1[..]);
        let base = layout.params[piece.param].offset;
        let range = piece.range.start - base..piece.range.end - base;
        out.extend_from_slice(tensor.get(range).ok_or_else(|| {
            TrainError::Divergence(format!("a piece past parameter {}", piece.param))
        })?);
    }
    Ok(out)
}

/// The running statistics read from `reader`: the weights file's tensors after the
/// parameters, in the buffers' flat order.
pub(crate) fn buffer_values(
    reader: &WeightsReader,
    weights: &WeightsPlan,
    layout: &ParamLayout,
) -> Result<Vec<f32>> {
    let mut out = Vec::new();
    for j in layout.params.len()..weights.tensors().len() {
        out.extend(reader.read(tensor(weights, j)?)?);
    }
    Ok(out)
}

/// Tensor `j` of the weights file.
fn tensor(weights: &WeightsPlan, j: usize) -> Result<&SavedTensor> {
    let detail = format!("no tensor {j} in the weights file's plan");
    weights
        .tensors()
        .get(j)
        .ok_or(TrainError::Divergence(detail))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_appears_whole_or_not_at_all() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("model.safetensors");
        fs::write(&path, b"old").expect("write");
        let failed = write(&path, |tmp| {
            fs::write(tmp, b"half").map_err(|e| TrainError::io(tmp, e))?;
            Err(TrainError::config("test", "failed midway".to_string()))
        });
        assert!(failed.is_err());
        assert_eq!(fs::read(&path).expect("read"), b"old");
        let left: Vec<_> = fs::read_dir(dir.path()).expect("dir").collect();
        assert_eq!(left.len(), 1, "the temporary file is removed");
        let done = write(&path, |tmp| {
            fs::write(tmp, b"new").map_err(|e| TrainError::io(tmp, e))
        });
        assert_eq!(done.expect("written"), path);
        assert_eq!(fs::read(&path).expect("read"), b"new");
        assert_eq!(fs::read_dir(dir.path()).expect("dir").count(), 1);
    }

    #[test]
    fn a_path_without_a_file_name_or_its_directory_is_refused_before_writing() {
        assert!(write(Path::new("/"), |_| Ok(())).is_err());
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("absent/model.safetensors");
        let refused = write(&path, |_| panic!("written without a directory"));
        let message = refused.expect_err("refused").to_string();
        assert!(message.contains("is not a directory"), "{message}");
    }
}
