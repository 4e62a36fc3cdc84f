//! One pipeline stage: a contiguous slice of a model's layers that runs forward and backward
//! on micro-batches, with flat buffers in and out.
//!
//! A stage takes its **input slots** and gives its **output slots**, each a flat row-major
//! buffer of `n` samples: stage 0 takes the model input, a later stage the crossings of
//! [`StageCut::inputs`]; the last stage gives the logits, an earlier stage the crossings of
//! [`StageCut::outputs`]. `forward` keeps, per micro-batch in flight, what backward needs (the
//! autodiff graph behind the outputs and the input leaves); `backward` is the vector-Jacobian
//! product: the inputs were marked to require a gradient, and `Σ y·g` over the outputs is
//! differentiated, giving the gradients of the inputs (sent back upstream) and of the stage's
//! parameters (accumulated over micro-batches until [`StageEngine::step`]).
//!
//! The stage's parameters have the names and initial values of the same layers of the whole
//! model built from the same seed (the other layers are replaced by identities after seeded
//! initialisation), so the union of the stages' weight files is the whole model's.

use std::collections::HashMap;
use std::ops::Range;

use burn::module::Module;
use burn::nn::loss::{CrossEntropyLoss, CrossEntropyLossConfig};
use burn::prelude::*;
use burn::tensor::Gradients;

use crate::backward_groups::{LayerParams, layer_params};
use crate::engine::labels_tensor;
use crate::error::{EngineError, Result};
use crate::optim::OptimizerSpec;
use crate::params;
use crate::pipeline::cut::{MAIN, StageCut};
use crate::pipeline::stage_engine::{Slot, StageEngine, StageSeed};
use crate::sharded::{ShardSink, ShardedPass};
use crate::spec::ModelSpec;
use crate::spec::activation::Activation;
use crate::spec::model::SequentialModel;
use crate::spec::sequence::check_tokens;
use crate::weights::{Weights, delegate_model_state};

mod sharded;

/// What a micro-batch in flight keeps for its backward pass.
struct Flight {
    inputs: Vec<Activation>,
    outputs: Vec<Activation>,
}

/// Where a stage sits and what it takes and gives.
pub(crate) struct StageSlots {
    pub(crate) index: usize,
    pub(crate) last: bool,
    /// The vocabulary, if this stage takes the model's input of token ids.
    pub(crate) vocab: Option<usize>,
    /// The model layers it runs (a program's stage: its index, one module).
    pub(crate) range: Range<usize>,
    pub(crate) inputs: Vec<Slot>,
    pub(crate) outputs: Vec<Slot>,
}

impl StageSlots {
    /// Stage `index`'s slots in `cut`: its crossings in tag order, stage 0's input and the
    /// last stage's logits under the names `ends` (a spec's [`MAIN`]; a stage module's own),
    /// the token vocabulary on stage 0 only.
    pub(crate) fn of_cut(
        cut: &StageCut,
        index: usize,
        [first_input, last_output]: [String; 2],
        vocab: Option<usize>,
        range: Range<usize>,
    ) -> Self {
        let slot = |c: usize| Slot {
            name: cut.crossings[c].name.clone(),
            shape: cut.crossings[c].shape,
        };
        let last = index + 1 == cut.stages();
        let inputs = match index {
            0 => vec![Slot {
                name: first_input,
                shape: cut.input,
            }],
            s => cut.inputs(s).into_iter().map(slot).collect(),
        };
        let outputs = match last {
            true => vec![Slot {
                name: last_output,
                shape: cut.output,
            }],
            false => cut.outputs(index).into_iter().map(slot).collect(),
        };
        StageSlots {
            index,
            last,
            vocab: vocab.filter(|_| index == 0),
            range,
            inputs,
            outputs,
        }
    }
}

/// How a stage's module turns its input slots into its output slots (the last stage: its
/// logits), in [`StageSlots`] order.
pub(crate) type RunStage<M> = fn(&M, &StageSlots, Vec<Activation>) -> Result<Vec<Activation>>;

