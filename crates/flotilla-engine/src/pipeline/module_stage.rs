//! A pipeline of a burn user's own modules, one per stage ([`StageModule`]), cut and run by
//! the same pipeline as a spec's layers: [`module_pipeline`] draws every stage's initial
//! parameters from one seed in stage order (as the whole model's would be drawn), learns the
//! shape of every tensor that crosses between stages from a one-sample forward pass, routes
//! each by name, and makes this rank's stage a [`Stage`] — the same forward, backward, loss,
//! gradient accumulation and optimizer step as a spec's stage. The same modules are the blocks
//! ZeRO-3 runs a user's module as (`crate::module_blocks`).

use burn::module::Module;
use burn::prelude::*;
use burn::tensor::Gradients;

use crate::device::device_by_name;
use crate::error::{EngineError, Result};
use crate::module_blocks::{BlockRun, ModuleBlock, Pass};
use crate::optim::OptimizerSpec;
use crate::params::{self, ParamLayout};
use crate::pipeline::cut::{Crossing, StageCut};
use crate::pipeline::named_tensors::{NamedTensors, sample_shape};
use crate::pipeline::stage::{Stage, StageSlots};
use crate::pipeline::stage_engine::StageEngine;
use crate::spec::activation::Activation;
use crate::spec::shape::Shape;
use crate::weights::{Weights, materialized, seeded};

/// One stage of a pipeline written as a burn module by its user: the names of the tensors it
/// takes and gives, and its forward pass over them.
///
/// Stage 0 takes one tensor, the batch's inputs (`[n, c, h, w]` images, `[n, f]` features, or
/// `[n, t]` token ids as floats), under the name it declares. A later stage takes tensors
/// that earlier stages give, by name: each comes from the nearest earlier stage that gives
/// it, straight (a skip tensor from stage 0 to stage 2 does not pass through stage 1). The
/// last stage gives one tensor, its logits (`[n, classes]`, or `[n, t, classes]` for a
/// sequence); the run computes the cross-entropy against the labels, as for a spec model.
/// Tensors that cross stages are batch-first with 2, 3 or 4 dimensions.
pub trait StageModule: Module + 'static {
    /// The names of the tensors [`StageModule::forward`] takes.
    fn inputs(&self) -> Vec<String>;

    /// The names of the tensors [`StageModule::forward`] gives (the last stage: one, its
    /// logits).
    fn outputs(&self) -> Vec<String>;

    /// Runs the stage on one micro-batch.
    fn forward(&self, inputs: NamedTensors) -> Result<NamedTensors>;
}

/// A [`StageModule`] of any type, as [`module_pipeline`] handles it before it trains.
pub trait AnyStageModule {
    /// What it takes and gives.
    fn names(&self) -> (Vec<String>, Vec<String>);

    /// Its parameters numbered by position and drawn now, in flat order.
    fn materialized(self: Box<Self>) -> Result<Box<dyn AnyStageModule>>;

    /// Its forward pass (a probe of one sample, to learn the shapes it gives).
    fn probe(&self, inputs: NamedTensors) -> Result<NamedTensors>;

    /// It as one block of its module under ZeRO-3 ([`crate::ModuleEngine`]), its
    /// parameters released without being drawn.
    fn into_block(self: Box<Self>) -> Result<ModuleBlock>;

    /// The stage that trains it at `slots`, on the named device.
    fn into_stage(
        self: Box<Self>,
        slots: StageSlotsOf,
        optimizer: &OptimizerSpec,
        device_name: &str,
    ) -> Result<Box<dyn StageEngine>>;
}

/// Where a user's stage sits (opaque outside the engine).
pub struct StageSlotsOf(StageSlots);

impl<M: StageModule> AnyStageModule for M {
    fn names(&self) -> (Vec<String>, Vec<String>) {
        (self.inputs(), self.outputs())
    }

    fn materialized(self: Box<Self>) -> Result<Box<dyn AnyStageModule>> {
        Ok(Box::new(materialized(*self)?))
    }

