//! The [`Engine`] trait between strategies and the tensor engine, and its burn implementation.

use std::path::Path;

use burn::module::Module;
use burn::nn::loss::{CrossEntropyLoss, CrossEntropyLossConfig};
use burn::optim::ModuleOptimizer;
use burn::prelude::*;
use burn::store::{BurnToPyTorchAdapter, ModuleSnapshot, PyTorchToBurnAdapter, SafetensorsStore};
use burn::tensor::{Gradients, TensorData};

use crate::device::device_by_name;
use crate::error::{EngineError, Result};
use crate::model::SequentialModel;
use crate::optim::OptimizerSpec;
use crate::params::{self, ParamLayout};
use crate::spec::{ModelSpec, Shape};

/// Serialises seeded initialisation (see [`BurnEngine::new`]).
static INIT_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// One batch of samples in flat buffers.
#[derive(Debug, Clone, Copy)]
pub struct BatchRef<'a> {
    /// `n` samples, each the model's input shape, row-major.
    pub images: &'a [f32],
    /// `n` class labels.
    pub labels: &'a [i64],
}

/// Evaluation totals over a data set.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EvalStats {
    /// Sum of per-sample cross-entropy losses.
    pub loss_sum: f64,
    /// Samples classified correctly.
    pub correct: usize,
    /// Samples seen.
    pub count: usize,
}

impl EvalStats {
    /// Mean loss per sample.
    pub fn loss(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.loss_sum / self.count as f64
        }
    }

    /// Fraction classified correctly.
    pub fn accuracy(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.correct as f64 / self.count as f64
        }
    }
}

/// What a training strategy needs from a tensor engine. Everything crosses this boundary as
/// flat `f32` buffers in the order of [`Engine::layout`]; no engine type leaks out.
pub trait Engine {
    /// Where each parameter lives in the flat buffers.
    fn layout(&self) -> &ParamLayout;

    /// Number of parameters (length of every flat buffer).
    fn num_params(&self) -> usize {
        self.layout().total
    }

    /// Copies the parameters into `out`.
    fn read_params(&self, out: &mut [f32]) -> Result<()>;

    /// Replaces the parameters with `src`; optimizer state stays attached.
    fn write_params(&mut self, src: &[f32]) -> Result<()>;

    /// Runs forward and backward on a batch, keeping the gradients; returns the batch's mean loss.
    fn forward_backward(&mut self, batch: BatchRef<'_>) -> Result<f32>;

    /// Calls `f(param_index, gradient)` for each parameter in flat order, from the last
    /// [`Engine::forward_backward`].
    fn for_each_grad(&self, f: &mut dyn FnMut(usize, &[f32]) -> Result<()>) -> Result<()>;

    /// Applies one optimizer step with the given flat gradient and learning rate, and drops
    /// the gradients of the last backward pass.
    fn apply_grads(&mut self, grads: &[f32], lr: f64) -> Result<()>;

    /// Evaluates on a data set in chunks of `batch_size` (no gradients).
    fn evaluate(&self, images: &[f32], labels: &[i64], batch_size: usize) -> Result<EvalStats>;

    /// The optimizer state as bytes (burn's burnpack format), keyed by parameter position.
    fn optimizer_state(&self) -> Result<Vec<u8>>;

    /// Restores optimizer state written by [`Engine::optimizer_state`].
    fn load_optimizer_state(&mut self, bytes: &[u8]) -> Result<()>;

    /// Writes the parameters as safetensors in PyTorch's layout (linear weights `[out, in]`,
    /// names `layers.<i>.weight`).
    fn save_weights(&self, path: &Path) -> Result<()>;

    /// Reads parameters written by [`Engine::save_weights`] (or by PyTorch, same names).
    fn load_weights(&mut self, path: &Path) -> Result<()>;
}

/// The burn implementation of [`Engine`] for a [`SequentialModel`].
pub struct BurnEngine {
    spec: ModelSpec,
    input: Shape,
    device: Device,
    base_device: Device,
    model: Option<SequentialModel>,
    optimizer: ModuleOptimizer,
    layout: ParamLayout,
    grads: Option<Gradients>,
    loss: CrossEntropyLoss,
}

impl BurnEngine {
    /// Builds the model of `spec` on the named backend (`flex`, `libtorch`) with parameters
    /// initialised from `seed`, and the optimizer of `optimizer`.
    pub fn new(
        spec: &ModelSpec,
        optimizer: &OptimizerSpec,
        device_name: &str,
        seed: u64,
    ) -> Result<Self> {
        let base_device = device_by_name(device_name)?;
        let device = base_device.clone().autodiff();
        let input = spec.input_shape()?;
        // The backend's RNG may be process-wide: seeding and drawing the initial values happen
        // under one lock, so that engines built concurrently still depend on their seed alone.
        let (model, layout) = {
            let _guard = INIT_LOCK
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            device.seed(seed);
            let model = params::renumber(SequentialModel::new(spec, &device)?);
            let layout = ParamLayout::of(&model);
            // Materialise every lazily initialised parameter now, in flat order, so that the
            // values depend on the seed alone and not on the order of first use.
            let mut scratch = vec![0.0; layout.total];
            params::read_params(&model, &layout, &mut scratch)?;
            (model, layout)
        };
        Ok(Self {
            spec: spec.clone(),
            input,
            loss: CrossEntropyLossConfig::new().init(&device),
            device,
            base_device,
            model: Some(model),
            optimizer: optimizer.build()?,
            layout,
            grads: None,
        })
    }

