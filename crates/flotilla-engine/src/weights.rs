//! A model's parameters and optimizer, seen as flat buffers: the [`ModelState`] trait that a
//! whole-model engine and a pipeline stage share, and the burn state behind both. Its batch
//! norms' running statistics are a second flat view, of buffers (see [`crate::buffers`]).
//!
//! burn keeps a running statistic's last update pending (per thread) until the next update or
//! until the model is made `valid()`; every read of the buffers (and the weights saved) goes
//! through `valid()`, which settles it, so that they are the statistics of every forward pass
//! so far.

use std::ops::Range;
use std::path::Path;

use burn::optim::ModuleOptimizer;
use burn::prelude::*;

use crate::any_module;
use crate::backward_groups::{self, BackwardGroup, LayerParams};
use crate::buffers::Tensors;
use crate::collective::ReducerHandle;
use crate::device::device_by_name;
use crate::device::placement::ParamPlacement;
use crate::error::{EngineError, Result};
use crate::optim::OptimizerSpec;
use crate::optim::state_check::{Expected, check_state_shapes};
use crate::params::{self, ParamLayout};
use crate::rng::{RNG_LOCK, mask_seed};
use crate::sharded::ShardSink;
use crate::spec::ModelSpec;
use crate::spec::model::{Identity, Layer, SequentialModel};
use crate::weights_writer::WeightsPlan;

/// The model of `spec` with its initial parameters, drawn on the CPU (Flex) from `seed`
/// whatever the device training runs on, so that every backend starts from the same values.
pub(crate) fn initial_model(spec: &ModelSpec, seed: u64) -> Result<SequentialModel> {
    seeded_module(seed, |cpu| SequentialModel::new(spec, cpu))
}

/// The module `build` makes on the CPU (Flex) with the backend's RNG seeded with `seed`, its
/// parameters numbered by position and every lazily initialised one materialised, in flat
/// order: the same values for the same seed on every rank and backend (a spec's model and a
/// user's module alike).
pub(crate) fn seeded_module<M: Module>(
    seed: u64,
    build: impl FnOnce(&Device) -> Result<M>,
) -> Result<M> {
    seeded(seed, |cpu| materialized(build(cpu)?))
}

/// What `draw` makes on the CPU (Flex) with the backend's RNG seeded with `seed`, drawing
/// nothing else meanwhile: the backend's RNG may be process-wide, so seeding and drawing the
/// initial values happen under one lock, and models built concurrently still depend on
/// their seed alone.
pub(crate) fn seeded<T>(seed: u64, draw: impl FnOnce(&Device) -> Result<T>) -> Result<T> {
    let cpu = Device::flex().autodiff();
    let _guard = RNG_LOCK
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    cpu.seed(seed);
    draw(&cpu)
}

/// `model` with its parameters numbered by position and every lazily initialised one
/// materialised now, in flat order, so that the values depend on the seed alone and not on
/// the order of first use.
pub(crate) fn materialized<M: Module>(model: M) -> Result<M> {
    let model = params::renumber(model);
    let layout = ParamLayout::of(&model);
    let mut scratch = vec![0.0; layout.total];
    params::read_values(&model, &layout, &mut scratch, Tensors::Params)?;
    Ok(model)
}

/// How a released model's groups are made of its layers' parameters: their parameter
/// ranges in the order a pass reduces them (the last first), as a [`ShardSink`] plans them.
pub(crate) type ReadyGroups<'a> = dyn Fn(&[LayerParams]) -> Result<Vec<Range<usize>>> + 'a;

/// Parameters, optimizer state and weight files, as flat buffers in the order of
/// [`ModelState::layout`]. Implemented by the whole-model [`crate::BurnEngine`] and by a
/// pipeline [`crate::Stage`] (which holds only its own layers' parameters).
pub trait ModelState {
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

    /// The optimizer state as bytes (burn's burnpack format), keyed by parameter position.
    fn optimizer_state(&self) -> Result<Vec<u8>>;

    /// Restores optimizer state written by [`ModelState::optimizer_state`]; state whose
    /// tensors do not have the shapes of this model's parameters is refused with
    /// [`crate::EngineError::StateShape`] before burn sees it.
    fn load_optimizer_state(&mut self, bytes: &[u8]) -> Result<()>;