    fn probe(&self, inputs: NamedTensors) -> Result<NamedTensors> {
        self.forward(inputs)
    }

    fn into_block(self: Box<Self>) -> Result<ModuleBlock> {
        block_of(*self)
    }

    fn into_stage(
        self: Box<Self>,
        slots: StageSlotsOf,
        optimizer: &OptimizerSpec,
        device_name: &str,
    ) -> Result<Box<dyn StageEngine>> {
        let base_device = device_by_name(device_name)?;
        // As a whole user module: fresh leaves on the training device, numbered by position.
        let model = params::renumber(self.fork(&base_device.clone().autodiff()).train());
        let weights = Weights::of_module(model, optimizer, base_device, true)?.with_metadata(
            "flotilla.stage",
            format!("{} of a program's modules", slots.0.index),
        );
        Ok(Box::new(Stage::of(weights, slots.0, run_module::<M>)))
    }
}

/// Builds one stage's module on the device it is given.
pub type StageBuilder = Box<dyn Fn(&Device) -> Box<dyn AnyStageModule> + Send + Sync>;

/// What one sample looks like to a pipeline of modules: its input's shape (`[c, h, w]`,
/// `[f]`) and, for token ids, the vocabulary.
#[derive(Debug, Clone, Copy)]
pub struct StageInput {
    /// One sample's input.
    pub shape: Shape,
    /// The vocabulary of token ids, if the input is token ids.
    pub vocab: Option<usize>,
}

/// The pipeline of the modules `builders` make (one per stage, in order) and stage `index`
/// of it, trained by `optimizer` on the named device. Every rank that calls it with the same
/// builders and `seed` draws the same initial parameters (each stage's as the whole model's,
/// built stage after stage, would be drawn) and computes the same cut (crossings numbered by
/// consuming stage, then by the order it declares its inputs).
pub fn module_pipeline(
    builders: &[StageBuilder],
    input: StageInput,
    index: usize,
    optimizer: &OptimizerSpec,
    device_name: &str,
    seed: u64,
) -> Result<(StageCut, Box<dyn StageEngine>)> {
    if builders.is_empty() || index >= builders.len() {
        return Err(EngineError::InvalidSpec(format!(
            "stage {index} does not exist (the program gives {} stage modules)",
            builders.len()
        )));
    }
    let mut modules = seeded(seed, |cpu| {
        builders
            .iter()
            .map(|build| build(cpu).materialized())
            .collect::<Result<Vec<_>>>()
    })?;
    let names: Vec<_> = modules.iter().map(|m| m.names()).collect();
    check_ends(&names)?;
    let shapes = probe_shapes(&modules, &names, input.shape)?;
    let cut = route(&names, &shapes, input.shape)?;
    let ends = [names[0].0[0].clone(), names[index].1[0].clone()];
    let slots = StageSlots::of_cut(&cut, index, ends, input.vocab, index..index + 1);
    let module = modules.swap_remove(index);
    drop(modules);
    let stage = module.into_stage(StageSlotsOf(slots), optimizer, device_name)?;
    Ok((cut, stage))
}

/// The logits per label of the modules `builders` make (one per stage, in order), from a
/// forward pass of one sample of zeros of shape `input` through them, each drawn from seed 0,
/// run and dropped in turn: no more than one stage's parameters exist at once.
pub fn stage_classes(builders: &[StageBuilder], input: Shape) -> Result<usize> {
    let device = Device::flex().autodiff();
    let mut given = NamedTensors::new();
    let mut logits = None;
    for (s, build) in builders.iter().enumerate() {
        let module = seeded(0, |cpu| build(cpu).materialized())?;
        let (ins, outs) = module.names();
        if s == 0 {
            let [first] = ins.as_slice() else {
                return Err(EngineError::InvalidSpec(format!(
                    "stage 0 takes {ins:?}; it takes one tensor, the batch's inputs"
                )));
            };
            let zeros = vec![0.0; input.numel()];
            given.put(first, Activation::from_flat(zeros, 1, input, &device));
        }
        let mut inputs = NamedTensors::new();
        for name in &ins {
            if !given.contains(name) {
                return Err(EngineError::InvalidSpec(format!(
                    "stage {s} takes `{name}`, which no earlier stage gives"
                )));
            }
            inputs.put(name, given.activation(name, s)?);
        }
        let out = module.probe(inputs)?;
        for name in &outs {
            let a = out.activation(name, s)?;
            logits = Some(a.clone());
            given.put(name, a);
        }
    }
    let logits =
        logits.ok_or_else(|| EngineError::InvalidSpec("no stage gives a tensor".into()))?;
    Ok(logits.into_logits().dims()[1])
}