    /// The spec this engine was built from.
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    fn model(&self) -> Result<&SequentialModel> {
        // The model is only taken out for the duration of a call that puts it back.
        self.model.as_ref().ok_or(EngineError::ModelUnavailable)
    }

    fn take_model(&mut self) -> Result<SequentialModel> {
        self.model.take().ok_or(EngineError::ModelUnavailable)
    }

    fn check_batch(&self, images: &[f32], labels: &[i64]) -> Result<usize> {
        let per = self.input.numel();
        let n = labels.len();
        if images.len() != n * per {
            return Err(EngineError::Batch(format!(
                "{} labels need {} image values ({} each) but got {}",
                n,
                n * per,
                per,
                images.len()
            )));
        }
        Ok(n)
    }

    fn logits(
        &self,
        model: &SequentialModel,
        images: &[f32],
        n: usize,
        device: &Device,
    ) -> Tensor<2> {
        match self.input {
            Shape::Image { c, h, w } => {
                let x =
                    Tensor::<4>::from_data(TensorData::new(images.to_vec(), [n, c, h, w]), device);
                model.forward(x)
            }
            Shape::Flat(f) => {
                let x = Tensor::<2>::from_data(TensorData::new(images.to_vec(), [n, f]), device);
                model.forward_flat(x)
            }
        }
    }
}

fn labels_tensor(labels: &[i64], device: &Device) -> Tensor<1, Int> {
    Tensor::<1, Int>::from_data(TensorData::new(labels.to_vec(), [labels.len()]), device)
}

impl Engine for BurnEngine {
    fn layout(&self) -> &ParamLayout {
        &self.layout
    }

    fn read_params(&self, out: &mut [f32]) -> Result<()> {
        params::read_params(self.model()?, &self.layout, out)
    }

    fn write_params(&mut self, src: &[f32]) -> Result<()> {
        let model = self.take_model()?;
        match params::write_params(model.clone(), &self.layout, src) {
            Ok(m) => {
                self.model = Some(m);
                Ok(())
            }
            Err(e) => {
                self.model = Some(model);
                Err(e)
            }
        }
    }

    fn forward_backward(&mut self, batch: BatchRef<'_>) -> Result<f32> {
        let n = self.check_batch(batch.images, batch.labels)?;
        if n == 0 {
            return Err(EngineError::Batch("empty batch".into()));
        }
        let model = self.model()?;
        let forward =
            tracing::info_span!(target: "flotilla::engine", "forward", samples = n as u64)
                .entered();
        let logits = self.logits(model, batch.images, n, &self.device);
        let loss = self
            .loss
            .forward(logits, labels_tensor(batch.labels, &self.device));
        drop(forward);
        let backward = tracing::info_span!(target: "flotilla::engine", "backward").entered();
        let grads = loss.backward();
        let value = loss.into_scalar::<f32>();
        drop(backward);
        self.grads = Some(grads);
        Ok(value)
    }