    /// Writes the parameters as safetensors in PyTorch's layout (linear weights `[out, in]`,
    /// names `layers.<i>.weight`).
    fn save_weights(&self, path: &Path) -> Result<()>;

    /// Reads parameters written by [`ModelState::save_weights`] (or by PyTorch, same names).
    /// Tensors in the file that this model does not have are ignored; a tensor the model has
    /// and the file lacks is an error.
    fn load_weights(&mut self, path: &Path) -> Result<()>;

    /// [`ModelState::save_weights`] into memory: the bytes of the file it would write (what
    /// travels between ranks, never through a shared directory).
    fn weights_bytes(&self) -> Result<Vec<u8>>;

    /// [`ModelState::load_weights`] from the bytes of a safetensors file.
    fn load_weights_bytes(&mut self, bytes: &[u8]) -> Result<()>;

    /// Where the parameter tensors are, read from the tensors themselves (each one's
    /// `Tensor::device()`, the device of its backend primitive), not from the device name the
    /// model was built for: the evidence that training runs on the backend it was asked for.
    /// `None` for a model without parameters (a stage of parameterless layers);
    /// [`crate::EngineError::MixedDevices`] when the tensors are not all on one device.
    fn param_placement(&self) -> Result<Option<ParamPlacement>>;

    /// Where each buffer lives in the flat buffer view: the running statistics of every batch
    /// norm (`layers.<i>.running_mean`, `layers.<i>.running_var`), in layer order. They are
    /// not parameters (no gradient, no optimizer state) and each rank's forward passes update
    /// its own; a strategy averages them across ranks (or takes rank 0's) before evaluation
    /// and checkpoints. Empty for a model without batch norm.
    fn buffer_layout(&self) -> &ParamLayout;

    /// Copies the buffers into `out` (the order of [`ModelState::buffer_layout`]). Also on a
    /// model whose parameters are released (ZeRO-3): its buffers are never released.
    fn read_buffers(&self, out: &mut [f32]) -> Result<()>;

    /// Replaces the buffers with `src` (the order of [`ModelState::buffer_layout`]), released
    /// parameters or not.
    fn write_buffers(&mut self, src: &[f32]) -> Result<()>;

    /// The layout of the file [`ModelState::save_weights`] writes (its header and each
    /// tensor's place), from the model's structure alone: the parameters may be released
    /// (ZeRO-3 writes it piece by piece as they are gathered). Its tensors are the parameters
    /// in flat order, then the buffers in theirs (tensor `params.len() + j` is buffer `j` of
    /// [`ModelState::buffer_layout`]). A model that is not burn's is refused.
    fn weights_plan(&self) -> Result<WeightsPlan> {
        Err(EngineError::ParamsSharded(
            "this model writes its weights whole only".into(),
        ))
    }
}

/// The burn state behind a [`ModelState`]: the model (or a stage's part of it), its optimizer
/// and its flat layout. `M` is the spec's [`SequentialModel`] or a user's own module
/// ([`crate::ModuleEngine`]): one implementation of the flat view for both.
pub(crate) struct Weights<M: Module = SequentialModel> {
    /// The autodiff device training runs on.
    pub(crate) device: Device,
    /// The same device without autodiff (evaluation, gradients handed to the optimizer).
    pub(crate) base_device: Device,
    model: Option<M>,
    optimizer: ModuleOptimizer,
    pub(crate) layout: ParamLayout,
    /// The layout of the buffers (batch norm's running statistics).
    buffer_layout: ParamLayout,
    /// Whether the model may draw dropout masks (a spec's dropout layer with `p > 0`; any
    /// user module).
    has_dropout: bool,
    /// The seed each training forward pass re-seeds the RNG with, once set.
    dropout_seed: Option<u64>,
    /// Safetensors metadata written with the weights (a spec model's spec first).
    metadata: Vec<(String, String)>,
    /// Whether the parameters are released (ZeRO-3: the model's parameter tensors are
    /// empty between the uses of a group's; [`Weights::release`]).
    released: bool,
}