/// Every stage's output shapes (one sample), from a forward pass of one sample of zeros
/// through the stages in order.
fn probe_shapes(
    modules: &[Box<dyn AnyStageModule>],
    names: &[(Vec<String>, Vec<String>)],
    input: Shape,
) -> Result<Vec<Vec<Shape>>> {
    let device = Device::flex().autodiff();
    let first = &names[0].0[0];
    let mut given = NamedTensors::new();
    given.put(
        first,
        Activation::from_flat(vec![0.0; input.numel()], 1, input, &device),
    );
    let mut shapes = Vec::with_capacity(modules.len());
    for (s, (module, (ins, outs))) in modules.iter().zip(names).enumerate() {
        let mut inputs = NamedTensors::new();
        for name in ins {
            if !given.contains(name) {
                return Err(EngineError::InvalidSpec(format!(
                    "stage {s} takes `{name}`, which no earlier stage gives"
                )));
            }
            inputs.put(name, given.activation(name, s)?);
        }
        let out = module.probe(inputs)?;
        let mut mine = Vec::with_capacity(outs.len());
        for name in outs {
            let a = out.activation(name, s)?;
            mine.push(sample_shape(&a));
            given.put(name, a);
        }
        shapes.push(mine);
    }
    Ok(shapes)
}

/// Refuses a pipeline whose stage 0 does not take one tensor (the batch's inputs) or whose
/// last stage does not give one (its logits).
fn check_ends(names: &[(Vec<String>, Vec<String>)]) -> Result<()> {
    let (first, last) = (&names[0].0, &names[names.len() - 1].1);
    if first.len() != 1 {
        return Err(EngineError::InvalidSpec(format!(
            "stage 0 takes {first:?}; it takes one tensor, the batch's inputs"
        )));
    }
    if last.len() != 1 {
        return Err(EngineError::InvalidSpec(format!(
            "the last stage gives {last:?}; it gives one tensor, its logits"
        )));
    }
    Ok(())
}

/// The cut of a pipeline of modules: every input of a later stage comes from the nearest
/// earlier stage that gives it; stage 0 takes the batch's inputs, the last gives the logits.
fn route(
    names: &[(Vec<String>, Vec<String>)],
    shapes: &[Vec<Shape>],
    input: Shape,
) -> Result<StageCut> {
    let stages = names.len();
    let bad = |m: String| Err(EngineError::InvalidSpec(m));
    let output = shapes[stages - 1][0];
    let mut crossings = Vec::new();
    for (to, (ins, _)) in names.iter().enumerate().skip(1) {
        for name in ins {
            let from = (0..to).rev().find(|&t| names[t].1.contains(name));
            let Some(from) = from else {
                return bad(format!(
                    "stage {to} takes `{name}`, which no earlier stage gives"
                ));
            };
            let at = names[from].1.iter().position(|n| n == name).unwrap_or(0);
            crossings.push(Crossing {
                name: name.clone(),
                shape: shapes[from][at],
                from,
                to,
            });
        }
    }
    for (from, (_, outs)) in names.iter().enumerate().take(stages - 1) {
        if let Some(unused) = outs
            .iter()
            .find(|n| !crossings.iter().any(|c| c.from == from && &c.name == *n))
        {
            return bad(format!(
                "stage {from} gives `{unused}`, which no later stage takes"
            ));
        }
    }
    Ok(StageCut {
        ranges: (0..stages).map(|s| s..s + 1).collect(),
        crossings,
        input,
        output,
        classes: output.numel(),
    })
}

