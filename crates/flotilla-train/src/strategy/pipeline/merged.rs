//! The whole model's weights file of a pipeline (a checkpoint's `model.safetensors`, the
//! model a run saves), laid out from its stages' safetensors headers alone, so that each
//! stage's tensors can be written at their place by whoever holds them, in any order, and
//! no process holds every stage at once.
//!
//! The file holds stage 0's tensors, then stage 1's, and so on, each stage's in the order of
//! its own file: a stage's data is one block, its own file's data bytes as they are. Its
//! metadata is stage 0's but for the stage entry. A spec's stages have disjoint tensor names
//! (the whole model's); a program's stage modules may share one (`conv.weight` in two
//! stages), and then every tensor is named `stage<k>.<name>` after its stage. Written by
//! hand because the `safetensors` crate serializes from tensors that are all in memory.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use serde_json::{Map, Value};

use crate::error::{Result, TrainError};

/// The layout of a pipeline's merged weights file: its header and where each stage's block
/// lies.
#[derive(Debug, Clone)]
pub(super) struct MergedWeights {
    /// The length prefix and the JSON header, padded to 8 bytes.
    header: Vec<u8>,
    /// Each stage's block: its first byte in the file and its length.
    blocks: Vec<(u64, u64)>,
    /// Number of values over every tensor.
    values: usize,
}

/// One tensor of a stage's file, as its header gives it.
struct Entry {
    name: String,
    info: Map<String, Value>,
    offsets: (u64, u64),
}

fn error(out: &Path, message: impl Into<String>) -> TrainError {
    TrainError::Checkpoint {
        path: out.to_path_buf(),
        message: message.into(),
    }
}

/// The length prefix and JSON header of a safetensors file's `bytes`.
pub(super) fn header_of<'a>(bytes: &'a [u8], out: &Path) -> Result<&'a [u8]> {
    let n = bytes
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0xff; 8])))
        .ok_or_else(|| error(out, "a stage's weights have no header"))?;
    usize::try_from(n)
        .ok()
        .and_then(|n| n.checked_add(8))
        .and_then(|end| bytes.get(..end))
        .ok_or_else(|| error(out, format!("a stage's weights header of {n} bytes is cut")))
}

/// The tensor data of a safetensors file's `bytes` (after [`header_of`]).
pub(super) fn data_of<'a>(bytes: &'a [u8], out: &Path) -> Result<&'a [u8]> {
    Ok(&bytes[header_of(bytes, out)?.len()..])
}

/// The tensors and metadata of a header ([`header_of`]; `what` names its file in errors),
/// in data order, and its data's length; checked to cover the data without gap or overlap.
fn entries(what: &str, header: &[u8], out: &Path) -> Result<(Vec<Entry>, Map<String, Value>, u64)> {
    let bad = |m: String| error(out, format!("{what}: {m}"));
    let json: Map<String, Value> = header
        .get(8..)
        .and_then(|text| serde_json::from_slice(text).ok())
        .ok_or_else(|| bad("the header is not a JSON object".into()))?;
    let mut metadata = Map::new();
    let mut list = Vec::new();
    for (name, v) in json {
        let Value::Object(info) = v else {
            return Err(bad(format!("{name} is not a tensor")));
        };
        if name == "__metadata__" {
            metadata = info;
            continue;
        }
        let offsets = info
            .get("data_offsets")
            .and_then(Value::as_array)
            .and_then(|o| Some((o.first()?.as_u64()?, o.get(1)?.as_u64()?)))
            .ok_or_else(|| bad(format!("{name} has no data offsets")))?;
        list.push(Entry {
            name,
            info,
            offsets,
        });
    }
    list.sort_by_key(|e| e.offsets);
    let mut end = 0;
    for e in &list {
        if e.offsets.0 != end || e.offsets.1 < e.offsets.0 {
            return Err(bad(format!("{}'s data is not where it should be", e.name)));
        }
        end = e.offsets.1;
    }
    Ok((list, metadata, end))
}

/// Each tensor of a safetensors file's `header` ([`header_of`]) by name: its bytes' place
/// in the data (start and end); checked to cover the data without gap or overlap.
pub(super) fn tensor_places(
    header: &[u8],
    out: &Path,
) -> Result<std::collections::HashMap<String, (u64, u64)>> {
    let (list, _, _) = entries("the weights", header, out)?;
    Ok(list.into_iter().map(|e| (e.name, e.offsets)).collect())
}