impl Weights<SequentialModel> {
    /// Builds the model of `spec` on the named backend with parameters initialised from
    /// `seed` (on the CPU, then moved to the device: the same values on every backend). With
    /// `keep`, only the layers in that range keep their parameters (the others become
    /// identities), so a stage's parameters have the same names and initial values as the
    /// same layers of the whole model built from the same seed.
    pub(crate) fn new(
        spec: &ModelSpec,
        optimizer: &OptimizerSpec,
        device_name: &str,
        seed: u64,
        keep: Option<Range<usize>>,
    ) -> Result<Self> {
        let base_device = device_by_name(device_name)?;
        let device = base_device.clone().autodiff();
        // A fresh leaf on the device for every parameter, still requiring its gradient.
        let model = match keep {
            None => initial_model(spec, seed)?.fork(&device),
            Some(range) => params::renumber(stage_model(spec, seed, range)?.fork(&device)),
        };
        let has_dropout = model
            .layers
            .iter()
            .any(|layer| matches!(layer, Layer::Dropout(d) if d.prob > 0.0));
        let weights = Weights::of_module(model, optimizer, base_device, has_dropout)?;
        Ok(weights.with_metadata("flotilla.model", spec.to_yaml()))
    }

    /// The weights of the layers `part` of `model` (a model of `spec`, its other layers
    /// identities or not), the other layers identities, on the named backend: their
    /// parameters `model`'s own tensors, shared rather than copied, so that the stages a
    /// profile times over one window of the model (`pipeline/profile.rs`) hold its values
    /// once.
    pub(crate) fn part_of(
        model: &SequentialModel,
        spec: &ModelSpec,
        optimizer: &OptimizerSpec,
        device_name: &str,
        part: Range<usize>,
    ) -> Result<Self> {
        let base_device = device_by_name(device_name)?;
        let device = base_device.clone().autodiff();
        let mut model = model.clone();
        for (i, slot) in model.layers.iter_mut().enumerate() {
            if !part.contains(&i) {
                *slot = Layer::Identity(Identity);
            }
        }
        let model = params::renumber(model).fork(&device);
        let has_dropout =
            (model.layers.iter()).any(|layer| matches!(layer, Layer::Dropout(d) if d.prob > 0.0));
        let weights = Weights::of_module(model, optimizer, base_device, has_dropout)?;
        Ok(weights.with_metadata("flotilla.model", spec.to_yaml()))
    }

    /// ZeRO-3's start without the whole model: the model of `spec` with the parameters
    /// [`Weights::new`] draws from `seed` (the same values, drawn in the same order), drawn
    /// one layer at a time, each layer's handed to `sink` and released at once, so that no
    /// more than one layer's values exist at a time. `sink` learns the layout and the
    /// backward groups of at most `group_bytes` first. Returns the released weights, each
    /// layer's parameters and the groups (layer order).
    pub(crate) fn new_released(
        spec: &ModelSpec,
        optimizer: &OptimizerSpec,
        (device_name, seed): (&str, u64),
        group_bytes: usize,
        sink: &mut dyn ShardSink,
    ) -> Result<(Self, Vec<LayerParams>, Vec<BackwardGroup>)> {
        let ready = |layers: &[LayerParams]| -> Result<Vec<Range<usize>>> {
            let groups = backward_groups::plan(spec, layers, group_bytes)?;
            Ok(groups.iter().rev().map(|g| g.params.clone()).collect())
        };
        let all = 0..spec.layers.len();
        let (mut weights, layers) =
            Self::drawn_released(spec, optimizer, (device_name, seed), all, &ready, sink)?;
        // The whole model's dropout layers draw under the RNG's lock each (`recompute.rs`).
        weights.has_dropout = false;
        let groups = backward_groups::plan(spec, &layers, group_bytes)?;
        Ok((weights, layers, groups))
    }