/// How a spec stage runs some of its layers: the first of them take the stage's input slots
/// (else the main activation alone), the last give its output slots (else the main
/// activation).
pub(crate) type RunGroup<M> =
    fn(&M, &StageSlots, Range<usize>, Vec<Activation>) -> Result<Vec<Activation>>;

/// One parameter group of a stage: what a sharded stage gathers at once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StageGroup {
    /// Its model layers.
    pub(crate) layers: Range<usize>,
    /// Its parameters, as indices into the stage's layout (consecutive).
    pub(crate) params: Range<usize>,
}

/// One stage of a pipeline (see the module documentation): a slice of a spec's layers
/// ([`Stage::new`]) or a user's module ([`crate::StageModule`]).
pub struct Stage<M: Module = SequentialModel> {
    weights: Weights<M>,
    slots: StageSlots,
    run: RunStage<M>,
    /// A spec stage's run of some of its layers (its groups one by one); `None`: the stage
    /// runs as one group.
    run_group: Option<RunGroup<M>>,
    /// Its parameter groups, in layer order.
    groups: Vec<StageGroup>,
    flights: HashMap<usize, Flight>,
    /// The micro-batches in flight of a sharded stage ([`sharded`]).
    kept: HashMap<usize, sharded::Kept>,
    /// The dropout seed of the next forward.
    seed: Option<u64>,
    /// Makes a spec's dropout layers draw from the seed and their index.
    seed_layers: fn(&mut Weights<M>, u64),
    /// A group's gathered values (reused).
    scratch: Vec<f32>,
    peak: usize,
    grads: Vec<f32>,
    loss: CrossEntropyLoss,
    /// A spec stage's model spec and its layers' parameters (its groups are the spec's
    /// backward groups).
    spec: Option<(ModelSpec, Vec<LayerParams>)>,
}

delegate_model_state!([M: Module] Stage<M>);

impl Stage<SequentialModel> {
    /// Builds stage `index` of `cut` (a cut of `spec`) on the named backend, with
    /// parameters initialised from `seed` as the whole model's would be.
    pub fn new(
        spec: &ModelSpec,
        cut: &StageCut,
        index: usize,
        optimizer: &OptimizerSpec,
        device_name: &str,
        seed: u64,
    ) -> Result<Self> {
        let range = stage_range(spec, cut, index)?;
        let weights = Weights::new(spec, optimizer, device_name, seed, Some(range.clone()))?;
        Self::of_weights(spec, cut, index, weights)
    }

    /// [`Stage::new`]'s stage released from the start (ZeRO-3 among its replicas), without
    /// its whole parameters ever in memory: every layer's drawn in turn from `seed` (the
    /// same values), one layer at a time, the stage's handed to `sink` and released at once.
    /// `sink` first learns the stage's layout and its groups of at most `group_bytes`
    /// ([`crate::StageEngine::set_group_bytes`]), last group first.
    pub fn new_released(
        spec: &ModelSpec,
        (cut, index): (&StageCut, usize),
        optimizer: &OptimizerSpec,
        (device_name, seed): (&str, u64),
        group_bytes: usize,
        sink: &mut dyn ShardSink,
    ) -> Result<Self> {
        let range = stage_range(spec, cut, index)?;
        let ready = |layers: &[LayerParams]| -> Result<Vec<Range<usize>>> {
            let groups = sharded::spec_groups(spec, layers, &range, group_bytes)?;
            Ok(groups.iter().rev().map(|g| g.params.clone()).collect())
        };
        let (weights, layers) = Weights::drawn_released(
            spec,
            optimizer,
            (device_name, seed),
            range.clone(),
            &ready,
            sink,
        )?;
        let mut stage = Self::of_layers(spec, cut, index, weights, layers)?;
        stage.set_group_bytes(group_bytes)?;
        // A sharded stage's gradients go to its pass: no buffer of the whole stage's.
        stage.grads = Vec::new();
        Ok(stage)
    }

