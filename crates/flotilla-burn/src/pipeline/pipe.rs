//! [`Pipeline`]: one rank's stage of a pipeline of the user's own burn modules.
//!
//! A world of `S × D` ranks runs `D` replicas of an `S`-stage pipeline: rank `r` is stage
//! `r % S` of replica `r / S` (as `flotilla train`'s pipelines). [`Pipeline::step`] cuts the
//! batch into micro-batches and runs this stage's forwards and backwards in the order of the
//! schedule (GPipe or 1F1B, `flotilla_comm::pipeline::Schedule`): a forward receives its
//! inputs from the stages that give them, runs the user's module and sends each output to the
//! stage that takes it; a backward receives the gradients of its outputs, runs burn's
//! backward from `Σ y·g` (the last stage from its loss, weighted by the micro-batch's share of
//! the batch), accumulates the parameters' gradients (burn's `GradientsAccumulator`) and
//! sends its inputs' gradients back. Then the replicas of the stage average the gradients in
//! their own sub-group ([`DataParallel`]), and the user steps the optimizer.
//!
//! Sends never wait for the receiver and every stage runs its forwards and its backwards each
//! in micro-batch order, so no schedule deadlocks; every receive has the group's deadline and
//! a failure names the stage, tensor, micro-batch and rank waited for.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{GradientsAccumulator, GradientsParams, ModuleOptimizer};
use burn::prelude::*;
use burn::tensor::TensorData;
use flotilla_comm::pipeline::wire::{self, Direction};
use flotilla_comm::pipeline::{Action, micro_batches};
use flotilla_group::ProcessGroup;

use crate::data_parallel::DataParallel;
use crate::error::{DistError, Result};
use crate::pipeline::PipelineStage;
use crate::pipeline::options::{PipelineOptions, Place};
use crate::pipeline::routes::{self, Crossing, LOSS, Names};
use crate::pipeline::tensors::{Entry, Flat, Tensors};

/// What one [`Pipeline::step`] gives back.
pub struct StepOutput {
    /// The gradients of this stage's parameters for the whole batch, averaged over the
    /// replicas of the stage: hand them to the optimizer.
    pub grads: GradientsParams,
    /// The mean loss of this replica's batch, on the last stage (`None` elsewhere).
    pub loss: Option<f32>,
}

/// What a micro-batch in flight keeps for its backward pass.
struct Flight {
    /// The received inputs (leaves requiring gradients), one per crossing into the stage.
    leaves: Vec<Tensor<1>>,
    /// The outputs, one per crossing out of the stage, or the loss on the last stage.
    outputs: Vec<Tensor<1>>,
}

/// One rank's stage of a pipeline of user modules (see the module documentation).
pub struct Pipeline {
    world: Arc<dyn ProcessGroup>,
    options: PipelineOptions,
    place: Place,
    crossings: Vec<Crossing>,
    /// The crossings into this stage and out of it (indices into `crossings`).
    ins: Vec<usize>,
    outs: Vec<usize>,
    /// The stage's declared output names (the forward must give exactly these).
    declared: Vec<String>,
    replicas: Option<DataParallel>,
    device: Device,
    /// Batches evaluated so far (they number the evaluation messages).
    evaluated: usize,
}

impl std::fmt::Debug for Pipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pipeline")
            .field("place", &self.place)
            .field("options", &self.options)
            .finish()
    }
}

impl Pipeline {
    /// This rank's stage of the pipeline, running `module` (the module of stage
    /// [`PipelineOptions::place`] gives this rank) on `device` (an autodiff device).
    /// Collective over `group`: every rank checks that all ranks run the same options, that the
    /// replicas of a stage declare the same names and parameters, and that every stage's
    /// inputs come from an earlier stage's outputs; all fail alike if not, naming why.
    ///
    /// Draws `module`'s lazily initialised parameters now, in the module's order, so that a
    /// stage seeded alike starts from the same values whatever the number of replicas (burn
    /// draws a parameter when it is first read: left to the first forward pass, in the order
    /// that forward reads them).
    pub fn new<M: PipelineStage>(
        group: Arc<dyn ProcessGroup>,
        module: &M,
        device: &Device,
        options: PipelineOptions,
    ) -> Result<Self> {
        materialize(module);
        let place = options.place(group.as_ref())?;
        let mine = Names {
            inputs: module.inputs(),
            outputs: module.outputs(),
        };
        let names = agree(group.as_ref(), &options, &mine)?;
        let crossings = routes::crossings(&names)?;
        let s = place.stage;
        let ins = (0..crossings.len())
            .filter(|&c| crossings[c].to == s)
            .collect();
        let outs = (0..crossings.len())
            .filter(|&c| crossings[c].from == s)
            .collect();
        let replicas = match place.replicas {
            1 => None,
            d => {
                let members: Vec<usize> = (0..d).map(|r| r * options.stages + s).collect();
                Some(DataParallel::new(group.group(&members)?, module)?)
            }
        };
        Ok(Self {
            world: group,
            options,
            place,
            crossings,
            ins,
            outs,
            declared: mine.outputs,
            replicas,
            device: device.clone(),
            evaluated: 0,
        })
    }

