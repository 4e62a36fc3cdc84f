//! A model's weights file written piece by piece: the safetensors file
//! [`crate::ModelState::save_weights`] writes (burn's `SafetensorsStore` through its PyTorch
//! adapter: the same names, PyTorch's shapes, a linear layer's weight transposed, burn's
//! metadata), from values handed over one tensor at a time, so that no process holds the
//! whole model to write it (ZeRO-3's checkpoints: the parameters are gathered one backward
//! group at a time).
//!
//! The header is written first, from the layout alone (every tensor's name, shape and
//! length are known before any value, [`WeightsPlan`]: the parameters, then batch norm's
//! running statistics, which every rank holds whole); then each tensor's values at their
//! place, in any order and by any rank that has them. Written by
//! hand because burn's store and the `safetensors` crate both serialize from tensors that
//! are all in memory at once.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use burn::module::{Module, ModuleVisitor, Param};
use burn::prelude::*;
use burn::store::SafetensorsStore;

use crate::buffers::{Only, Tensors};
use crate::error::{EngineError, Result};
use crate::params::ParamLayout;

/// One tensor of a weights file: its name, burn's shape and whether PyTorch's layout is its
/// transpose (a linear layer's weight).
#[derive(Debug, Clone, PartialEq)]
pub struct SavedTensor {
    /// The name it is saved under.
    pub name: String,
    /// Its shape in burn's layout (the flat buffers').
    pub shape: Vec<usize>,
    /// Whether it is saved transposed (PyTorch's `[out, in]` of burn's `[in, out]`).
    pub transposed: bool,
}