    /// The released weights of `spec`'s layers `keep` (the others identities, as
    /// [`Weights::new`] keeps a stage's): every layer's parameters drawn from `seed` in
    /// turn, one layer's values at a time, those of `keep` handed to `sink` and released at
    /// once, the others dropped. `sink` first learns the kept model's layout and its groups,
    /// as `ready` makes them of its layers' parameters. Returns the weights and each
    /// layer's parameters (none outside `keep`).
    pub(crate) fn drawn_released(
        spec: &ModelSpec,
        optimizer: &OptimizerSpec,
        (device_name, seed): (&str, u64),
        keep: Range<usize>,
        ready: &ReadyGroups<'_>,
        sink: &mut dyn ShardSink,
    ) -> Result<(Self, Vec<LayerParams>)> {
        let base_device = device_by_name(device_name)?;
        let device = base_device.clone().autodiff();
        let (model, layout, layers) = seeded(seed, |cpu| {
            // burn draws a parameter at its first use: building the model draws nothing.
            let mut model = SequentialModel::new(spec, cpu)?;
            let mut aside: Vec<Option<Layer>> = (model.layers.iter_mut().enumerate())
                .map(|(i, slot)| {
                    (!keep.contains(&i)).then(|| std::mem::replace(slot, Layer::Identity(Identity)))
                })
                .collect();
            let layout = ParamLayout::of(&model);
            let layers = backward_groups::layer_params(&model);
            sink.plan(&layout, &ready(&layers)?)?;
            let mut first = 0;
            for (slot, aside) in model.layers.iter_mut().zip(&mut aside) {
                if let Some(layer) = aside.take() {
                    // Another stage's: drawn in its turn, as the whole model's, and dropped.
                    let local = ParamLayout::of(&layer);
                    let mut values = vec![0.0; local.total];
                    params::read_values(&layer, &local, &mut values, Tensors::Params)?;
                    continue;
                }
                let layer = std::mem::replace(slot, Layer::Identity(Identity));
                let local = ParamLayout::of(&layer);
                let mut values = vec![0.0; local.total];
                // Drawn here, in flat order, as `materialized` draws the whole model's.
                params::read_values(&layer, &local, &mut values, Tensors::Params)?;
                for (j, p) in local.params.iter().enumerate() {
                    sink.values(first + j, &values[p.offset..p.offset + p.len])?;
                }
                first += local.params.len();
                let all = 0..local.params.len();
                *slot = params::write_range(layer, &local, all, None, false)?;
            }
            Ok((model, layout, layers))
        })?;
        let model = params::renumber(model).fork(&device);
        let has_dropout =
            (model.layers.iter()).any(|layer| matches!(layer, Layer::Dropout(d) if d.prob > 0.0));
        let mut weights = Weights::of_module(model, optimizer, base_device, has_dropout)?;
        weights.layout = layout;
        weights.released = true;
        Ok((
            weights.with_metadata("flotilla.model", spec.to_yaml()),
            layers,
        ))
    }

    /// Makes every batch norm train with the statistics of every rank of `reducer` (`None`:
    /// each rank's own batch).
    pub(crate) fn set_batch_norm_sync(&mut self, reducer: Option<ReducerHandle>) -> Result<()> {
        let model = self.model.as_mut().ok_or(EngineError::ModelUnavailable)?;
        model.batch_norm_sync = reducer;
        Ok(())
    }

    /// Makes every dropout layer draw its mask from the RNG re-seeded for `seed` and its
    /// index ([`SequentialModel::dropout_seed`]), released or not.
    pub(crate) fn set_layer_dropout_seed(&mut self, seed: u64) {
        if let Some(model) = self.model.as_mut() {
            model.dropout_seed = Some(seed);
        }
    }

    /// The error a synchronized batch norm's sum met in the last pass, if any.
    pub(crate) fn batch_norm_sync_result(&self) -> Result<()> {
        let failed = self
            .model()?
            .batch_norm_sync
            .as_ref()
            .and_then(|r| r.take_error());
        failed.map_or(Ok(()), |e| Err(EngineError::BatchNormSync(e)))
    }
}

impl<M: Module> Weights<M> {
    /// `model`, already on `base_device`'s autodiff twin (its parameters leaves that require
    /// their gradients, ids numbered by position), with the optimizer of `optimizer`.
    pub(crate) fn of_module(
        model: M,
        optimizer: &OptimizerSpec,
        base_device: Device,
        has_dropout: bool,
    ) -> Result<Self> {
        let optimizer = optimizer.build(&model)?;
        Ok(Self {
            device: base_device.clone().autodiff(),
            base_device,
            layout: ParamLayout::of(&model),
            buffer_layout: ParamLayout::of_tensors(&model, Tensors::Buffers),
            model: Some(model),
            optimizer,
            has_dropout,
            dropout_seed: None,
            metadata: Vec::new(),
            released: false,
        })
    }