    /// This rank's stage index.
    pub fn stage(&self) -> usize {
        self.place.stage
    }

    /// This rank's replica: which shard of the data its first stage reads.
    pub fn replica(&self) -> usize {
        self.place.replica
    }

    /// Replicas of every stage (D).
    pub fn replicas(&self) -> usize {
        self.place.replicas
    }

    /// Whether this rank runs the first stage (it reads the batch).
    pub fn is_first(&self) -> bool {
        self.place.stage == 0
    }

    /// Whether this rank runs the last stage (it reads the targets and gives the loss).
    pub fn is_last(&self) -> bool {
        self.place.stage + 1 == self.options.stages
    }

    /// The process group the pipeline runs in.
    pub fn group(&self) -> &Arc<dyn ProcessGroup> {
        &self.world
    }

    /// `module` with the parameters of this stage's replica 0 (collective over the stage's
    /// replicas; without replicas, `module` itself, its lazily initialised parameters drawn
    /// now in the module's order, as the broadcast reads them).
    pub fn broadcast_model<M: Module>(&self, module: M) -> Result<M> {
        match &self.replicas {
            Some(dp) => dp.broadcast_model(module),
            None => {
                materialize(&module);
                Ok(module)
            }
        }
    }

    /// `optimizer` with the state of this stage's replica 0 (collective over the stage's
    /// replicas; without replicas, `optimizer` itself).
    pub fn broadcast_optimizer(&self, optimizer: ModuleOptimizer) -> Result<ModuleOptimizer> {
        match &self.replicas {
            Some(dp) => dp.broadcast_optimizer(optimizer),
            None => Ok(optimizer),
        }
    }

    /// Trains on one batch: `batch` (read on the first stage, the tensors its module takes;
    /// other stages pass [`Tensors::new`]) and `targets` (read on the last stage, added to its
    /// module's inputs; others pass [`Tensors::new`]), every tensor batch-first. Runs the
    /// micro-batches with the schedule, then averages the gradients over the stage's
    /// replicas. Collective over the pipeline.
    pub fn step<M: PipelineStage>(
        &mut self,
        module: &M,
        batch: Tensors,
        targets: Tensors,
    ) -> Result<StepOutput> {
        let m = self.options.micro_batches;
        let batch = match self.is_first() {
            true => split(&batch, m, "batch")?,
            false => Vec::new(),
        };
        let (targets, samples) = match self.is_last() {
            true => (split(&targets, m, "targets")?, targets.samples("targets")?),
            false => (Vec::new(), 0),
        };
        let (stages, s) = (self.options.stages, self.place.stage);
        let mut flights = BTreeMap::new();
        let mut acc = GradientsAccumulator::<M>::new();
        let mut loss = 0.0;
        for action in self.options.schedule.actions(stages, s, m) {
            match action {
                Action::Forward(mb) => {
                    let mut inputs = batch.get(mb).cloned().unwrap_or_default();
                    if let Some(t) = targets.get(mb) {
                        merge_targets(&mut inputs, t)?;
                    }
                    let flight = self.forward(module, mb, inputs)?;
                    flights.insert(mb, flight);
                }
                Action::Backward(mb) => {
                    let flight = flights.remove(&mb).ok_or_else(|| {
                        DistError::Pipeline(format!(
                            "backward of micro-batch {mb} before its forward"
                        ))
                    })?;
                    let weight = targets.get(mb).map_or(0.0, |t| {
                        t.samples("targets").unwrap_or(0) as f32 / samples as f32
                    });
                    loss += self.backward(module, mb, flight, weight, &mut acc)? * weight;
                }
            }
        }
        let mut grads = acc.grads();
        if let Some(dp) = &mut self.replicas {
            grads = dp.average(grads, module)?;
        }
        Ok(StepOutput {
            grads,
            loss: self.is_last().then_some(loss),
        })
    }

