//! The [`Engine`] trait between strategies and the tensor engine, and its burn implementation.

use std::ops::Range;
use std::sync::Arc;

use burn::module::Module;
use burn::nn::loss::{CrossEntropyLoss, CrossEntropyLossConfig};
use burn::prelude::*;
use burn::tensor::TensorData;

use crate::backward_groups::{self, BackwardGroup, LayerParams};
use crate::collective::{Reducer, ReducerHandle};
use crate::error::{EngineError, Result};
use crate::grouped::{self, GroupGrads};
use crate::optim::OptimizerSpec;
use crate::recompute;
use crate::sharded::{self, ShardSink, ShardedPass};
use crate::spec::activation::Activation;
use crate::spec::model::SequentialModel;
use crate::spec::sequence::check_tokens;
use crate::spec::{ModelSpec, Shape};
use crate::weights::{ModelState, Weights, delegate_model_state};

/// One batch of samples in flat buffers.
#[derive(Debug, Clone, Copy)]
pub struct BatchRef<'a> {
    /// `n` samples, each the model's input shape, row-major (token ids as `f32` integers for a
    /// model that starts with an embedding).
    pub images: &'a [f32],
    /// `n × labels_per_sample` class labels (see [`Engine::labels_per_sample`]): one per
    /// sample, or one per position of a sequence model, sample by sample.
    pub labels: &'a [i64],
}

/// Evaluation totals over a data set. A sequence model counts positions: `count` positions,
/// `correct` positions whose largest logit is the label, `loss_sum` over positions.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EvalStats {
    /// Sum of per-sample (per-position) cross-entropy losses.
    pub loss_sum: f64,
    /// Samples (positions) classified correctly.
    pub correct: usize,
    /// Samples (positions) seen.
    pub count: usize,
}