    /// Stage `index` of `cut` (a cut of `spec`) over `weights`, the model's with that
    /// stage's layers ([`Stage::new`]'s, or a profile's prefix sharing one model's values).
    pub(crate) fn of_weights(
        spec: &ModelSpec,
        cut: &StageCut,
        index: usize,
        weights: Weights<SequentialModel>,
    ) -> Result<Self> {
        let layers = layer_params(weights.model()?);
        Self::of_layers(spec, cut, index, weights, layers)
    }

    /// [`Stage::of_weights`] with the parameters of each of the model's `layers` given (a
    /// released model's shapes are gone).
    fn of_layers(
        spec: &ModelSpec,
        cut: &StageCut,
        index: usize,
        weights: Weights<SequentialModel>,
        layers: Vec<LayerParams>,
    ) -> Result<Self> {
        let range = cut.ranges.get(index).cloned().unwrap_or_default();
        let weights = weights.with_metadata("flotilla.stage", format!("{index} layers {range:?}"));
        let ends = [MAIN.to_string(), MAIN.to_string()];
        let slots = StageSlots::of_cut(cut, index, ends, spec.token_vocab(), range);
        let mut stage = Stage::of(weights, slots, run_layers);
        stage.run_group = Some(run_spec_group);
        stage.seed_layers = |w, seed| w.set_layer_dropout_seed(seed);
        stage.groups = sharded::spec_groups(spec, &layers, &stage.slots.range, 0)?;
        stage.spec = Some((spec.clone(), layers));
        Ok(stage)
    }
}

/// The layers of stage `index` of `cut` (a cut of `spec`); a spec whose head is tied to its
/// embedding refused in more than one stage.
fn stage_range(spec: &ModelSpec, cut: &StageCut, index: usize) -> Result<Range<usize>> {
    let range = cut.ranges.get(index).cloned().ok_or_else(|| {
        EngineError::InvalidSpec(format!(
            "stage {index} does not exist (the split has {} stages)",
            cut.stages()
        ))
    })?;
    if cut.stages() > 1 && spec.ties_embedding() {
        return Err(EngineError::InvalidSpec(
            "a linear layer tied to the embedding (tie_embedding) shares layer 0's table, \
             which a pipeline's stages would part: train it without a pipeline"
                .into(),
        ));
    }
    Ok(range)
}

impl<M: Module> Stage<M> {
    /// A stage of `weights` at `slots`, running `run`.
    pub(crate) fn of(weights: Weights<M>, slots: StageSlots, run: RunStage<M>) -> Self {
        Self {
            loss: CrossEntropyLossConfig::new().init(&weights.device),
            grads: vec![0.0; weights.layout.total],
            groups: sharded::whole(slots.range.clone(), &weights.layout),
            weights,
            slots,
            run,
            run_group: None,
            flights: HashMap::new(),
            kept: HashMap::new(),
            seed: None,
            seed_layers: |_, _| {},
            scratch: Vec::new(),
            peak: 0,
            spec: None,
        }
    }

    /// Seeds the dropout masks of the following forwards (the stage's and, for a spec,
    /// each layer's from its index).
    fn set_seed(&mut self, seed: u64) {
        self.seed = Some(seed);
        self.weights.set_dropout_seed(seed);
        (self.seed_layers)(&mut self.weights, seed);
    }

    /// Micro-batches in flight, sharded or not.
    fn in_flight_count(&self) -> usize {
        self.flights.len() + self.kept.len()
    }

    /// Refuses a forward of micro-batch `mb` while it is in flight.
    fn check_free(&self, mb: usize) -> Result<()> {
        if self.flights.contains_key(&mb) || self.kept.contains_key(&mb) {
            return Err(EngineError::Batch(format!(
                "stage {}: micro-batch {mb} is already in flight",
                self.slots.index
            )));
        }
        Ok(())
    }
}