    fn for_each_grad(&self, f: &mut dyn FnMut(usize, &[f32]) -> Result<()>) -> Result<()> {
        let grads = self.grads.as_ref().ok_or(EngineError::NoGradients)?;
        params::for_each_grad(self.model()?, grads, &self.layout, f)
    }

    fn apply_grads(&mut self, grads: &[f32], lr: f64) -> Result<()> {
        let _span = tracing::info_span!(target: "flotilla::engine", "optimizer_step").entered();
        let model = self.model()?;
        let gp = params::grads_from_flat(model, &self.layout, grads, &self.base_device)?;
        let model = self.take_model()?;
        self.model = Some(self.optimizer.step(lr, model, gp));
        self.grads = None;
        Ok(())
    }

    fn evaluate(&self, images: &[f32], labels: &[i64], batch_size: usize) -> Result<EvalStats> {
        let n = self.check_batch(images, labels)?;
        let per = self.input.numel();
        let model = self.model()?.valid();
        let device = &self.base_device;
        let loss_fn = CrossEntropyLossConfig::new().init(device);
        let mut stats = EvalStats::default();
        let batch_size = batch_size.max(1);
        let mut start = 0;
        while start < n {
            let end = (start + batch_size).min(n);
            let count = end - start;
            let logits = self.logits(&model, &images[start * per..end * per], count, device);
            let targets = labels_tensor(&labels[start..end], device);
            let predicted = logits.clone().argmax(1).reshape([count]);
            let correct = predicted
                .equal(targets.clone())
                .int()
                .sum()
                .into_scalar::<i64>();
            let loss = loss_fn.forward(logits, targets).into_scalar::<f32>();
            stats.correct += correct as usize;
            stats.loss_sum += loss as f64 * count as f64;
            stats.count += count;
            start = end;
        }
        Ok(stats)
    }

    fn optimizer_state(&self) -> Result<Vec<u8>> {
        let bytes = self
            .optimizer
            .into_bytes()
            .map_err(|e| EngineError::Optimizer(format!("saving state: {e:?}")))?;
        Ok(bytes.to_vec())
    }

    fn load_optimizer_state(&mut self, bytes: &[u8]) -> Result<()> {
        let optimizer = self
            .optimizer
            .clone()
            .from_bytes(burn::tensor::Bytes::from_bytes_vec(bytes.to_vec()))
            .map_err(|e| EngineError::Optimizer(format!("loading state: {e:?}")))?;
        self.optimizer = optimizer;
        Ok(())
    }

    fn save_weights(&self, path: &Path) -> Result<()> {
        let mut store = SafetensorsStore::from_file(path)
            .with_to_adapter(BurnToPyTorchAdapter)
            .skip_enum_variants(true)
            .metadata("flotilla.model", self.spec.to_yaml())
            .overwrite(true);
        self.model()?
            .save_into(&mut store)
            .map_err(|e| EngineError::Checkpoint {
                path: path.to_path_buf(),
                message: e.to_string(),
            })
    }

    fn load_weights(&mut self, path: &Path) -> Result<()> {
        let mut store = SafetensorsStore::from_file(path)
            .with_from_adapter(PyTorchToBurnAdapter)
            .skip_enum_variants(true)
            .validate(true)
            .allow_partial(false);
        // Load into a copy so that a failed or partial load leaves the model as it was.
        let mut candidate = self.model()?.clone();
        let applied = candidate
            .load_from(&mut store)
            .map_err(|e| EngineError::Checkpoint {
                path: path.to_path_buf(),
                message: e.to_string(),
            })?;
        if !applied.errors.is_empty() || !applied.missing.is_empty() {
            return Err(EngineError::Checkpoint {
                path: path.to_path_buf(),
                message: format!("{applied}"),
            });
        }
        self.model = Some(candidate);
        Ok(())
    }
}
