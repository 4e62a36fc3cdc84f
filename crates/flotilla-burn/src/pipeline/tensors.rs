//! [`Tensors`]: the named tensors a pipeline stage takes and gives.
//!
//! A stage's tensors have different ranks (an image `[n, 1, 28, 28]`, a hidden state
//! `[n, 128]`) and kinds (float activations, integer token ids or labels), so the map keeps
//! each one flattened with its dimensions and gives it back with the rank the caller asks
//! for; reshaping keeps the autodiff graph. Every tensor of a batch is batch-first: its first
//! dimension counts samples, which is how micro-batches are cut.

use std::collections::BTreeMap;
use std::ops::Range;

use burn::prelude::*;
use burn::tensor::Int;

use crate::error::{DistError, Result};

/// A float or integer tensor, flattened.
#[derive(Debug, Clone)]
pub(crate) enum Flat {
    /// Float values (activations, their gradients flow).
    Float(Tensor<1>),
    /// Integer values (token ids, class labels).
    Int(Tensor<1, Int>),
}

/// One named tensor: its dimensions and its values, flattened row-major.
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    pub(crate) dims: Vec<usize>,
    pub(crate) value: Flat,
}

/// Tensors by name, of any rank, float or integer: what a [`crate::PipelineStage`] takes and
/// gives, and the batch and targets of [`crate::Pipeline::step`].
#[derive(Debug, Clone, Default)]
pub struct Tensors {
    map: BTreeMap<String, Entry>,
}

impl Tensors {
    /// No tensors.
    pub fn new() -> Self {
        Self::default()
    }

    /// `self` with the float tensor `tensor` under `name` (replacing one of that name).
    pub fn with<const D: usize>(mut self, name: &str, tensor: Tensor<D>) -> Self {
        self.insert(name, tensor);
        self
    }

    /// `self` with the integer tensor `tensor` under `name` (replacing one of that name).
    pub fn with_int<const D: usize>(mut self, name: &str, tensor: Tensor<D, Int>) -> Self {
        self.insert_int(name, tensor);
        self
    }

    /// Puts the float tensor `tensor` under `name`, replacing one of that name.
    pub fn insert<const D: usize>(&mut self, name: &str, tensor: Tensor<D>) {
        let dims = tensor.dims().to_vec();
        let numel = dims.iter().product::<usize>();
        let value = Flat::Float(tensor.reshape([numel]));
        self.map.insert(name.to_string(), Entry { dims, value });
    }

    /// Puts the integer tensor `tensor` under `name`, replacing one of that name.
    pub fn insert_int<const D: usize>(&mut self, name: &str, tensor: Tensor<D, Int>) {
        let dims = tensor.dims().to_vec();
        let numel = dims.iter().product::<usize>();
        let value = Flat::Int(tensor.reshape([numel]));
        self.map.insert(name.to_string(), Entry { dims, value });
    }

    /// Removes the float tensor `name` and gives it back with `D` dimensions; an error names
    /// what is missing or differs (no such tensor, another rank, an integer tensor).
    pub fn take<const D: usize>(&mut self, name: &str) -> Result<Tensor<D>> {
        let entry = self.remove::<D>(name)?;
        match entry.value {
            Flat::Float(t) => Ok(t.reshape(dims_of::<D>(&entry.dims))),
            Flat::Int(_) => Err(DistError::Tensor(format!(
                "`{name}` holds integers: take it with take_int"
            ))),
        }
    }

    /// Removes the integer tensor `name` and gives it back with `D` dimensions; an error names
    /// what is missing or differs.
    pub fn take_int<const D: usize>(&mut self, name: &str) -> Result<Tensor<D, Int>> {
        let entry = self.remove::<D>(name)?;
        match entry.value {
            Flat::Int(t) => Ok(t.reshape(dims_of::<D>(&entry.dims))),
            Flat::Float(_) => Err(DistError::Tensor(format!(
                "`{name}` holds floats: take it with take"
            ))),
        }
    }

    /// Whether a tensor is named `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.map.contains_key(name)
    }

    /// The names, in order.
    pub fn names(&self) -> Vec<String> {
        self.map.keys().cloned().collect()
    }

    /// How many tensors.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Removes the entry `name`, checking that it has `D` dimensions.
    fn remove<const D: usize>(&mut self, name: &str) -> Result<Entry> {
        let Some(entry) = self.map.get(name) else {
            return Err(DistError::Tensor(format!(
                "no tensor `{name}` (there are: {})",
                self.names().join(", ")
            )));
        };
        if entry.dims.len() != D {
            return Err(DistError::Tensor(format!(
                "`{name}` has shape {:?}, not {D} dimensions",
                entry.dims
            )));
        }
        self.map
            .remove(name)
            .ok_or_else(|| DistError::Tensor(name.into()))
    }

    pub(crate) fn take_entry(&mut self, name: &str) -> Option<Entry> {
        self.map.remove(name)
    }

    pub(crate) fn put_entry(&mut self, name: &str, entry: Entry) {
        self.map.insert(name.to_string(), entry);
    }

    /// The number of samples: the first dimension that every tensor shares.
    pub(crate) fn samples(&self, what: &str) -> Result<usize> {
        let mut rows = None;
        for (name, e) in &self.map {
            let Some(&n) = e.dims.first() else {
                return Err(DistError::Pipeline(format!(
                    "{what} `{name}` is a scalar; batch tensors are batch-first"
                )));
            };
            match rows {
                Some(r) if r != n => {
                    return Err(DistError::Pipeline(format!(
                        "{what} `{name}` has {n} samples, the others {r}"
                    )));
                }
                _ => rows = Some(n),
            }
        }
        rows.ok_or_else(|| DistError::Pipeline(format!("{what}: no tensors")))
    }

    /// The samples `rows` of every tensor (a micro-batch).
    pub(crate) fn rows(&self, rows: &Range<usize>) -> Tensors {
        let map = self
            .map
            .iter()
            .map(|(name, e)| {
                let per = e.dims.iter().skip(1).product::<usize>();
                let (start, len) = (rows.start * per, rows.len() * per);
                let value = match &e.value {
                    Flat::Float(t) => Flat::Float(t.clone().narrow(0, start, len)),
                    Flat::Int(t) => Flat::Int(t.clone().narrow(0, start, len)),
                };
                let mut dims = e.dims.clone();
                dims[0] = rows.len();
                (name.clone(), Entry { dims, value })
            })
            .collect();
        Tensors { map }
    }
}

/// `dims` (of length `D`, checked by the caller) as an array.
fn dims_of<const D: usize>(dims: &[usize]) -> [usize; D] {
    let mut out = [0; D];
    out.copy_from_slice(dims);
    out
}
