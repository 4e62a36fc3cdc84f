//! [`NamedTensors`]: the tensors a user's pipeline stage ([`crate::StageModule`]) takes and
//! gives, by name.
//!
//! A stage's tensors have different ranks (an image `[n, 1, 28, 28]`, a hidden state
//! `[n, 128]`), so the map keeps each one flattened with its dimensions and gives it back
//! with the rank the caller asks for; reshaping keeps the autodiff graph. Every tensor is
//! batch-first (its first dimension counts samples: micro-batches are cut there) and has 2, 3
//! or 4 dimensions when it crosses to another stage (a flat feature vector, a sequence, an
//! image per sample).

use std::collections::BTreeMap;

use burn::prelude::*;

use crate::error::{EngineError, Result};
use crate::spec::activation::Activation;
use crate::spec::shape::Shape;

/// One named tensor: its dimensions and its values, flattened row-major.
#[derive(Debug, Clone)]
struct Entry {
    dims: Vec<usize>,
    values: Tensor<1>,
}

/// Float tensors by name, of any rank: what a [`crate::StageModule`] takes and gives.
#[derive(Debug, Clone, Default)]
pub struct NamedTensors {
    map: BTreeMap<String, Entry>,
}

impl NamedTensors {
    /// No tensors.
    pub fn new() -> Self {
        Self::default()
    }

    /// `self` with `tensor` under `name` (replacing one of that name).
    pub fn with<const D: usize>(mut self, name: &str, tensor: Tensor<D>) -> Self {
        self.insert(name, tensor);
        self
    }

    /// Puts `tensor` under `name`, replacing one of that name.
    pub fn insert<const D: usize>(&mut self, name: &str, tensor: Tensor<D>) {
        let dims = tensor.dims().to_vec();
        let numel = dims.iter().product::<usize>();
        let values = tensor.reshape([numel]);
        self.map.insert(name.to_string(), Entry { dims, values });
    }

    /// Removes the tensor `name` and gives it back with `D` dimensions; an error names what
    /// is missing or differs (no such tensor, another rank).
    pub fn take<const D: usize>(&mut self, name: &str) -> Result<Tensor<D>> {
        let Some(entry) = self.map.remove(name) else {
            return Err(EngineError::Batch(format!(
                "no tensor `{name}` (there are: {})",
                self.names().join(", ")
            )));
        };
        let Ok(dims) = <[usize; D]>::try_from(entry.dims.as_slice()) else {
            let shape = format!("{:?}", entry.dims);
            self.map.insert(name.to_string(), entry);
            return Err(EngineError::Batch(format!(
                "`{name}` has shape {shape}, not {D} dimensions"
            )));
        };
        Ok(entry.values.reshape(dims))
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

    /// `activation` under `name`.
    pub(crate) fn put(&mut self, name: &str, activation: Activation) {
        match activation {
            Activation::Image(t) => self.insert(name, t),
            Activation::Flat(t) => self.insert(name, t),
            Activation::Seq(t) => self.insert(name, t),
        }
    }

    /// The tensor `name` as an activation (2, 3 or 4 dimensions, batch first); `stage` says
    /// whose output it is in an error.
    pub(crate) fn activation(&self, name: &str, stage: usize) -> Result<Activation> {
        let Some(e) = self.map.get(name) else {
            return Err(EngineError::Batch(format!(
                "stage {stage} declares the output `{name}` but its forward did not give it \
                 (it gave: {})",
                self.names().join(", ")
            )));
        };
        let values = e.values.clone();
        match *e.dims.as_slice() {
            [n, f] => Ok(Activation::Flat(values.reshape([n, f]))),
            [n, t, d] => Ok(Activation::Seq(values.reshape([n, t, d]))),
            [n, c, h, w] => Ok(Activation::Image(values.reshape([n, c, h, w]))),
            ref dims => Err(EngineError::Batch(format!(
                "stage {stage}'s output `{name}` has shape {dims:?}; a tensor that crosses \
                 stages is batch-first with 2, 3 or 4 dimensions (`[n, f]`, `[n, t, d]`, \
                 `[n, c, h, w]`)"
            ))),
        }
    }
}

/// One sample's [`Shape`] of a batch-first activation.
pub(crate) fn sample_shape(activation: &Activation) -> Shape {
    match activation {
        Activation::Image(t) => {
            let [_, c, h, w] = t.dims();
            Shape::Image { c, h, w }
        }
        Activation::Flat(t) => Shape::Flat(t.dims()[1]),
        Activation::Seq(t) => {
            let [_, t, d] = t.dims();
            Shape::Seq { t, d }
        }
    }
}