/// The tensors `model`'s weights file holds, in flat order (`layout`: its parameters').
/// Reads the module's structure only: the parameters may be released.
pub(crate) fn saved_tensors<M: Module>(model: &M, layout: &ParamLayout) -> Vec<SavedTensor> {
    /// The module type of each parameter: the innermost struct or enum around it, as burn's
    /// adapters read it (collections looked past).
    struct Types {
        stack: Vec<String>,
        types: Vec<bool>,
    }
    impl ModuleVisitor for Types {
        fn enter_module(&mut self, _name: &str, container_type: &str) {
            self.stack.push(container_type.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.stack.pop();
        }
        fn visit_float<const D: usize>(&mut self, _param: &Param<Tensor<D>>) {
            let module = self
                .stack
                .iter()
                .rev()
                .find(|c| c.starts_with("Struct:") || c.starts_with("Enum:"));
            self.types
                .push(module.is_some_and(|m| m == "Struct:Linear"));
        }
    }
    let mut v = Types {
        stack: Vec::new(),
        types: Vec::new(),
    };
    model.visit(&mut Only::new(&mut v, Tensors::Params));
    layout
        .params
        .iter()
        .zip(v.types)
        .map(|(p, linear)| {
            let weight = p.name.rsplit('.').next() == Some("weight");
            SavedTensor {
                name: p.name.clone(),
                shape: p.shape.clone(),
                transposed: linear && weight && p.shape.len() == 2,
            }
        })
        .collect()
}

/// The tensors of the buffers of `layout` (a model's [`crate::ModelState::buffer_layout`]):
/// saved as they are (batch norm's running statistics are vectors), after the parameters.
pub(crate) fn saved_buffers(layout: &ParamLayout) -> Vec<SavedTensor> {
    (layout.params.iter())
        .map(|p| SavedTensor {
            name: p.name.clone(),
            shape: p.shape.clone(),
            transposed: false,
        })
        .collect()
}

/// A weights file's layout, known from the tensors alone before any value: its header and
/// where each tensor's bytes lie. Any process that knows the model can write any tensor at
/// its place ([`WeightsPlan::write_at`]) into the file [`WeightsPlan::create`] made, in any
/// order: so several ranks can write their parts of one file at once.
#[derive(Debug, Clone)]
pub struct WeightsPlan {
    tensors: Vec<SavedTensor>,
    /// The length prefix and the JSON header, padded to 8 bytes.
    header: Vec<u8>,
    /// Each tensor's first byte in the file.
    offsets: Vec<u64>,
    /// The file's length.
    len: u64,
}

impl WeightsPlan {
    /// The layout of `tensors` with `metadata` (burn's own fields first).
    pub fn new(tensors: Vec<SavedTensor>, metadata: &[(String, String)]) -> Self {
        let mut meta: serde_json::Map<String, serde_json::Value> =
            SafetensorsStore::default_metadata()
                .into_iter()
                .map(|(k, v)| (k, v.into()))
                .collect();
        for (k, v) in metadata {
            meta.insert(k.clone(), v.clone().into());
        }
        let mut header = serde_json::Map::new();
        header.insert("__metadata__".into(), meta.into());
        let mut at = 0usize;
        let mut starts = Vec::with_capacity(tensors.len());
        for t in &tensors {
            let len: usize = t.shape.iter().product::<usize>() * std::mem::size_of::<f32>();
            let mut shape = t.shape.clone();
            if t.transposed {
                shape.reverse();
            }
            header.insert(
                t.name.clone(),
                serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [at, at + len]}),
            );
            starts.push(at as u64);
            at += len;
        }
        let mut text = serde_json::Value::Object(header).to_string().into_bytes();
        // The data starts 8-byte aligned, as the safetensors crate writes it.
        text.resize(text.len().next_multiple_of(8), b' ');
        let data = 8 + text.len() as u64;
        let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(&text);
        Self {
            tensors,
            header: bytes,
            offsets: starts.into_iter().map(|s| data + s).collect(),
            len: data + at as u64,
        }
    }

    /// The tensors, in flat order.
    pub fn tensors(&self) -> &[SavedTensor] {
        &self.tensors
    }

    /// Where tensor `index`'s bytes lie in the file (PyTorch's layout, as the file holds it).
    pub fn place(&self, index: usize) -> Option<std::ops::Range<u64>> {
        let t = self.tensors.get(index)?;
        let len = (t.shape.iter().product::<usize>() * std::mem::size_of::<f32>()) as u64;
        let at = *self.offsets.get(index)?;
        Some(at..at + len)
    }

    /// The file's length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the file holds no tensor data.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// Creates `path` with the header, at its whole length (the tensors' bytes zero until
    /// written), and returns it open for writing.
    pub fn create(&self, path: &Path) -> Result<File> {
        let io = |e: std::io::Error| checkpoint_error(path, e);
        let file = File::create(path).map_err(io)?;
        file.write_all_at(&self.header, 0).map_err(io)?;
        file.set_len(self.len).map_err(io)?;
        Ok(file)
    }

    /// The file's first bytes: the length prefix and the JSON header, padded to 8 bytes.
    pub fn header(&self) -> &[u8] {
        &self.header
    }

    /// Writes tensor `index`'s `values` (flat order, burn's layout) at its place in `file`
    /// (made by [`WeightsPlan::create`]; `path` names it in errors), transposed into
    /// PyTorch's layout when the tensor is.
    pub fn write_at(
        &self,
        (file, path): (&File, &Path),
        index: usize,
        values: &[f32],
    ) -> Result<()> {
        self.write_data_at((file, path), self.header.len() as u64, index, values)
    }

    /// [`WeightsPlan::write_at`] into a file that holds this file's tensor data as it is
    /// from byte `base` on (a pipeline's merged weights file holds each stage's so).
    pub fn write_data_at(
        &self,
        (file, path): (&File, &Path),
        base: u64,
        index: usize,
        values: &[f32],
    ) -> Result<()> {
        let t = self
            .tensors
            .get(index)
            .ok_or_else(|| EngineError::Checkpoint {
                path: path.to_path_buf(),
                message: format!("no tensor {index}: the file has {}", self.tensors.len()),
            })?;
        let len: usize = t.shape.iter().product();
        if values.len() != len {
            return Err(EngineError::FlatLength {
                expected: len,
                got: values.len(),
            });
        }
        let mut bytes = Vec::with_capacity(4 * len);
        match (t.transposed, t.shape.as_slice()) {
            (true, &[rows, cols]) => {
                for j in 0..cols {
                    for i in 0..rows {
                        bytes.extend_from_slice(&values[i * cols + j].to_le_bytes());
                    }
                }
            }
            _ => bytes.extend(values.iter().flat_map(|v| v.to_le_bytes())),
        }
        let at = base + (self.offsets[index] - self.header.len() as u64);
        file.write_all_at(&bytes, at)
            .map_err(|e| checkpoint_error(path, e))
    }
}

/// An I/O error on the weights file at `path`.
fn checkpoint_error(path: &Path, e: std::io::Error) -> EngineError {
    EngineError::Checkpoint {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}