impl<M: Module + 'static> StageEngine for Stage<M> {
    fn index(&self) -> usize {
        self.slots.index
    }

    fn layers(&self) -> Range<usize> {
        self.slots.range.clone()
    }

    fn is_last(&self) -> bool {
        self.slots.last
    }

    fn inputs(&self) -> &[Slot] {
        &self.slots.inputs
    }

    fn outputs(&self) -> &[Slot] {
        &self.slots.outputs
    }

    fn set_dropout_seed(&mut self, seed: u64) {
        self.set_seed(seed);
    }

    fn in_flight(&self) -> usize {
        self.in_flight_count()
    }

    fn peak_in_flight(&self) -> usize {
        self.peak
    }

    fn forward(&mut self, mb: usize, n: usize, inputs: &[&[f32]]) -> Result<Vec<Vec<f32>>> {
        self.check_free(mb)?;
        let _span = tracing::info_span!(target: "flotilla::engine", "forward", mb).entered();
        let device = self.weights.device.clone();
        let acts = self.activations(n, inputs, &device, self.slots.index > 0)?;
        let outputs = self.weights.with_dropout_rng(|| self.run(acts.clone()))?;
        let flat = outputs
            .iter()
            .map(Activation::to_flat)
            .collect::<Result<Vec<_>>>()?;
        self.flights.insert(
            mb,
            Flight {
                inputs: acts,
                outputs,
            },
        );
        self.peak = self.peak.max(self.in_flight_count());
        Ok(flat)
    }

    fn backward(&mut self, mb: usize, grad_outputs: Vec<Vec<f32>>) -> Result<Vec<Vec<f32>>> {
        let flight = self.take_flight(mb)?;
        if grad_outputs.len() != flight.outputs.len() {
            return Err(EngineError::Batch(format!(
                "stage {}: {} output gradients for {} outputs",
                self.slots.index,
                grad_outputs.len(),
                flight.outputs.len()
            )));
        }
        let _span = tracing::info_span!(target: "flotilla::engine", "backward", mb).entered();
        match vjp_seed(&flight.outputs, grad_outputs)? {
            Some(seed) if self.needs_backward() => {
                let grads = seed.backward();
                self.finish_backward(&flight, &grads)
            }
            _ => Ok(Vec::new()),
        }
    }

    fn backward_loss(
        &mut self,
        mb: usize,
        labels: &[i64],
        weight: f32,
    ) -> Result<(f32, Vec<Vec<f32>>)> {
        if !self.slots.last {
            return Err(EngineError::Batch(format!(
                "stage {} is not the last stage and has no loss",
                self.slots.index
            )));
        }
        let flight = self.take_flight(mb)?;
        let _span = tracing::info_span!(target: "flotilla::engine", "backward", mb).entered();
        let logits = match flight.outputs.first() {
            Some(y) => y.clone().into_logits(),
            None => return Err(EngineError::NoGradients),
        };
        let [rows, _] = logits.dims();
        if labels.len() != rows {
            return Err(EngineError::Batch(format!(
                "{} labels for a micro-batch of {rows} rows of logits (samples, or positions of a sequence model)",
                labels.len()
            )));
        }
        let device = &self.weights.device;
        let targets = labels_tensor(labels, device);
        let loss = self.loss.forward(logits, targets);
        let grads = (loss.clone() * weight).backward();
        let value = loss.into_scalar::<f32>();
        let grad_inputs = self.finish_backward(&flight, &grads)?;
        Ok((value, grad_inputs))
    }

    fn grads_mut(&mut self) -> &mut [f32] {
        self.grad_buffer()
    }

    fn step(&mut self, lr: f64) -> Result<()> {
        if self.in_flight_count() > 0 {
            let mut open: Vec<usize> = self
                .flights
                .keys()
                .chain(self.kept.keys())
                .copied()
                .collect();
            open.sort_unstable();
            return Err(EngineError::Batch(format!(
                "stage {}: step with micro-batches {open:?} still waiting for backward",
                self.slots.index
            )));
        }
        self.grad_buffer();
        self.weights.step(&self.grads, lr)?;
        self.grads.fill(0.0);
        Ok(())
    }

    fn reset(&mut self) {
        self.flights.clear();
        self.kept.clear();
        self.grads.fill(0.0);
    }

    fn set_group_bytes(&mut self, max_bytes: usize) -> Result<()> {
        if let Some((spec, layers)) = &self.spec {
            self.groups = sharded::spec_groups(spec, layers, &self.slots.range, max_bytes)?;
        }
        Ok(())
    }

    fn param_groups(&self) -> Vec<Range<usize>> {
        self.groups.iter().map(|g| g.params.clone()).collect()
    }

    fn release_params(&mut self) -> Result<()> {
        // A sharded stage's gradients go to its pass: no buffer of the whole stage's.
        self.grads = Vec::new();
        self.weights.release()
    }

    fn forward_sharded(
        &mut self,
        mb: usize,
        n: usize,
        inputs: &[&[f32]],
        pass: &mut dyn ShardedPass,
    ) -> Result<Vec<Vec<f32>>> {
        self.sharded_forward(mb, n, inputs, pass)
    }

    fn backward_sharded(
        &mut self,
        mb: usize,
        seed: StageSeed<'_>,
        pass: &mut dyn ShardedPass,
    ) -> Result<(Option<f32>, Vec<Vec<f32>>)> {
        self.sharded_backward(mb, seed, pass)
    }

    fn forward_eval_sharded(
        &mut self,
        n: usize,
        inputs: &[&[f32]],
        pass: &mut dyn ShardedPass,
    ) -> Result<Vec<Vec<f32>>> {
        self.sharded_eval(n, inputs, pass)
    }

    fn forward_eval(&self, n: usize, inputs: &[&[f32]]) -> Result<Vec<Vec<f32>>> {
        let device = self.weights.base_device.clone();
        let acts = self.activations(n, inputs, &device, false)?;
        let model = self.weights.model()?.valid();
        (self.run)(&model, &self.slots, acts)?
            .iter()
            .map(Activation::to_flat)
            .collect()
    }
}

