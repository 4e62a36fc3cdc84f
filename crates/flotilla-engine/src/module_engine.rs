//! [`ModuleEngine`]: the [`Engine`] of a burn user's own module, so that every way of training
//! written against the engine (flotilla-train's strategies and run loop) trains a user's model
//! as it trains a spec's. The user's module says how it turns a batch into a loss and logits
//! ([`TrainModule`]); parameters, buffers, optimizer state and weight files go through the
//! same [`Weights`] as a spec model's, and its gradients through the same flat views.

use std::ops::Range;
use std::sync::Arc;

use burn::module::Module;
use burn::prelude::*;

use burn::nn::loss::CrossEntropyLossConfig;

use crate::collective::Reducer;
use crate::device::device_by_name;
use crate::engine::{
    BatchRef, Engine, EvalStats, evaluate_in_chunks, labels_tensor, stats_of_logits,
};
use crate::error::{EngineError, Result};
use crate::grouped::{self, GroupGrads};
use crate::module_blocks::Blocks;
use crate::module_blocks_pass::{self, OwnParams};
use crate::optim::OptimizerSpec;
use crate::params::{self, ParamLayout};
use crate::pipeline::module_stage::StageBuilder;
use crate::sharded::{ShardSink, ShardedPass};
use crate::spec::activation::Activation;
use crate::spec::shape::Shape;
use crate::weights::{ModelState, Weights, delegate_model_state};

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

/// A user's module as an [`Engine`]: one backward pass per batch, burn's optimizer of an
/// [`OptimizerSpec`] on the flat gradients a strategy hands it.
///
/// burn runs a module's backward in one pass (it offers no hook when a gradient is ready),
/// so nothing is handed on before it ends; after it, the gradients are handed on in groups
/// of about the strategy's bucket size ([`Engine::set_backward_group_bytes`]), last layer
/// first, so that a bucket's all-reduce starts while the next is copied out.
pub struct ModuleEngine<M: TrainModule> {
    weights: Weights<M>,
    /// The gradients of the last backward (empty: none).
    grads: Vec<GroupGrads>,
    /// The groups the gradients are handed on in, in that order (last layers first).
    groups: Vec<Range<usize>>,
    /// The module as its blocks, which ZeRO-3 gathers one at a time (`None`: not given; the
    /// module trains whole only).
    blocks: Option<Blocks>,
    /// Labels per sample (the module's, read once: a released module answers nothing).
    labels_per_sample: usize,
    /// Whether a training pass runs the blocks, each recomputed in backward
    /// ([`Engine::set_recompute`]).
    recompute: bool,
    /// Whether a sharded pass keeps each block's gathered parameters from its forward to its
    /// backward ([`Engine::set_reshard_after_forward`] false).
    keep_gathered: bool,
    /// The gradients of the last recomputing pass, flat (empty: none).
    flat_grads: Vec<f32>,
}

delegate_model_state!([M: TrainModule] ModuleEngine<M>);

impl<M: TrainModule> ModuleEngine<M> {
    /// `model` trained on the named device (`flex`, `wgpu`, ...: its parameters are moved
    /// there, as fresh leaves numbered by position) with the optimizer of `optimizer`.
    pub fn new(model: M, optimizer: &OptimizerSpec, device_name: &str) -> Result<Self> {
        let base_device = device_by_name(device_name)?;
        // burn draws a lazily initialised parameter's values at its first use, from the
        // backend's process-wide RNG: drawn here under the lock that seeded builds hold, so
        // that a model built meanwhile in another thread still depends on its seed alone.
        let model = crate::rng::under_rng_lock(|| crate::weights::materialized(model))?;
        // `train()`: a module built on a plain device gets its parameters' configured
        // gradient tracking back on the autodiff one (a frozen parameter stays frozen).
        let model = params::renumber(model.fork(&base_device.clone().autodiff()).train());
        let labels_per_sample = model.labels_per_sample();
        let weights = Weights::of_module(model, optimizer, base_device, true)?;
        Ok(Self {
            groups: layer_groups(&weights.layout, 0),
            // A user's module may draw dropout masks: seeded like a spec model's.
            weights,
            grads: Vec::new(),
            blocks: None,
            labels_per_sample,
            recompute: false,
            keep_gathered: false,
            flat_grads: Vec::new(),
        })
    }

