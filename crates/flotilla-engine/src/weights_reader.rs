//! A model's weights file read one tensor at a time: the safetensors file
//! [`crate::ModelState::save_weights`] and [`crate::WeightsPlan`] write (PyTorch's shapes, a
//! linear layer's weight transposed), each tensor read from its place and given back in
//! burn's flat order, so that a process reads the pieces it needs without the whole model
//! in memory (ZeRO-3's resume: each rank reads its shard's pieces).
//!
//! Only the header is parsed up front (`serde_json`); the `safetensors` crate parses a
//! header only out of a buffer that holds the whole file.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::error::{EngineError, Result};
use crate::weights_writer::SavedTensor;

/// The largest header read (the `safetensors` crate's limit).
const MAX_HEADER: u64 = 100_000_000;

/// Where a tensor lies in the file: its shape there and its bytes after the header.
struct Place {
    shape: Vec<usize>,
    bytes: (u64, u64),
}

/// An open weights file whose tensors are read one at a time.
pub struct WeightsReader {
    file: File,
    path: PathBuf,
    /// Where the tensor data starts (after the length prefix and the header).
    data: u64,
    places: HashMap<String, Place>,
}

impl WeightsReader {
    /// Opens `path` and reads its header (the f32 tensors' names, shapes and places).
    pub fn open(path: &Path) -> Result<Self> {
        let fail = |message: String| EngineError::Checkpoint {
            path: path.to_path_buf(),
            message,
        };
        let file = File::open(path).map_err(|e| fail(e.to_string()))?;
        let mut len = [0u8; 8];
        file.read_exact_at(&mut len, 0)
            .map_err(|e| fail(e.to_string()))?;
        let n = u64::from_le_bytes(len);
        if n > MAX_HEADER {
            return Err(fail(format!("a header of {n} bytes")));
        }
        let mut header = vec![0u8; n as usize];
        file.read_exact_at(&mut header, 8)
            .map_err(|e| fail(e.to_string()))?;
        let entries: HashMap<String, serde_json::Value> =
            serde_json::from_slice(&header).map_err(|e| fail(format!("its header: {e}")))?;
        let mut places = HashMap::new();
        for (name, entry) in entries.into_iter().filter(|(n, _)| n != "__metadata__") {
            if entry.get("dtype").and_then(|d| d.as_str()) != Some("F32") {
                continue;
            }
            let numbers = |key: &str| -> Option<Vec<u64>> {
                entry
                    .get(key)?
                    .as_array()?
                    .iter()
                    .map(|v| v.as_u64())
                    .collect()
            };
            let (Some(shape), Some(offsets)) = (numbers("shape"), numbers("data_offsets")) else {
                return Err(fail(format!("a malformed entry for {name}")));
            };
            let (&[a, b], shape) = (offsets.as_slice(), shape) else {
                return Err(fail(format!("{name}'s data offsets")));
            };
            let shape = shape.into_iter().map(|d| d as usize).collect();
            places.insert(
                name,
                Place {
                    shape,
                    bytes: (a, b),
                },
            );
        }
        Ok(Self {
            file,
            path: path.to_path_buf(),
            data: 8 + n,
            places,
        })
    }

    /// Tensor `t`'s values, in burn's flat order (transposed back from PyTorch's layout when
    /// it is saved so). Refused when the file has no f32 tensor of that name and shape.
    pub fn read(&self, t: &SavedTensor) -> Result<Vec<f32>> {
        let fail = |message: String| EngineError::Checkpoint {
            path: self.path.clone(),
            message,
        };
        let place = (self.places.get(&t.name)).ok_or_else(|| fail(format!("no f32 {}", t.name)))?;
        let saved: Vec<usize> = match (t.transposed, t.shape.as_slice()) {
            (true, &[rows, cols]) => vec![cols, rows],
            _ => t.shape.clone(),
        };
        let len: usize = saved.iter().product();
        let (a, b) = place.bytes;
        if place.shape != saved || b.checked_sub(a) != Some(4 * len as u64) {
            return Err(fail(format!(
                "{} is {:?} in {} bytes, the model's {saved:?}",
                t.name,
                place.shape,
                b.saturating_sub(a)
            )));
        }
        let mut bytes = vec![0u8; 4 * len];
        self.file
            .read_exact_at(&mut bytes, self.data + a)
            .map_err(|e| fail(e.to_string()))?;
        let values: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        Ok(match (t.transposed, t.shape.as_slice()) {
            (true, &[rows, cols]) => {
                let mut burn = vec![0.0; len];
                for j in 0..cols {
                    for i in 0..rows {
                        burn[i * cols + j] = values[j * rows + i];
                    }
                }
                burn
            }
            _ => values,
        })
    }
}