impl<M: Module> Stage<M> {
    fn activations(
        &self,
        n: usize,
        inputs: &[&[f32]],
        device: &Device,
        require_grad: bool,
    ) -> Result<Vec<Activation>> {
        if inputs.len() != self.slots.inputs.len() {
            return Err(EngineError::Batch(format!(
                "stage {} takes {} inputs, got {}",
                self.slots.index,
                self.slots.inputs.len(),
                inputs.len()
            )));
        }
        let mut acts = Vec::with_capacity(inputs.len());
        for (slot, values) in self.slots.inputs.iter().zip(inputs) {
            let expected = n * slot.shape.numel();
            if values.len() != expected || n == 0 {
                return Err(EngineError::Batch(format!(
                    "stage {} input `{}`: {n} samples of {} need {expected} values, got {}",
                    self.slots.index,
                    slot.name,
                    slot.shape,
                    values.len()
                )));
            }
            if let Some(vocab) = self.slots.vocab {
                check_tokens(values, vocab)?;
            }
            let a = Activation::from_flat(values.to_vec(), n, slot.shape, device);
            acts.push(if require_grad { a.require_grad() } else { a });
        }
        Ok(acts)
    }

    fn run(&self, acts: Vec<Activation>) -> Result<Vec<Activation>> {
        (self.run)(self.weights.model()?, &self.slots, acts)
    }

    /// Whether a backward pass computes anything (stage 0 without parameters has nothing
    /// to differentiate).
    fn needs_backward(&self) -> bool {
        self.slots.index > 0 || self.weights.layout.total > 0
    }

    fn take_flight(&mut self, mb: usize) -> Result<Flight> {
        self.flights.remove(&mb).ok_or_else(|| {
            EngineError::Batch(format!(
                "stage {}: backward for micro-batch {mb}, which has no forward in flight",
                self.slots.index
            ))
        })
    }