    /// Forward of micro-batch `mb`: receives the inputs, runs the module, sends the outputs.
    fn forward<M: PipelineStage>(&self, module: &M, mb: usize, inputs: Tensors) -> Result<Flight> {
        let (leaves, mut out) = self.run(module, Direction::Forward, mb, inputs)?;
        let mut outputs = Vec::with_capacity(self.outs.len().max(1));
        if self.is_last() {
            let loss = float(out.take_entry(LOSS), self.stage(), LOSS)?;
            if loss.dims.iter().product::<usize>() != 1 {
                return Err(DistError::Pipeline(format!(
                    "the last stage's `{LOSS}` has shape {:?}; it must hold one value",
                    loss.dims
                )));
            }
            outputs.push(loss.tensor);
        }
        outputs.extend(self.send_outputs(Direction::Forward, mb, &mut out)?);
        Ok(Flight { leaves, outputs })
    }

    /// Evaluates one batch, forward only (no gradient is kept): the first stage reads
    /// `batch`, the last stage `targets` and gives back everything its module gave (its loss
    /// and whatever else it declares, such as a count of correct predictions); the other stages
    /// give `None`. Collective over this replica's stages, which must evaluate the same
    /// number of batches; the micro-batches do not apply.
    pub fn evaluate<M: PipelineStage>(
        &mut self,
        module: &M,
        batch: Tensors,
        targets: Tensors,
    ) -> Result<Option<Tensors>> {
        let chunk = self.evaluated;
        self.evaluated += 1;
        let mut inputs = if self.is_first() {
            batch
        } else {
            Tensors::new()
        };
        if self.is_last() {
            merge_targets(&mut inputs, &targets)?;
        }
        let (_, mut out) = self.run(module, Direction::Eval, chunk, inputs)?;
        if self.is_last() {
            return Ok(Some(out));
        }
        self.send_outputs(Direction::Eval, chunk, &mut out)?;
        Ok(None)
    }

    /// Receives the inputs of micro-batch (or evaluation batch) `mb` going `dir` into
    /// `inputs` (as leaves requiring gradients when training), runs the module and checks
    /// that it gave its declared outputs. Gives the leaves and the outputs.
    fn run<M: PipelineStage>(
        &self,
        module: &M,
        dir: Direction,
        mb: usize,
        mut inputs: Tensors,
    ) -> Result<(Vec<Tensor<1>>, Tensors)> {
        let mut leaves = Vec::with_capacity(self.ins.len());
        for &c in &self.ins {
            let from = self.crossings[c].from;
            let bytes = self.receive(c, mb, dir, from)?;
            let (dims, values) =
                wire::decode_shaped(&bytes).map_err(|e| self.malformed(c, mb, from, e))?;
            let numel = values.len();
            let mut x = Tensor::<1>::from_data(TensorData::new(values, [numel]), &self.device);
            if dir == Direction::Forward {
                x = x.require_grad();
                leaves.push(x.clone());
            }
            let value = Flat::Float(x);
            inputs.put_entry(&self.crossings[c].name, Entry { dims, value });
        }
        let out = {
            let _span = tracing::info_span!(target: "flotilla::burn", "forward", mb).entered();
            PipelineStage::forward(module, inputs)?
        };
        self.check_outputs(&out)?;
        Ok((leaves, out))
    }

    /// Sends the outputs in `out` that cross to later stages (going `dir`, for micro-batch or
    /// evaluation batch `mb`); gives them, one per crossing out of the stage.
    fn send_outputs(&self, dir: Direction, mb: usize, out: &mut Tensors) -> Result<Vec<Tensor<1>>> {
        let mut sent = Vec::with_capacity(self.outs.len());
        for &c in &self.outs {
            let name = &self.crossings[c].name;
            let y = float(out.take_entry(name), self.stage(), name)?;
            let payload = wire::encode_shaped(&y.dims, &to_vec(y.tensor.clone())?);
            let to = self.peer(self.crossings[c].to);
            self.world.send(to, wire::tag(dir, c, mb), &payload)?;
            // Another consumer of the same name gets the same tensor.
            let value = Flat::Float(y.tensor.clone());
            out.put_entry(
                name,
                Entry {
                    dims: y.dims,
                    value,
                },
            );
            sent.push(y.tensor);
        }
        Ok(sent)
    }

