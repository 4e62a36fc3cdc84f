//! [`ModuleEngine`]: the [`Engine`] of a burn user's own module, so that every way of training
//! written against the engine (flotilla-train's strategies and run loop) trains a user's model
//! as it trains a spec's. The user's module says how it turns a batch into a loss and logits
//! ([`TrainModule`]); parameters, buffers, optimizer state and weight files go through the
//! same [`Weights`] as a spec model's, and its gradients through the same flat views.

use std::sync::Arc;

use burn::module::Module;
use burn::prelude::*;

use crate::collective::Reducer;
use crate::device::device_by_name;
use crate::engine::{BatchRef, Engine, EvalStats, evaluate_in_chunks};
use crate::error::{EngineError, Result};
use crate::grouped::{self, GroupGrads};
use crate::optim::OptimizerSpec;
use crate::params;
use crate::weights::{Weights, delegate_model_state};

/// What a user's burn module tells the engine: its training loss and its logits on a batch of
/// flat inputs (the data's layout, row-major: `n` samples of the model's input) and labels.
pub trait TrainModule: Module + 'static {
    /// The mean loss of a training batch: a one-value tensor on `device` (an autodiff
    /// device), from which the engine runs backward. Usually the cross-entropy of
    /// `self.logits(...)` against `batch.labels`.
    fn loss(&self, batch: BatchRef<'_>, device: &Device) -> Tensor<1>;

    /// The logits of the `n` samples of `inputs`: one row per label (`n ×
    /// labels_per_sample` rows), on `device`; for evaluation (no autodiff).
    fn logits(&self, inputs: &[f32], n: usize, device: &Device) -> Tensor<2>;

    /// Labels per sample: 1 for a classifier (the default), the positions of a sequence
    /// model.
    fn labels_per_sample(&self) -> usize {
        1
    }
}

/// A user's module as an [`Engine`]: one backward pass per batch (one group), burn's
/// optimizer of an [`OptimizerSpec`] on the flat gradients a strategy hands it.
pub struct ModuleEngine<M: TrainModule> {
    weights: Weights<M>,
    /// The gradients of the last backward (empty: none).
    grads: Vec<GroupGrads>,
}

delegate_model_state!([M: TrainModule] ModuleEngine<M>);

impl<M: TrainModule> ModuleEngine<M> {
    /// `model` trained on the named device (`flex`, `wgpu`, ...: its parameters are moved
    /// there, as fresh leaves numbered by position) with the optimizer of `optimizer`.
    pub fn new(model: M, optimizer: &OptimizerSpec, device_name: &str) -> Result<Self> {
        let base_device = device_by_name(device_name)?;
        // `train()`: a module built on a plain device gets its parameters' configured
        // gradient tracking back on the autodiff one (a frozen parameter stays frozen).
        let model = params::renumber(model.fork(&base_device.clone().autodiff()).train());
        Ok(Self {
            // A user's module may draw dropout masks: seeded like a spec model's.
            weights: Weights::of_module(model, optimizer, base_device, true)?,
            grads: Vec::new(),
        })
    }

    /// The module with its current parameters (on the training device).
    pub fn module(&self) -> Result<&M> {
        self.weights.model()
    }
}

impl<M: TrainModule> Engine for ModuleEngine<M> {
    fn forward_backward(&mut self, batch: BatchRef<'_>) -> Result<f32> {
        let lps = self.labels_per_sample();
        if batch.labels.is_empty() || !batch.labels.len().is_multiple_of(lps) {
            return Err(EngineError::Batch(format!(
                "{} labels are not a whole, non-empty number of samples of {lps} labels",
                batch.labels.len()
            )));
        }
        let model = self.weights.model()?;
        let device = &self.weights.device;
        let forward = tracing::info_span!(target: "flotilla::engine", "forward").entered();
        let loss = self.weights.with_dropout_rng(|| model.loss(batch, device));
        drop(forward);
        let backward = tracing::info_span!(target: "flotilla::engine", "backward").entered();
        let grads = loss.backward();
        let value = loss.into_scalar::<f32>();
        drop(backward);
        self.grads = vec![GroupGrads {
            params: 0..self.weights.layout.params.len(),
            grads: Some(grads),
        }];
        Ok(value)
    }

    fn labels_per_sample(&self) -> usize {
        self.weights
            .model()
            .map_or(1, TrainModule::labels_per_sample)
    }

    fn set_dropout_seed(&mut self, seed: u64) {
        self.weights.set_dropout_seed(seed);
    }

    fn set_batch_norm_sync(&mut self, reducer: Option<Arc<dyn Reducer>>) -> Result<()> {
        match reducer {
            None => Ok(()),
            Some(_) => Err(EngineError::BatchNormSync(
                "a user's module synchronizes its own batch norms (flotilla_burn::SyncBatchNorm \
                 in its forward), not through the engine"
                    .into(),
            )),
        }
    }

    fn for_each_grad(&self, f: &mut dyn FnMut(usize, &[f32]) -> Result<()>) -> Result<()> {
        grouped::for_each_grad(self.weights.model()?, &self.weights.layout, &self.grads, f)
    }

    fn apply_grads(&mut self, grads: &[f32], lr: f64) -> Result<()> {
        self.weights.step(grads, lr)?;
        self.grads.clear();
        Ok(())
    }

    fn drop_grads(&mut self) {
        self.grads.clear();
    }

    fn evaluate(&self, images: &[f32], labels: &[i64], batch_size: usize) -> Result<EvalStats> {
        let lps = self.labels_per_sample();
        let n = labels.len() / lps;
        if n == 0 || labels.len() != n * lps || !images.len().is_multiple_of(n) {
            return Err(EngineError::Batch(format!(
                "{} inputs and {} labels are not {lps} labels and the same inputs per sample",
                images.len(),
                labels.len()
            )));
        }
        let model = self.weights.model()?.valid();
        let device = &self.weights.base_device;
        let counts = (n, images.len() / n, lps);
        Ok(evaluate_in_chunks(
            images,
            labels,
            counts,
            batch_size,
            device,
            |x, k| model.logits(x, k, device),
        ))
    }
}