    /// Lets the gradient accumulator go (made again, zeroed, by the next backward): a
    /// profile keeps many stages and runs one at a time (`profile.rs`).
    pub(crate) fn drop_grads(&mut self) {
        self.grads = Vec::new();
    }

    /// The gradient accumulator, made (zeroed) when a released stage let it go.
    fn grad_buffer(&mut self) -> &mut Vec<f32> {
        let total = self.weights.layout.total;
        if self.grads.len() != total {
            self.grads = vec![0.0; total];
        }
        &mut self.grads
    }

    /// Adds the parameters' gradients to the accumulator and reads the inputs' gradients.
    fn finish_backward(&mut self, flight: &Flight, grads: &Gradients) -> Result<Vec<Vec<f32>>> {
        self.grad_buffer();
        let layout = &self.weights.layout;
        let acc = &mut self.grads;
        params::for_each_grad(self.weights.model()?, grads, layout, &mut |i, g| {
            let info = &layout.params[i];
            for (a, v) in acc[info.offset..info.offset + info.len].iter_mut().zip(g) {
                *a += v;
            }
            Ok(())
        })?;
        if self.slots.index == 0 {
            return Ok(Vec::new());
        }
        flight
            .inputs
            .iter()
            .map(|x| x.grad(grads).unwrap_or_else(|| Ok(vec![0.0; x.numel()])))
            .collect()
    }
}

/// `Σ y·g` over a stage's outputs `ys` and their gradients `gs` (same order and sizes): the
/// seed of the vector-Jacobian product that hands every output its gradient (`None`: no
/// output).
fn vjp_seed(ys: &[Activation], gs: Vec<Vec<f32>>) -> Result<Option<Tensor<1>>> {
    let mut seed: Option<Tensor<1>> = None;
    for (y, g) in ys.iter().zip(gs) {
        if g.len() != y.numel() {
            return Err(EngineError::FlatLength {
                expected: y.numel(),
                got: g.len(),
            });
        }
        let term = y.dot(g);
        seed = Some(match seed {
            Some(sum) => sum + term,
            None => term,
        });
    }
    Ok(seed)
}

/// A spec stage's run: its layers over the main input and the named tensors it takes.
fn run_layers(
    model: &SequentialModel,
    slots: &StageSlots,
    acts: Vec<Activation>,
) -> Result<Vec<Activation>> {
    run_spec_group(model, slots, slots.range.clone(), acts)
}

/// Layers `layers` of a spec stage ([`RunGroup`]): the first of its layers take the main
/// input and the named tensors it takes, a later group's the main activation; the last give
/// its outputs.
fn run_spec_group(
    model: &SequentialModel,
    slots: &StageSlots,
    layers: Range<usize>,
    acts: Vec<Activation>,
) -> Result<Vec<Activation>> {
    let mut acts = acts.into_iter();
    let Some(main) = acts.next() else {
        return Err(EngineError::Batch("a stage needs its main input".into()));
    };
    let first = layers.start == slots.range.start;
    let mut kept: HashMap<String, Activation> = match first {
        true => (slots.inputs.iter().skip(1))
            .map(|s| s.name.clone())
            .zip(acts)
            .collect(),
        false => HashMap::new(),
    };
    let x = model.run_range(layers.clone(), main, &mut kept);
    if layers.end != slots.range.end {
        return Ok(vec![x]);
    }
    if slots.last {
        return Ok(vec![Activation::Flat(x.into_logits())]);
    }
    let mut x = Some(x);
    let mut outputs = Vec::with_capacity(slots.outputs.len());
    for slot in &slots.outputs {
        let value = if slot.name == MAIN {
            x.take()
        } else {
            kept.get(&slot.name).cloned()
        };
        outputs.push(value.ok_or_else(|| {
            EngineError::InvalidSpec(format!(
                "stage {} does not produce `{}`",
                slots.index, slot.name
            ))
        })?);
    }
    Ok(outputs)
}