/// A user's stage run: its module's forward over its input slots by name; its output slots
/// by name (the last stage: its logits, one row per sample or position).
fn run_module<M: StageModule>(
    model: &M,
    slots: &StageSlots,
    acts: Vec<Activation>,
) -> Result<Vec<Activation>> {
    let mut inputs = NamedTensors::new();
    for (slot, a) in slots.inputs.iter().zip(acts) {
        inputs.put(&slot.name, a);
    }
    let out = model.forward(inputs)?;
    let mut outputs = Vec::with_capacity(slots.outputs.len());
    for slot in &slots.outputs {
        outputs.push(out.activation(&slot.name, slots.index)?);
    }
    if slots.last {
        return Ok(outputs
            .into_iter()
            .map(|a| Activation::Flat(a.into_logits()))
            .collect());
    }
    Ok(outputs)
}

/// `model` as a ZeRO-3 block, its parameters released without being drawn.
fn block_of<M: StageModule>(model: M) -> Result<ModuleBlock> {
    let layout = ParamLayout::of(&model);
    let all = 0..layout.params.len();
    let model = params::write_range(model, &layout, all, None, false)?;
    let buffers = crate::any_module::buffer_layout(&model);
    Ok(ModuleBlock::new(Box::new(Block {
        model: Some(model),
        layout,
        buffers,
    })))
}

/// A [`StageModule`] as a [`BlockRun`].
struct Block<M> {
    model: Option<M>,
    layout: ParamLayout,
    /// Its buffers' layout (batch norm's running statistics; never released).
    buffers: ParamLayout,
}

impl<M: StageModule> BlockRun for Block<M> {
    fn names(&self) -> (Vec<String>, Vec<String>) {
        self.model
            .as_ref()
            .map(|m| (m.inputs(), m.outputs()))
            .unwrap_or_default()
    }

    fn layout(&self) -> &ParamLayout {
        &self.layout
    }

    fn run(&mut self, values: &[f32], inputs: NamedTensors, how: Pass) -> Result<NamedTensors> {
        let model = self.model.take().ok_or(EngineError::ModelUnavailable)?;
        let all = 0..self.layout.params.len();
        let tape = how == Pass::Tape;
        let model = params::write_range(model, &self.layout, all, Some(values), tape)?;
        let out = match how {
            Pass::Valid => model.valid().forward(inputs),
            Pass::Off | Pass::Tape => model.forward(inputs),
        };
        self.model = Some(model);
        out
    }

    fn grads(
        &self,
        grads: Option<&Gradients>,
        ready: &mut dyn FnMut(usize, &[f32]) -> Result<()>,
    ) -> Result<()> {
        let model = self.model.as_ref().ok_or(EngineError::ModelUnavailable)?;
        let all = 0..self.layout.params.len();
        params::for_each_grad_in(model, grads, &self.layout, all, ready)
    }

    fn release(&mut self) -> Result<()> {
        let model = self.model.take().ok_or(EngineError::ModelUnavailable)?;
        let all = 0..self.layout.params.len();
        self.model = Some(params::write_range(model, &self.layout, all, None, false)?);
        Ok(())
    }

    fn buffer_layout(&self) -> ParamLayout {
        self.buffers.clone()
    }

    fn read_buffers(&self, out: &mut [f32]) -> Result<()> {
        let model = self.model.as_ref().ok_or(EngineError::ModelUnavailable)?;
        // `valid()` settles the updates burn keeps pending until the next read.
        crate::any_module::read_buffers(&model.valid(), &self.buffers, out)
    }

    fn write_buffers(&mut self, src: &[f32]) -> Result<()> {
        let model = self.model.as_ref().ok_or(EngineError::ModelUnavailable)?;
        // Settled first: an update left pending would overwrite `src` later.
        drop(model.valid());
        let written = crate::any_module::write_buffers(model.clone(), &self.buffers, src)?;
        self.model = Some(written);
        Ok(())
    }
}