    /// Makes every following training forward pass re-seed the RNG with `seed` before it
    /// draws its dropout masks (see [`crate::Engine::set_dropout_seed`]).
    pub(crate) fn set_dropout_seed(&mut self, seed: u64) {
        self.dropout_seed = Some(seed);
    }

    /// Runs `forward` (a training forward pass) holding the RNG, re-seeded with the dropout
    /// seed if one was set, when the model draws dropout masks: then the masks depend on the
    /// seed alone, even with other models drawing in other threads.
    pub(crate) fn with_dropout_rng<T>(&self, forward: impl FnOnce() -> T) -> T {
        if !self.has_dropout {
            return forward();
        }
        let _guard = RNG_LOCK
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(seed) = self.dropout_seed {
            self.device.seed(seed);
        }
        forward()
    }

    /// Runs `forward` (block `block`'s training forward, a user's module run as its blocks:
    /// ZeRO-3, recomputation) holding the RNG, re-seeded for that block from the dropout seed
    /// (0 until one is set), when the model may draw dropout masks: a block's recomputed
    /// forward draws the masks its first one drew.
    pub(crate) fn with_block_rng<T>(&self, block: usize, forward: impl FnOnce() -> T) -> T {
        if !self.has_dropout {
            return forward();
        }
        let _guard = RNG_LOCK
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        self.device
            .seed(mask_seed(self.dropout_seed.unwrap_or(0), block));
        forward()
    }

    /// ZeRO-3's start of a user's module without the whole module: `build`'s module with the
    /// parameters [`seeded_module`] draws from `seed` (the same values, drawn in the same
    /// order), drawn one tensor at a time, each handed to `sink` and released at once.
    /// `sink` first learns the layout and the backward groups `groups` makes of it.
    pub(crate) fn new_released_module(
        build: impl FnOnce(&Device) -> M,
        optimizer: &OptimizerSpec,
        (base_device, seed): (Device, u64),
        groups: impl FnOnce(&ParamLayout) -> Result<Vec<Range<usize>>>,
        sink: &mut dyn ShardSink,
    ) -> Result<Self> {
        let (model, layout) = seeded(seed, |cpu| {
            // burn draws a parameter at its first use: building the module draws nothing.
            let model = build(cpu);
            let layout = ParamLayout::of(&model);
            sink.plan(&layout, &groups(&layout)?)?;
            let model = params::draw_released(model, &mut |i, values| sink.values(i, values))?;
            Ok((model, layout))
        })?;
        let device = base_device.clone().autodiff();
        let model = params::renumber(model.fork(&device).train());
        let mut weights = Weights::of_module(model, optimizer, base_device, true)?;
        weights.layout = layout;
        weights.released = true;
        Ok(weights)
    }

    /// Adds a metadata entry written with the weights.
    pub(crate) fn with_metadata(mut self, key: &str, value: String) -> Self {
        self.metadata.push((key.to_string(), value));
        self
    }

    pub(crate) fn model(&self) -> Result<&M> {
        if self.released {
            return Err(EngineError::ParamsSharded(
                "this rank holds its shard only; the whole model is gathered first".into(),
            ));
        }
        // The model is only taken out for the duration of a call that puts it back.
        self.model.as_ref().ok_or(EngineError::ModelUnavailable)
    }

    /// Releases every parameter (each becomes an empty tensor of its rank; the layout keeps
    /// their shapes): ZeRO-3, whose rank holds its shard only. Whole-model calls fail until
    /// [`ModelState::write_params`] gives the parameters back.
    pub(crate) fn release(&mut self) -> Result<()> {
        if self.released {
            return Ok(());
        }
        let model = self.model.take().ok_or(EngineError::ModelUnavailable)?;
        let all = 0..self.layout.params.len();
        self.model = Some(params::write_range(model, &self.layout, all, None, false)?);
        self.released = true;
        Ok(())
    }

    /// The released model's slot and the layout, for a pass that gathers and releases each
    /// group's parameters itself ([`crate::sharded`]) and leaves them released.
    pub(crate) fn released_model(&mut self) -> Result<(&mut Option<M>, &ParamLayout)> {
        if !self.released {
            return Err(EngineError::ParamsSharded(
                "a sharded pass on a model holding its whole parameters".into(),
            ));
        }
        Ok((&mut self.model, &self.layout))
    }