impl EvalStats {
    /// Mean loss per sample (per position).
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

/// What a training strategy needs from a tensor engine: the flat parameter state of
/// [`ModelState`], plus a whole-model training step. Everything crosses this boundary as flat
/// `f32` buffers in the order of [`ModelState::layout`]; no engine type leaks out.
///
/// A classifier's batch has one label per sample; a sequence model's (its output is a
/// sequence of logits) one per position, and its loss is the mean cross-entropy over every
/// position of the batch.
pub trait Engine: ModelState {
    /// Runs forward and backward on a batch, keeping the gradients; returns the batch's mean loss.
    fn forward_backward(&mut self, batch: BatchRef<'_>) -> Result<f32>;

    /// How many labels one sample has: 1 for a classifier, `T` for a sequence model (one
    /// class per position, row-major in [`BatchRef::labels`]).
    fn labels_per_sample(&self) -> usize;

    /// Seeds the dropout masks of every following training forward pass: each re-seeds the
    /// backend's RNG with `seed` before it draws. Call it before each step with a seed made of
    /// the run's seed, the rank and the step, so that every rank draws its own masks and a
    /// resumed run draws the same ones. Until it is called, masks come from the backend's
    /// running RNG. (Evaluation draws none.)
    fn set_dropout_seed(&mut self, seed: u64);

    /// Makes every batch norm of the model train with the statistics of every rank's batch,
    /// summed by `reducer` (PyTorch's `SyncBatchNorm`; see [`crate::sync_batch_norm`]);
    /// `None` turns it off. Every rank must then run each training pass on a batch of the
    /// same shape; a failed sum fails the pass with [`EngineError::BatchNormSync`].
    fn set_batch_norm_sync(&mut self, reducer: Option<Arc<dyn Reducer>>) -> Result<()>;

    /// Calls `f(param_index, gradient)` for each parameter in flat order, from the last
    /// [`Engine::forward_backward`] or [`Engine::forward_backward_streaming`].
    fn for_each_grad(&self, f: &mut dyn FnMut(usize, &[f32]) -> Result<()>) -> Result<()>;

    /// Runs forward and backward on a batch and calls `ready(param_index, gradient)` for every
    /// parameter as soon as its gradient exists; returns the batch's mean loss.
    ///
    /// Every parameter is reported exactly once: group by group in the order of
    /// [`Engine::backward_groups`], and within a group in flat order. The gradients are the
    /// same, bit for bit, as those of [`Engine::forward_backward`], and are kept as it keeps
    /// them ([`Engine::for_each_grad`] and [`Engine::read_grads`] give them again). An error
    /// from `ready` stops the pass and is returned; the gradients must not be used then
    /// ([`BurnEngine`] drops them).
    ///
    /// The default runs [`Engine::forward_backward`], then [`Engine::for_each_grad`] (one
    /// group: nothing is ready before the whole backward is done).
    fn forward_backward_streaming(
        &mut self,
        batch: BatchRef<'_>,
        ready: &mut dyn FnMut(usize, &[f32]) -> Result<()>,
    ) -> Result<f32> {
        let loss = self.forward_backward(batch)?;
        self.for_each_grad(ready)?;
        Ok(loss)
    }

    /// The groups of parameters that [`Engine::forward_backward_streaming`] reports together,
    /// as ranges of indices into [`ModelState::layout`]'s `params`, in the order their
    /// gradients become ready (for a caller to plan buckets that match them). They are
    /// consecutive and cover every parameter once. The default is one group of all parameters.
    fn backward_groups(&self) -> Vec<Range<usize>> {
        std::iter::once(0..self.layout().params.len()).collect()
    }

    /// Splits the backward pass of [`Engine::forward_backward_streaming`] into groups of at
    /// most about `max_bytes` of parameters each, where the model allows a cut (`0`: one
    /// group). The default keeps one group: an engine that cannot cut ignores it.
    fn set_backward_group_bytes(&mut self, max_bytes: usize) -> Result<()> {
        let _ = max_bytes;
        Ok(())
    }

    /// Copies the gradient of the last [`Engine::forward_backward`] (or
    /// [`Engine::forward_backward_streaming`]) into `out` (flat order).
    fn read_grads(&self, out: &mut [f32]) -> Result<()> {
        let layout = self.layout();
        if out.len() != layout.total {
            return Err(EngineError::FlatLength {
                expected: layout.total,
                got: out.len(),
            });
        }
        self.for_each_grad(&mut |i, g| {
            let p = &layout.params[i];
            out[p.offset..p.offset + p.len].copy_from_slice(g);
            Ok(())
        })
    }

    /// Applies one optimizer step with the given flat gradient and learning rate, and drops
    /// the gradients of the last backward pass.
    fn apply_grads(&mut self, grads: &[f32], lr: f64) -> Result<()>;

    /// Drops the gradients of the last backward pass without a step (what
    /// [`Engine::apply_grads`] does after its step): for a caller that steps the parameters
    /// elsewhere and writes them back ([`crate::ShardOptimizer`]).
    fn drop_grads(&mut self);

    /// Whether the engine steps with an optimizer of its own (burn's `Learner`'s: a burn
    /// optimizer keyed by parameter, not Flotilla's flat one), so that ZeRO shards its state
    /// by whole parameter through [`Engine::apply_grads_to`],
    /// [`Engine::optimizer_state_of`] and [`Engine::load_optimizer_parts`].
    fn steps_own_optimizer(&self) -> bool {
        false
    }

    /// [`Engine::apply_grads`] for the parameters of `params` only (ranges of indices into
    /// [`ModelState::layout`]'s `params`; `grads` is the whole flat gradient): the others
    /// and their optimizer state are left as they are. Only an engine that
    /// [`Engine::steps_own_optimizer`] has it.
    fn apply_grads_to(&mut self, grads: &[f32], params: &[Range<usize>], lr: f64) -> Result<()> {
        let _ = (grads, params, lr);
        Err(EngineError::Optimizer(
            "stepping some parameters only: this engine steps the run's flat optimizer".into(),
        ))
    }

    /// The optimizer state of the parameters of `params` only (as
    /// [`ModelState::optimizer_state`] gives the whole, with what is not per parameter, a
    /// learning-rate scheduler's, included). Only an engine that
    /// [`Engine::steps_own_optimizer`] has it.
    fn optimizer_state_of(&self, params: &[Range<usize>]) -> Result<Vec<u8>> {
        let _ = params;
        Err(EngineError::Optimizer(
            "the state of some parameters only: this engine steps the run's flat optimizer".into(),
        ))
    }

    /// Loads the optimizer state put together from `parts` (each of
    /// [`Engine::optimizer_state_of`], of disjoint parameters; what is not per parameter taken
    /// from the first), keeping only that of the parameters of `keep`: the state of every
    /// other parameter is dropped. Only an engine that [`Engine::steps_own_optimizer`] has it.
    fn load_optimizer_parts(&mut self, parts: &[Vec<u8>], keep: &[Range<usize>]) -> Result<()> {
        let _ = (parts, keep);
        Err(EngineError::Optimizer(
            "loading parts of a state: this engine steps the run's flat optimizer".into(),
        ))
    }

    /// Recomputes each backward group's forward in backward when `on` (activation
    /// checkpointing, `recompute: true`): [`Engine::forward_backward`] and
    /// [`Engine::forward_backward_streaming`] run every group but the last off the tape and
    /// recompute it from its kept input, so one group's activations are held at a time; the
    /// gradients are bit for bit the same, and so are batch norm's running statistics (the
    /// recomputation's update undone). Refused by an engine that cannot (the default); a
    /// recomputed pass with dropout fails without a dropout seed
    /// ([`Engine::set_dropout_seed`]).
    fn set_recompute(&mut self, on: bool) -> Result<()> {
        if on {
            return Err(EngineError::Recompute(
                "this engine runs its model's own forward (a user's module): it cannot \
                 recompute it"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Releases every parameter (ZeRO-3: the caller keeps this rank's shard and gathers
    /// each group's parameters in [`Engine::forward_backward_sharded`]). Whole-model calls
    /// fail with [`EngineError::ParamsSharded`] until [`ModelState::write_params`] gives the
    /// whole parameters back; the buffers (batch norm's running statistics) stay whole.
    /// Refused by an engine that keeps whole parameters (the default).
    fn release_params(&mut self) -> Result<()> {
        Err(EngineError::ParamsSharded(
            "this engine keeps whole parameters: ZeRO stage 2 or less".into(),
        ))
    }

    /// With `on` false (FSDP's `reshard_after_forward=False`), [`Engine::forward_backward_sharded`]
    /// keeps each backward group's gathered parameters, with its activations, from its forward
    /// to its backward: every group gathered once a step and nothing recomputed, for every
    /// group's parameters and activations held at the end of forward; the gradients are bit
    /// for bit the same. `true`, the default, releases each group after its forward, gathers
    /// it again and recomputes its forward in backward. An engine that cannot keep them
    /// refuses `false` (the default).
    fn set_reshard_after_forward(&mut self, on: bool) -> Result<()> {
        if on {
            return Ok(());
        }
        Err(EngineError::ParamsSharded(
            "this engine releases each group's parameters after its forward".into(),
        ))
    }

    /// Forward and backward on a batch of a model whose parameters are released
    /// ([`Engine::release_params`]): each backward group's parameters gathered from `pass`
    /// before its forward and again before its recomputed forward in backward (once, before
    /// its forward, when kept: [`Engine::set_reshard_after_forward`]), its gradients
    /// handed to `pass` as its backward ends (every parameter once, group by group from the
    /// last, within a group in flat order), none kept; bit for bit the gradients of
    /// [`Engine::forward_backward`]. Returns the batch's mean loss. The parameters are
    /// released again after it, failed or not. The default refuses.
    fn forward_backward_sharded(
        &mut self,
        batch: BatchRef<'_>,
        pass: &mut dyn ShardedPass,
    ) -> Result<f32> {
        let _ = (batch, pass);
        Err(EngineError::ParamsSharded(
            "this engine keeps whole parameters: ZeRO stage 2 or less".into(),
        ))
    }

    /// Evaluates one batch (`labels` as in [`BatchRef::labels`]; it may be empty) on a model
    /// whose parameters are released ([`Engine::release_params`]): each backward group's
    /// gathered from `pass`, run, and released. Collective through `pass`: every rank
    /// gathers every group once per call, with or without samples. The figures are
    /// [`Engine::evaluate`]'s. The default refuses.
    fn evaluate_sharded(
        &mut self,
        images: &[f32],
        labels: &[i64],
        pass: &mut dyn ShardedPass,
    ) -> Result<EvalStats> {
        let _ = (images, labels, pass);
        Err(EngineError::ParamsSharded(
            "this engine keeps whole parameters: ZeRO stage 2 or less".into(),
        ))
    }

    /// Evaluates on a data set in chunks of `batch_size` samples (no gradients; `labels` as in
    /// [`BatchRef::labels`]).
    fn evaluate(&self, images: &[f32], labels: &[i64], batch_size: usize) -> Result<EvalStats>;
}

/// The burn implementation of [`Engine`] for the sequential model of a [`ModelSpec`].
///
/// Its backward pass is one group of every layer unless
/// [`BurnEngine::set_backward_group_bytes`] splits it; then
/// [`Engine::forward_backward_streaming`] runs backward group by group (module `grouped`),
/// while [`Engine::forward_backward`] stays one backward pass.
pub struct BurnEngine {
    spec: ModelSpec,
    weights: Weights,
    input: Shape,
    /// Labels per sample: 1, or the positions of a sequence model.
    labels_per_sample: usize,
    /// The vocabulary, if the input is token ids.
    vocab: Option<usize>,
    /// The gradients of the last backward, one entry per group in layer order (empty: none).
    grads: Vec<GroupGrads>,
    /// The backward groups, in layer order.
    groups: Vec<BackwardGroup>,
    /// Each layer's parameters (what the groups are planned from).
    layers: Vec<LayerParams>,
    /// The groups whose forward is recomputed in backward (`recompute: true`): every
    /// segment between the allowed cuts, in layer order (`None`: no recomputation).
    recompute: Option<Vec<BackwardGroup>>,
    /// Whether a sharded pass keeps each group's gathered parameters from its forward to its
    /// backward ([`Engine::set_reshard_after_forward`] false).
    keep_gathered: bool,
    loss: CrossEntropyLoss,
}

delegate_model_state!(BurnEngine);

impl BurnEngine {
    /// Builds the model of `spec` on the named backend (`flex`, `libtorch`) with parameters
    /// initialised from `seed`, and the optimizer of `optimizer`.
    pub fn new(
        spec: &ModelSpec,
        optimizer: &OptimizerSpec,
        device_name: &str,
        seed: u64,
    ) -> Result<Self> {
        let weights = Weights::new(spec, optimizer, device_name, seed, None)?;
        let layers = backward_groups::layer_params(weights.model()?);
        let groups = backward_groups::plan(spec, &layers, 0)?;
        Self::of(spec, weights, layers, groups)
    }

    /// ZeRO-3's engine, which never holds the whole model: its parameters are drawn from
    /// `seed` one layer at a time (the values of [`BurnEngine::new`]), each layer's handed to
    /// `sink` and released ([`Engine::release_params`]), with backward groups of at most
    /// `group_bytes` (as [`Engine::set_backward_group_bytes`]), which `sink` learns first.
    /// A model with batch norm is refused (as by [`Engine::release_params`]).
    pub fn new_released(
        spec: &ModelSpec,
        optimizer: &OptimizerSpec,
        (device_name, seed): (&str, u64),
        group_bytes: usize,
        sink: &mut dyn ShardSink,
    ) -> Result<Self> {
        let (weights, layers, groups) =
            Weights::new_released(spec, optimizer, (device_name, seed), group_bytes, sink)?;
        Self::of(spec, weights, layers, groups)
    }

    fn of(
        spec: &ModelSpec,
        weights: Weights,
        layers: Vec<LayerParams>,
        groups: Vec<BackwardGroup>,
    ) -> Result<Self> {
        Ok(Self {
            spec: spec.clone(),
            input: spec.input_shape()?,
            labels_per_sample: spec.labels_per_sample()?,
            vocab: spec.token_vocab(),
            loss: CrossEntropyLossConfig::new().init(&weights.device),
            weights,
            grads: Vec::new(),
            groups,
            layers,
            recompute: None,
            keep_gathered: false,
        })
    }

    /// The backward groups, in layer order (backward runs the last one first).
    pub fn backward_plan(&self) -> &[BackwardGroup] {
        &self.groups
    }

    /// The spec this engine was built from.
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    fn model(&self) -> Result<&SequentialModel> {
        self.weights.model()
    }

    /// The number of samples of a batch, checking its sizes (and token ids).
    fn check_batch(&self, images: &[f32], labels: &[i64]) -> Result<usize> {
        let per = self.input.numel();
        let lps = self.labels_per_sample;
        let n = labels.len() / lps;
        if !labels.len().is_multiple_of(lps) {
            return Err(EngineError::Batch(format!(
                "{} labels are not a whole number of samples of {lps} labels (one per position)",
                labels.len()
            )));
        }
        if images.len() != n * per {
            return Err(EngineError::Batch(format!(
                "{} labels need {} input values ({} per sample of {lps} labels) but got {}",
                labels.len(),
                n * per,
                per,
                images.len()
            )));
        }
        if let Some(vocab) = self.vocab {
            check_tokens(images, vocab)?;
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
        model.logits(Activation::from_flat(
            images.to_vec(),
            n,
            self.input,
            device,
        ))
    }
}

/// Class labels as a tensor.
pub(crate) fn labels_tensor(labels: &[i64], device: &Device) -> Tensor<1, Int> {
    Tensor::<1, Int>::from_data(TensorData::new(labels.to_vec(), [labels.len()]), device)
}

impl Engine for BurnEngine {
    fn forward_backward(&mut self, batch: BatchRef<'_>) -> Result<f32> {
        if self.recompute.is_some() {
            return self.forward_backward_streaming(batch, &mut |_, _| Ok(()));
        }
        let n = self.check_batch(batch.images, batch.labels)?;
        if n == 0 {
            return Err(EngineError::Batch("empty batch".into()));
        }
        let model = self.model()?;
        let forward =
            tracing::info_span!(target: "flotilla::engine", "forward", samples = n as u64)
                .entered();
        let logits = self
            .weights
            .with_dropout_rng(|| self.logits(model, batch.images, n, &self.weights.device));
        let loss = self
            .loss
            .forward(logits, labels_tensor(batch.labels, &self.weights.device));
        drop(forward);
        let backward = tracing::info_span!(target: "flotilla::engine", "backward").entered();
        let grads = loss.backward();
        let value = loss.into_scalar::<f32>();
        drop(backward);
        self.weights.batch_norm_sync_result()?;
        self.grads = vec![GroupGrads {
            params: 0..self.weights.layout.params.len(),
            grads: Some(grads),
        }];
        Ok(value)
    }

    fn for_each_grad(&self, f: &mut dyn FnMut(usize, &[f32]) -> Result<()>) -> Result<()> {
        let (model, layout) = (self.model()?, &self.weights.layout);
        let tied = grouped::tied_param(model, layout);
        grouped::for_each_grad(model, layout, (&self.grads, tied), f)
    }

    fn forward_backward_streaming(
        &mut self,
        batch: BatchRef<'_>,
        ready: &mut dyn FnMut(usize, &[f32]) -> Result<()>,
    ) -> Result<f32> {
        if self.groups.len() <= 1 && self.recompute.is_none() {
            let loss = self.forward_backward(batch)?;
            if let Err(e) = self.for_each_grad(ready) {
                self.grads.clear();
                return Err(e);
            }
            return Ok(loss);
        }
        let n = self.check_batch(batch.images, batch.labels)?;
        if n == 0 {
            return Err(EngineError::Batch("empty batch".into()));
        }
        self.grads.clear();
        let device = &self.weights.device;
        let input = Activation::from_flat(batch.images.to_vec(), n, self.input, device);
        let targets = labels_tensor(batch.labels, device);
        let (model, layout) = (self.weights.model()?, &self.weights.layout);
        let loss = |logits| self.loss.forward(logits, targets);
        let (value, grads) = match &self.recompute {
            Some(groups) => recompute::forward_backward(model, layout, groups, input, loss, ready)?,
            None => self.weights.with_dropout_rng(|| {
                grouped::forward_backward(model, layout, &self.groups, input, loss, ready)
            })?,
        };
        self.weights.batch_norm_sync_result()?;
        self.grads = grads;
        Ok(value)
    }

    /// Splits the backward pass of [`Engine::forward_backward_streaming`] into groups of
    /// consecutive layers of at most `max_bytes` of parameters (4 bytes per value) each,
    /// chosen from the last layer backwards and cut only where nothing but the main activation
    /// crosses (see module `backward_groups` for the rules: a segment between allowed cuts
    /// that is larger than `max_bytes` is a group of its own; parameterless layers join the
    /// group before them). `0` (the default) or `usize::MAX` gives one group: one backward pass.
    fn set_backward_group_bytes(&mut self, max_bytes: usize) -> Result<()> {
        self.groups = backward_groups::plan(&self.spec, &self.layers, max_bytes)?;
        Ok(())
    }

    fn labels_per_sample(&self) -> usize {
        self.labels_per_sample
    }

    fn set_dropout_seed(&mut self, seed: u64) {
        self.weights.set_dropout_seed(seed);
        self.weights.set_layer_dropout_seed(seed);
    }

    fn set_batch_norm_sync(&mut self, reducer: Option<Arc<dyn Reducer>>) -> Result<()> {
        self.weights
            .set_batch_norm_sync(reducer.map(ReducerHandle::new))
    }

    fn backward_groups(&self) -> Vec<Range<usize>> {
        self.groups.iter().rev().map(|g| g.params.clone()).collect()
    }

    fn apply_grads(&mut self, grads: &[f32], lr: f64) -> Result<()> {
        self.weights.step(grads, lr)?;
        self.grads.clear();
        Ok(())
    }

    fn drop_grads(&mut self) {
        self.grads.clear();
    }

    fn set_recompute(&mut self, on: bool) -> Result<()> {
        if !on {
            self.recompute = None;
            return Ok(());
        }
        self.grads.clear();
        self.recompute = Some(backward_groups::plan(&self.spec, &self.layers, 1)?);
        Ok(())
    }

    fn set_reshard_after_forward(&mut self, on: bool) -> Result<()> {
        self.keep_gathered = !on;
        Ok(())
    }

    fn release_params(&mut self) -> Result<()> {
        self.grads.clear();
        self.weights.release()
    }

    fn forward_backward_sharded(
        &mut self,
        batch: BatchRef<'_>,
        pass: &mut dyn ShardedPass,
    ) -> Result<f32> {
        let n = self.check_batch(batch.images, batch.labels)?;
        if n == 0 {
            return Err(EngineError::Batch("empty batch".into()));
        }
        self.grads.clear();
        let device = self.weights.device.clone();
        let input = Activation::from_flat(batch.images.to_vec(), n, self.input, &device);
        let targets = labels_tensor(batch.labels, &device);
        let loss = &self.loss;
        let (model, layout) = self.weights.released_model()?;
        sharded::forward_backward(
            model,
            layout,
            &self.groups,
            (input, self.keep_gathered),
            |logits| loss.forward(logits, targets),
            pass,
        )
    }

    fn evaluate_sharded(
        &mut self,
        images: &[f32],
        labels: &[i64],
        pass: &mut dyn ShardedPass,
    ) -> Result<EvalStats> {
        let n = self.check_batch(images, labels)?;
        let device = self.weights.base_device.clone();
        let input = (n > 0).then(|| Activation::from_flat(images.to_vec(), n, self.input, &device));
        let (model, layout) = self.weights.released_model()?;
        let logits = sharded::logits(model, layout, &self.groups, input, pass)?;
        let counts = (n, self.input.numel(), self.labels_per_sample);
        Ok(stats_of_logits(images, labels, counts, &device, logits))
    }

    fn evaluate(&self, images: &[f32], labels: &[i64], batch_size: usize) -> Result<EvalStats> {
        let n = self.check_batch(images, labels)?;
        let model = self.model()?.valid();
        let device = &self.weights.base_device;
        let counts = (n, self.input.numel(), self.labels_per_sample);
        Ok(evaluate_in_chunks(
            images,
            labels,
            counts,
            batch_size,
            device,
            |x, k| self.logits(&model, x, k, device),
        ))
    }
}

/// Evaluation totals of the `counts.0` samples of `images` and `labels` from their logits,
/// computed in one piece (`None`: no samples, zeros): a sharded evaluation's.
pub(crate) fn stats_of_logits(
    images: &[f32],
    labels: &[i64],
    counts: (usize, usize, usize),
    device: &Device,
    logits: Option<Tensor<2>>,
) -> EvalStats {
    let Some(logits) = logits else {
        return EvalStats::default();
    };
    evaluate_in_chunks(images, labels, counts, counts.0, device, |_, _| {
        logits.clone()
    })
}

/// Evaluation totals of `n` samples (`per` input values and `lps` labels each) in chunks of
/// `batch_size`, from `logits(inputs, samples)`: one row per label. Both engines' evaluation.
pub(crate) fn evaluate_in_chunks(
    images: &[f32],
    labels: &[i64],
    (n, per, lps): (usize, usize, usize),
    batch_size: usize,
    device: &Device,
    logits: impl Fn(&[f32], usize) -> Tensor<2>,
) -> EvalStats {
    let loss_fn = CrossEntropyLossConfig::new().init(device);
    let mut stats = EvalStats::default();
    for start in (0..n).step_by(batch_size.max(1)) {
        let end = (start + batch_size.max(1)).min(n);
        // One row of logits per label: per sample, or per position.
        let rows = (end - start) * lps;
        let out = logits(&images[start * per..end * per], end - start);
        let targets = labels_tensor(&labels[start * lps..end * lps], device);
        let predicted = out.clone().argmax(1).reshape([rows]);
        let correct = predicted.equal(targets.clone()).int().sum();
        let loss = loss_fn.forward(out, targets).into_scalar::<f32>();
        stats.correct += correct.into_scalar::<i64>() as usize;
        stats.loss_sum += loss as f64 * rows as f64;
        stats.count += rows;
    }
    stats
}