/// The number of values of a tensor in a header.
fn values_of(info: &Map<String, Value>) -> usize {
    info.get("shape").and_then(Value::as_array).map_or(0, |s| {
        s.iter().filter_map(Value::as_u64).product::<u64>() as usize
    })
}

impl MergedWeights {
    /// The layout of the merged file of stages whose files have `headers` ([`header_of`]);
    /// `out` names the file in errors.
    pub(super) fn new(headers: &[&[u8]], out: &Path) -> Result<Self> {
        let mut stages = Vec::with_capacity(headers.len());
        for (k, h) in headers.iter().enumerate() {
            stages.push(entries(&format!("stage {k}'s weights"), h, out)?);
        }
        let mut seen = std::collections::HashSet::new();
        let shared = stages
            .iter()
            .flat_map(|s| &s.0)
            .any(|e| !seen.insert(e.name.as_str()));
        let mut metadata = stages.first().map(|s| s.1.clone()).unwrap_or_default();
        metadata.remove("flotilla.stage");
        let mut json = Map::new();
        json.insert("__metadata__".into(), Value::Object(metadata));
        let (mut at, mut values, mut spans) = (0u64, 0usize, Vec::new());
        for (k, (list, _, len)) in stages.into_iter().enumerate() {
            for Entry {
                name,
                mut info,
                offsets: (s, e),
            } in list
            {
                values += values_of(&info);
                info.insert("data_offsets".into(), serde_json::json!([at + s, at + e]));
                let name = if shared {
                    format!("stage{k}.{name}")
                } else {
                    name
                };
                json.insert(name, Value::Object(info));
            }
            spans.push((at, len));
            at += len;
        }
        let mut text = Value::Object(json).to_string().into_bytes();
        // The data starts 8-byte aligned, as the safetensors crate writes it.
        text.resize(text.len().next_multiple_of(8), b' ');
        let data = 8 + text.len() as u64;
        let mut header = (text.len() as u64).to_le_bytes().to_vec();
        header.extend_from_slice(&text);
        let blocks = spans.into_iter().map(|(s, len)| (data + s, len)).collect();
        Ok(Self {
            header,
            blocks,
            values,
        })
    }

    /// The number of values over every tensor (the model's parameters).
    pub(super) fn values(&self) -> usize {
        self.values
    }

    /// Stage `k`'s block: its first byte in the file and its length (`out` names the file
    /// in the error of a stage it has no block for).
    pub(super) fn block(&self, k: usize, out: &Path) -> Result<(u64, u64)> {
        self.blocks.get(k).copied().ok_or_else(|| {
            let n = self.blocks.len();
            error(
                out,
                format!("no block for stage {k} in the merged weights of {n}"),
            )
        })
    }

    /// Creates `path` with the header, at its whole length (the data zero until written).
    pub(super) fn create(&self, path: &Path) -> Result<File> {
        let file = File::create(path).map_err(|e| TrainError::io(path, e))?;
        file.write_all_at(&self.header, 0)
            .map_err(|e| TrainError::io(path, e))?;
        let len = self
            .blocks
            .last()
            .map_or(self.header.len() as u64, |b| b.0 + b.1);
        file.set_len(len).map_err(|e| TrainError::io(path, e))?;
        Ok(file)
    }
}

/// Writes a stage's `data` ([`data_of`] its own file) into its `block`
/// ([`MergedWeights::block`]) of the merged file `path`, made by [`MergedWeights::create`].
pub(super) fn write_block(path: &Path, (base, len): (u64, u64), data: &[u8]) -> Result<()> {
    if data.len() as u64 != len {
        let message = format!(
            "a stage's {} bytes of weights for a block of {len}",
            data.len()
        );
        return Err(error(path, message));
    }
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(|e| TrainError::io(path, e))?;
    file.write_all_at(data, base)
        .and_then(|()| file.sync_all())
        .map_err(|e| TrainError::io(path, e))
}

#[cfg(test)]
#[path = "merged_tests.rs"]
mod tests;