    /// Replaces the model with what `load` makes of it. `load` loads into a copy, so that a
    /// failed or partial load leaves the model as it was; but a copy shares its running
    /// statistics with the model (burn keeps them behind a shared cell), so those are put
    /// back by hand after a failure.
    fn load_with(&mut self, load: impl FnOnce(&M) -> Result<M>) -> Result<()> {
        let mut buffers = vec![0.0; self.buffer_layout.total];
        self.read_buffers(&mut buffers)?;
        match load(self.model()?) {
            Ok(model) => self.model = Some(model),
            Err(e) => {
                self.write_buffers(&buffers)?;
                return Err(e);
            }
        }
        Ok(())
    }

    /// One optimizer step with a flat gradient.
    pub(crate) fn step(&mut self, grads: &[f32], lr: f64) -> Result<()> {
        let _span = tracing::info_span!(target: "flotilla::engine", "optimizer_step").entered();
        let gp = params::grads_from_flat(self.model()?, &self.layout, grads, &self.base_device)?;
        let model = self.model.take().ok_or(EngineError::ModelUnavailable)?;
        self.model = Some(self.optimizer.step(lr, model, gp));
        Ok(())
    }
}

/// The model of `spec` with the initial values [`initial_model`] draws from `seed` in the
/// layers `range` and identities (no parameters) in the others: every layer's values are
/// drawn in flat order, as the whole model's are, one layer at a time, and a layer outside
/// `range` is let go as soon as it is drawn, so that a pipeline stage never holds the whole
/// model (nor more than its own layers and one other).
pub(crate) fn stage_model(
    spec: &ModelSpec,
    seed: u64,
    range: Range<usize>,
) -> Result<SequentialModel> {
    seeded(seed, |cpu| {
        // burn draws a parameter at its first use: building the model draws nothing.
        let mut model = SequentialModel::new(spec, cpu)?;
        for (i, slot) in model.layers.iter_mut().enumerate() {
            let local = ParamLayout::of(&*slot);
            let mut values = vec![0.0; local.total];
            params::read_values(&*slot, &local, &mut values, Tensors::Params)?;
            if !range.contains(&i) {
                *slot = Layer::Identity(Identity);
            }
        }
        Ok(model)
    })
}

impl<M: Module> ModelState for Weights<M> {
    fn layout(&self) -> &ParamLayout {
        &self.layout
    }

    fn read_params(&self, out: &mut [f32]) -> Result<()> {
        params::read_values(self.model()?, &self.layout, out, Tensors::Params)
    }

    /// Also gives a released model ([`Weights::release`]) its whole parameters back.
    fn write_params(&mut self, src: &[f32]) -> Result<()> {
        let model = self
            .model
            .as_ref()
            .ok_or(EngineError::ModelUnavailable)?
            .clone();
        let model = if self.released {
            // Released tensors require no gradient: the whole model's parameters do.
            let all = 0..self.layout.params.len();
            params::write_range(model, &self.layout, all, Some(src), true)?
        } else {
            params::write_values(model, &self.layout, src, Tensors::Params)?
        };
        self.model = Some(model);
        self.released = false;
        Ok(())
    }

    fn param_placement(&self) -> Result<Option<ParamPlacement>> {
        // Released tensors (ZeRO-3) are still on their device.
        let model = self.model.as_ref().ok_or(EngineError::ModelUnavailable)?;
        crate::device::placement::of(model, &self.layout)
    }

    fn buffer_layout(&self) -> &ParamLayout {
        &self.buffer_layout
    }

    fn read_buffers(&self, out: &mut [f32]) -> Result<()> {
        // Released or not (buffers are never released). `valid()` settles the pending
        // updates (see the module documentation).
        let model = self.model.as_ref().ok_or(EngineError::ModelUnavailable)?;
        let settled = model.valid();
        params::read_values(&settled, &self.buffer_layout, out, Tensors::Buffers)
    }

    fn write_buffers(&mut self, src: &[f32]) -> Result<()> {
        let model = self.model.as_ref().ok_or(EngineError::ModelUnavailable)?;
        // Settle the pending updates first: one left pending would overwrite `src` later.
        drop(model.valid());
        let written =
            params::write_values(model.clone(), &self.buffer_layout, src, Tensors::Buffers)?;
        self.model = Some(written);
        Ok(())
    }