    /// Backward of micro-batch `mb`; gives the micro-batch's loss on the last stage (else 0).
    fn backward<M: PipelineStage>(
        &self,
        module: &M,
        mb: usize,
        flight: Flight,
        weight: f32,
        acc: &mut GradientsAccumulator<M>,
    ) -> Result<f32> {
        let (seed, loss) = match self.is_last() {
            true => {
                let l = flight.outputs[0].clone();
                let value = to_vec(l.clone())?.first().copied().unwrap_or(f32::NAN);
                (Some(l * weight), value)
            }
            false => (self.seed(mb, &flight.outputs)?, 0.0),
        };
        let _span = tracing::info_span!(target: "flotilla::burn", "backward", mb).entered();
        let grads = seed.filter(Tensor::is_tracked).map(|s| s.backward());
        for (&c, leaf) in self.ins.iter().zip(&flight.leaves) {
            let g = match grads.as_ref().and_then(|g| leaf.grad(g)) {
                Some(g) => to_vec(g)?,
                None => vec![0.0; leaf.dims()[0]],
            };
            let from = self.peer(self.crossings[c].from);
            self.world.send(
                from,
                wire::tag(Direction::Backward, c, mb),
                wire::encode(&g),
            )?;
        }
        if let Some(grads) = grads {
            acc.accumulate(module, GradientsParams::from_grads(grads, module));
        }
        Ok(loss)
    }

    /// `Σ y·g` over the outputs `ys` of micro-batch `mb` and their gradients, received from
    /// the stages that took them.
    fn seed(&self, mb: usize, ys: &[Tensor<1>]) -> Result<Option<Tensor<1>>> {
        let mut seed: Option<Tensor<1>> = None;
        for (&c, y) in self.outs.iter().zip(ys) {
            let n = y.dims()[0];
            let crossing = &self.crossings[c];
            let bytes = self.receive(c, mb, Direction::Backward, crossing.to)?;
            let g = wire::decode(&bytes, n).ok_or_else(|| {
                self.malformed(
                    c,
                    mb,
                    crossing.to,
                    format!("{} bytes for {n} values", bytes.len()),
                )
            })?;
            let g = Tensor::<1>::from_data(TensorData::new(g, [n]), &self.device);
            let term = (y.clone() * g).sum();
            seed = Some(match seed {
                Some(s) => s + term,
                None => term,
            });
        }
        Ok(seed)
    }

    /// The message of crossing `c` for micro-batch `mb` going `dir`, from stage `stage`.
    fn receive(&self, c: usize, mb: usize, dir: Direction, stage: usize) -> Result<Vec<u8>> {
        let peer = self.peer(stage);
        let deadline = Instant::now() + self.world.timeout();
        let _span = tracing::info_span!(target: "flotilla::burn", "recv", peer, mb).entered();
        self.world
            .recv(peer, wire::tag(dir, c, mb), deadline)
            .map_err(|e| {
                let what = match dir {
                    Direction::Backward => "gradient of",
                    Direction::Forward | Direction::Eval | Direction::State => "activation",
                };
                DistError::Peer {
                    rank: self.world.world_rank(peer),
                    message: format!(
                        "pipeline stage {} waited for the {what} `{}` of micro-batch {mb} from stage {stage}: {e}",
                        self.stage(),
                        self.crossings[c].name
                    ),
                }
            })
    }

    fn malformed(&self, c: usize, mb: usize, stage: usize, why: String) -> DistError {
        let peer = self.peer(stage);
        DistError::Peer {
            rank: self.world.world_rank(peer),
            message: format!(
                "stage {stage} sent a malformed `{}` of micro-batch {mb}: {why}",
                self.crossings[c].name
            ),
        }
    }

    /// The group rank of stage `stage` of this replica.
    fn peer(&self, stage: usize) -> usize {
        self.place.replica * self.options.stages + stage
    }

    /// Fails unless the module's forward gave exactly the declared outputs.
    fn check_outputs(&self, out: &Tensors) -> Result<()> {
        let mut gave = out.names();
        let mut declared = self.declared.clone();
        gave.sort();
        declared.sort();
        if gave == declared {
            return Ok(());
        }
        Err(DistError::Pipeline(format!(
            "stage {}'s forward gave {gave:?}, but it declares the outputs {declared:?}",
            self.stage()
        )))
    }
}