    /// ZeRO-3's engine of a user's module, which never holds the whole module: `build`'s
    /// module, its parameters drawn from `seed` one tensor at a time (the values of
    /// [`ModuleEngine::seeded`]), each handed to `sink` and released; run as its `blocks`
    /// (the program's stage modules, in order, which together hold the module's parameters
    /// in its flat order; `input`: one sample of the batch's inputs, which the first takes),
    /// which are its backward groups and which `sink` learns first.
    pub fn released(
        build: impl FnOnce(&Device) -> M,
        (blocks, input): (&[StageBuilder], Shape),
        optimizer: &OptimizerSpec,
        (device_name, seed): (&str, u64),
        sink: &mut dyn ShardSink,
    ) -> Result<Self> {
        let base_device = device_by_name(device_name)?;
        let blocks = blocks_of(blocks, input, &base_device.clone().autodiff())?;
        let groups = |layout: &ParamLayout| {
            blocks.check(layout)?;
            Ok(blocks.groups())
        };
        let mut weights =
            Weights::new_released_module(build, optimizer, (base_device, seed), groups, sink)?;
        blocks.check_buffers(weights.buffer_layout())?;
        let (model, _) = weights.released_model()?;
        let labels_per_sample = model.as_ref().map_or(1, TrainModule::labels_per_sample);
        Ok(Self {
            groups: blocks.groups(),
            weights,
            grads: Vec::new(),
            blocks: Some(blocks),
            labels_per_sample,
            recompute: false,
            keep_gathered: false,
            flat_grads: Vec::new(),
        })
    }

    /// `self` run as `blocks` (see [`ModuleEngine::released`]), which become its backward
    /// groups: a whole module whose parameters a resumed ZeRO-3 run shards, or that
    /// recomputes each block's forward in backward ([`Engine::set_recompute`]).
    pub fn with_blocks(mut self, (blocks, input): (&[StageBuilder], Shape)) -> Result<Self> {
        let blocks = blocks_of(blocks, input, &self.weights.device)?;
        blocks.check(&self.weights.layout)?;
        blocks.check_buffers(self.weights.buffer_layout())?;
        self.groups = blocks.groups();
        self.blocks = Some(blocks);
        Ok(self)
    }

    /// The module `build` makes with the backend's RNG seeded with `seed` (on the CPU, then
    /// moved to the named device), as a spec's model is drawn: the same initial parameters
    /// on every rank that builds it with the same seed, without a broadcast.
    pub fn seeded(
        build: impl FnOnce(&Device) -> M,
        seed: u64,
        optimizer: &OptimizerSpec,
        device_name: &str,
    ) -> Result<Self> {
        let model = crate::weights::seeded_module(seed, |cpu| Ok(build(cpu)))?;
        Self::new(model, optimizer, device_name)
    }

    /// The module with its current parameters (on the training device).
    pub fn module(&self) -> Result<&M> {
        self.weights.model()
    }
}