    fn optimizer_state(&self) -> Result<Vec<u8>> {
        let bytes = self
            .optimizer
            .into_bytes()
            .map_err(|e| EngineError::Optimizer(format!("saving state: {e:?}")))?;
        Ok(bytes.to_vec())
    }

    fn load_optimizer_state(&mut self, bytes: &[u8]) -> Result<()> {
        let expected: Vec<Expected> = self
            .layout
            .params
            .iter()
            .map(|p| Expected {
                name: format!("parameter {}", p.name),
                shape: p.shape.clone(),
            })
            .collect();
        let bytes = burn::tensor::Bytes::from_bytes_vec(bytes.to_vec()).shared();
        check_state_shapes(&bytes, &expected)?;
        let optimizer = self
            .optimizer
            .clone()
            .from_bytes(bytes)
            .map_err(|e| EngineError::Optimizer(format!("loading state: {e:?}")))?;
        self.optimizer = optimizer;
        Ok(())
    }

    fn save_weights(&self, path: &Path) -> Result<()> {
        any_module::save_module(self.model()?, path, &self.metadata)
    }

    fn weights_plan(&self) -> Result<WeightsPlan> {
        // The module's structure only: the parameters may be released.
        let model = self.model.as_ref().ok_or(EngineError::ModelUnavailable)?;
        let mut tensors = crate::weights_writer::saved_tensors(model, &self.layout);
        tensors.extend(crate::weights_writer::saved_buffers(&self.buffer_layout));
        Ok(WeightsPlan::new(tensors, &self.metadata))
    }

    fn load_weights(&mut self, path: &Path) -> Result<()> {
        self.load_with(|model| any_module::load_module(model, path))
    }

    fn weights_bytes(&self) -> Result<Vec<u8>> {
        any_module::module_bytes(self.model()?, &self.metadata)
    }

    fn load_weights_bytes(&mut self, bytes: &[u8]) -> Result<()> {
        self.load_with(|model| any_module::load_module_bytes(model, bytes))
    }
}

/// Implements [`ModelState`] for a type by delegating to its `weights` field.
macro_rules! delegate_model_state {
    ([$($generics:tt)*] $ty:ty) => {
        impl<$($generics)*> $crate::weights::ModelState for $ty {
            fn layout(&self) -> &$crate::params::ParamLayout {
                self.weights.layout()
            }
            fn read_params(&self, out: &mut [f32]) -> $crate::error::Result<()> {
                self.weights.read_params(out)
            }
            fn write_params(&mut self, src: &[f32]) -> $crate::error::Result<()> {
                self.weights.write_params(src)
            }
            fn optimizer_state(&self) -> $crate::error::Result<Vec<u8>> {
                self.weights.optimizer_state()
            }
            fn load_optimizer_state(&mut self, bytes: &[u8]) -> $crate::error::Result<()> {
                self.weights.load_optimizer_state(bytes)
            }
            fn save_weights(&self, path: &std::path::Path) -> $crate::error::Result<()> {
                self.weights.save_weights(path)
            }
            fn load_weights(&mut self, path: &std::path::Path) -> $crate::error::Result<()> {
                self.weights.load_weights(path)
            }
            fn weights_bytes(&self) -> $crate::error::Result<Vec<u8>> {
                self.weights.weights_bytes()
            }
            fn load_weights_bytes(&mut self, bytes: &[u8]) -> $crate::error::Result<()> {
                self.weights.load_weights_bytes(bytes)
            }
            fn param_placement(
                &self,
            ) -> $crate::error::Result<Option<$crate::device::placement::ParamPlacement>> {
                self.weights.param_placement()
            }
            fn buffer_layout(&self) -> &$crate::params::ParamLayout {
                self.weights.buffer_layout()
            }
            fn read_buffers(&self, out: &mut [f32]) -> $crate::error::Result<()> {
                self.weights.read_buffers(out)
            }
            fn write_buffers(&mut self, src: &[f32]) -> $crate::error::Result<()> {
                self.weights.write_buffers(src)
            }
            fn weights_plan(&self) -> $crate::error::Result<$crate::WeightsPlan> {
                self.weights.weights_plan()
            }
        }
    };
    ($ty:ty) => {
        $crate::weights::delegate_model_state!([] $ty);
    };
}
pub(crate) use delegate_model_state;