/// Draws every lazily initialised parameter of `module` now, in the module's order.
///
/// burn draws a parameter's initial values from the device's generator when it is first
/// read. Left lazy, a stage's parameters would be drawn by its first forward pass, in the
/// order that forward reads them: a stage without replicas (whose parameters nothing reads
/// before) would start from other values than the same stage, seeded alike, with replicas
/// (whose broadcast reads them in the module's order) or saved before training.
fn materialize<M: Module>(module: &M) {
    struct Draw;
    impl ModuleVisitor for Draw {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let _ = std::ops::Deref::deref(param);
        }
        fn visit_int<const D: usize>(&mut self, param: &Param<Tensor<D, Int>>) {
            let _ = std::ops::Deref::deref(param);
        }
        fn visit_bool<const D: usize>(&mut self, param: &Param<Tensor<D, Bool>>) {
            let _ = std::ops::Deref::deref(param);
        }
    }
    module.visit(&mut Draw);
}

/// A float output and its dimensions.
struct FloatOut {
    dims: Vec<usize>,
    tensor: Tensor<1>,
}

fn float(entry: Option<Entry>, stage: usize, name: &str) -> Result<FloatOut> {
    match entry {
        Some(Entry {
            dims,
            value: Flat::Float(tensor),
        }) => Ok(FloatOut { dims, tensor }),
        Some(_) => Err(DistError::Pipeline(format!(
            "stage {stage} gives `{name}` as integers; only float tensors cross stages"
        ))),
        None => Err(DistError::Pipeline(format!(
            "stage {stage}'s forward did not give `{name}`"
        ))),
    }
}

/// The micro-batches of `tensors`.
fn split(tensors: &Tensors, m: usize, what: &str) -> Result<Vec<Tensors>> {
    let n = tensors.samples(what)?;
    if n < m {
        return Err(DistError::Pipeline(format!(
            "{what} of {n} samples cannot be cut into {m} micro-batches"
        )));
    }
    Ok(micro_batches(n, m)
        .iter()
        .map(|r| tensors.rows(r))
        .collect())
}

/// Adds the last stage's targets to its inputs; a name taken twice is refused.
fn merge_targets(inputs: &mut Tensors, targets: &Tensors) -> Result<()> {
    let mut targets = targets.clone();
    for name in targets.names() {
        if inputs.contains(&name) {
            return Err(DistError::Pipeline(format!(
                "target `{name}` has the name of one of the last stage's inputs"
            )));
        }
        if let Some(e) = targets.take_entry(&name) {
            inputs.put_entry(&name, e);
        }
    }
    Ok(())
}

fn to_vec(t: Tensor<1>) -> Result<Vec<f32>> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .map_err(|e| DistError::Tensor(format!("reading values: {e:?}")))
}

/// Gathers every rank's options and names; fails on every rank, naming the first rank that
/// differs from its stage's replica 0, or the first whose options differ from rank 0's.
fn agree(group: &dyn ProcessGroup, options: &PipelineOptions, mine: &Names) -> Result<Vec<Names>> {
    let text = format!("{}\n{}", options.describe(), routes::encode(mine)?);
    let all = group.all_gather_bytes(text.as_bytes())?;
    let all: Vec<String> = all
        .iter()
        .map(|b| String::from_utf8_lossy(b).into_owned())
        .collect();
    let line = |t: &str| t.lines().next().unwrap_or_default().to_string();
    let s = options.stages;
    for (r, t) in all.iter().enumerate() {
        if line(t) != line(&all[0]) {
            return Err(DistError::Pipeline(format!(
                "rank {r} runs `{}`, rank 0 `{}`",
                line(t),
                line(&all[0])
            )));
        }
        if t != &all[r % s] {
            return Err(DistError::Pipeline(format!(
                "rank {r} (stage {} of replica {}) declares other tensor names than rank {}: {:?} against {:?}",
                r % s,
                r / s,
                r % s,
                routes::decode(body(t)),
                routes::decode(body(&all[r % s]))
            )));
        }
    }
    Ok(all[..s].iter().map(|t| routes::decode(body(t))).collect())
}

/// The names part of a rank's gathered text (after the options line).
fn body(text: &str) -> &str {
    text.split_once('\n').map_or("", |(_, b)| b)
}