impl<M: TrainModule> Engine for ModuleEngine<M> {
    fn forward_backward(&mut self, batch: BatchRef<'_>) -> Result<f32> {
        if self.recompute {
            return self.recomputed(batch, &mut |_, _| Ok(()));
        }
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

    fn backward_groups(&self) -> Vec<Range<usize>> {
        self.groups.clone()
    }

    fn set_backward_group_bytes(&mut self, max_bytes: usize) -> Result<()> {
        // A module run as its blocks keeps them as its groups.
        if self.blocks.is_none() {
            self.groups = layer_groups(&self.weights.layout, max_bytes);
        }
        Ok(())
    }

    fn forward_backward_streaming(
        &mut self,
        batch: BatchRef<'_>,
        ready: &mut dyn FnMut(usize, &[f32]) -> Result<()>,
    ) -> Result<f32> {
        if self.recompute {
            return self.recomputed(batch, ready);
        }
        let loss = self.forward_backward(batch)?;
        // Read group by group from the one backward's gradients, no copy in between.
        let (model, layout) = (self.weights.model()?, &self.weights.layout);
        let grads = self.grads.first().and_then(|g| g.grads.as_ref());
        for group in &self.groups {
            params::for_each_grad_in(model, grads, layout, group.clone(), ready)?;
        }
        Ok(loss)
    }

    fn labels_per_sample(&self) -> usize {
        self.labels_per_sample
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
        if !self.flat_grads.is_empty() {
            for (i, p) in self.weights.layout.params.iter().enumerate() {
                f(i, &self.flat_grads[p.offset..p.offset + p.len])?;
            }
            return Ok(());
        }
        let grads = (self.grads.as_slice(), None);
        grouped::for_each_grad(self.weights.model()?, &self.weights.layout, grads, f)
    }

    fn apply_grads(&mut self, grads: &[f32], lr: f64) -> Result<()> {
        self.weights.step(grads, lr)?;
        self.drop_grads();
        Ok(())
    }

    fn drop_grads(&mut self) {
        self.grads.clear();
        self.flat_grads = Vec::new();
    }

    fn set_reshard_after_forward(&mut self, on: bool) -> Result<()> {
        self.keep_gathered = !on;
        Ok(())
    }

    fn set_recompute(&mut self, on: bool) -> Result<()> {
        if on {
            let blocks = self.blocks.as_ref().ok_or_else(|| {
                EngineError::Recompute(
                    "a program's own module recomputes by its stage modules: give them \
                     (flotilla_burn::UserModule::with_stages)"
                        .into(),
                )
            })?;
            blocks.check(&self.weights.layout)?;
            self.groups = blocks.groups();
        }
        self.drop_grads();
        self.recompute = on;
        Ok(())
    }

    fn release_params(&mut self) -> Result<()> {
        self.blocks()?;
        self.grads.clear();
        self.weights.release()
    }

    fn forward_backward_sharded(
        &mut self,
        batch: BatchRef<'_>,
        pass: &mut dyn ShardedPass,
    ) -> Result<f32> {
        let (input, targets) = self.blocks_batch(batch)?;
        self.grads.clear();
        self.weights.released_model()?;
        self.buffers_to_blocks()?;
        let blocks = self.blocks.as_mut().ok_or_else(no_blocks)?;
        let loss = CrossEntropyLossConfig::new().init(&self.weights.device);
        let loss = |logits| loss.forward(logits, targets);
        let input = (input, self.keep_gathered);
        let value = module_blocks_pass::forward_backward(blocks, &self.weights, input, loss, pass)?;
        self.buffers_from_blocks()?;
        Ok(value)
    }

    fn evaluate_sharded(
        &mut self,
        images: &[f32],
        labels: &[i64],
        pass: &mut dyn ShardedPass,
    ) -> Result<EvalStats> {
        let n = self.samples(images, labels)?;
        self.weights.released_model()?;
        self.buffers_to_blocks()?;
        let device = self.weights.base_device.clone();
        let blocks = self.blocks.as_mut().ok_or_else(no_blocks)?;
        let input =
            (n > 0).then(|| Activation::from_flat(images.to_vec(), n, blocks.input, &device));
        let logits = module_blocks_pass::logits(blocks, input, pass)?;
        let counts = (n, blocks.input.numel(), self.labels_per_sample);
        Ok(stats_of_logits(images, labels, counts, &device, logits))
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

impl<M: TrainModule> ModuleEngine<M> {
    /// A training pass through the blocks on the module's own parameters, each block's
    /// forward recomputed in backward (`recompute: true`): its gradients kept flat and handed
    /// to `ready` block by block from the last.
    fn recomputed(
        &mut self,
        batch: BatchRef<'_>,
        ready: &mut dyn FnMut(usize, &[f32]) -> Result<()>,
    ) -> Result<f32> {
        let (input, targets) = self.blocks_batch(batch)?;
        self.drop_grads();
        self.buffers_to_blocks()?;
        let blocks = self.blocks.as_mut().ok_or_else(no_blocks)?;
        let loss = CrossEntropyLossConfig::new().init(&self.weights.device);
        let loss = |logits| loss.forward(logits, targets);
        let layout = &self.weights.layout;
        let mut grads = vec![0.0; layout.total];
        let mut own = OwnParams {
            model: self.weights.model()?,
            layout,
            grads: &mut grads,
            ready,
        };
        let input = (input, false);
        let value =
            module_blocks_pass::forward_backward(blocks, &self.weights, input, loss, &mut own)?;
        self.flat_grads = grads;
        self.buffers_from_blocks()?;
        Ok(value)
    }

    /// The module's buffers (batch norm's running statistics) into its blocks, before a pass
    /// runs them: what evaluation, the ranks' average or a resume wrote into the module.
    /// Free without buffers.
    fn buffers_to_blocks(&mut self) -> Result<()> {
        let blocks = self.blocks.as_mut().ok_or_else(no_blocks)?;
        if !blocks.has_buffers() {
            return Ok(());
        }
        let mut values = vec![0.0; self.weights.buffer_layout().total];
        self.weights.read_buffers(&mut values)?;
        blocks.load_buffers(&values)
    }

    /// The blocks' buffers back into the module after a training pass updated them: the
    /// module's are what evaluation, the ranks' average and checkpoints read.
    fn buffers_from_blocks(&mut self) -> Result<()> {
        let blocks = self.blocks.as_ref().ok_or_else(no_blocks)?;
        if !blocks.has_buffers() {
            return Ok(());
        }
        let mut values = vec![0.0; self.weights.buffer_layout().total];
        blocks.store_buffers(&mut values)?;
        self.weights.write_buffers(&values)
    }

    /// A training batch as the blocks take it: its inputs and labels on the training device;
    /// refused when empty or not whole samples.
    fn blocks_batch(&self, batch: BatchRef<'_>) -> Result<(Activation, Tensor<1, Int>)> {
        let n = self.samples(batch.images, batch.labels)?;
        if n == 0 {
            return Err(EngineError::Batch("empty batch".into()));
        }
        let device = &self.weights.device;
        let input = Activation::from_flat(batch.images.to_vec(), n, self.blocks()?.input, device);
        Ok((input, labels_tensor(batch.labels, device)))
    }

    /// The blocks, or the refusal of a module given without them.
    fn blocks(&self) -> Result<&Blocks> {
        self.blocks.as_ref().ok_or_else(no_blocks)
    }

    /// The samples of a batch of `images` and `labels` run as the blocks (none: zero),
    /// refused when they are not whole samples of the blocks' input.
    fn samples(&self, images: &[f32], labels: &[i64]) -> Result<usize> {
        let per = self.blocks()?.input.numel();
        let lps = self.labels_per_sample;
        let n = labels.len() / lps;
        if labels.len() != n * lps || images.len() != n * per {
            return Err(EngineError::Batch(format!(
                "{} inputs and {} labels are not samples of {per} inputs and {lps} labels",
                images.len(),
                labels.len()
            )));
        }
        Ok(n)
    }
}

/// The blocks `builders` make on `device` (an autodiff device), none of their parameters
/// drawn; `input` is one sample's shape.
fn blocks_of(builders: &[StageBuilder], input: Shape, device: &Device) -> Result<Blocks> {
    // Under the RNG's lock: a module that draws as it is built still leaves the seeded draws
    // of other threads alone.
    let blocks = crate::rng::under_rng_lock(|| {
        builders
            .iter()
            .map(|build| build(device).into_block())
            .collect::<Result<Vec<_>>>()
    })?;
    Blocks::new(blocks, input)
}

/// Why a module given without its blocks cannot shard its parameters.
fn no_blocks() -> EngineError {
    EngineError::ParamsSharded(
        "ZeRO stage 3 runs a program's own module as its blocks, one gathered at a time: give \
         them as its stage modules (flotilla_burn::UserModule::with_stages), or use zero 2 or \
         less"
            .into(),
    )
}

/// The parameters of `layout` in groups of about `max_bytes` (4 per value), last layer
/// first: a layer's tensors (those of one name prefix, `fc1.weight` and `fc1.bias`) stay
/// together, a layer larger than `max_bytes` is a group of its own; `0` or `usize::MAX`:
/// one group. The rule of a spec model's backward groups, with a module's layers as its
/// segments; the gradient buckets of every user module (the run's and `DataParallel`'s).
pub fn layer_groups(layout: &ParamLayout, max_bytes: usize) -> Vec<Range<usize>> {
    let n = layout.params.len();
    if max_bytes == 0 || max_bytes == usize::MAX || n == 0 {
        return std::iter::once(0..n).collect();
    }
    let prefix = |i: usize| {
        let name = &layout.params[i].name;
        name.rsplit_once('.').map_or(name.as_str(), |(p, _)| p)
    };
    let mut groups = Vec::new();
    let (mut end, mut bytes) = (n, 0usize);
    let mut i = n;
    while i > 0 {
        // The layer ending at `i`: the tensors before it of the same prefix.
        let mut start = i - 1;
        while start > 0 && prefix(start - 1) == prefix(i - 1) {
            start -= 1;
        }
        let layer: usize = layout.params[start..i].iter().map(|p| 4 * p.len).sum();
        if bytes > 0 && bytes + layer > max_bytes {
            groups.push(i..end);
            (end, bytes) = (i, 0);
        }
        bytes += layer;
        i = start;
    }
    groups.push(0..end);
    groups
}
