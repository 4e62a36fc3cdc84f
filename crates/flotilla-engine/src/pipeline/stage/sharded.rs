//! A pipeline stage whose parameters are sharded over its replicas (ZeRO stage 3 among a
//! pipeline's data-parallel replicas; the caller's [`ShardedPass`] gathers and reduces).
//!
//! The stage runs in its parameter groups ([`Stage::param_groups`]: a spec stage's backward
//! groups within its layers, as [`crate::backward_groups`] cuts them, at most
//! [`StageEngine::set_group_bytes`] each; a program's stage module one group). A
//! micro-batch's forward gathers each group's parameters just before it runs, runs it **off
//! the tape** (burn records nothing, [`as_tracked`] keeps the kernels the tape's), keeps only
//! the group's input and releases the parameters. Its backward, from the last group: the
//! group gathered again, its forward recomputed on the tape from the kept input with the
//! micro-batch's dropout seed, differentiated (by the loss on the last stage's last group,
//! by the output slots' gradients, or by the next group's input gradient), its parameters'
//! gradients handed to the pass ([`ShardedPass::ready`]) and the parameters released. So a
//! replica holds, besides its shards: one group's parameters and gradients, the groups'
//! inputs of the micro-batches in flight, and one group's activations.
//!
//! Only the main activation crosses a cut between groups (the backward groups' rule), so
//! the first group takes the stage's every input slot and the last gives every output
//! slot. The recomputed forward is the first one's operations on the same values, and a
//! spec's dropout layers draw their masks from the micro-batch's seed and their index
//! (`SequentialModel::dropout_seed`), so every gradient is bit for bit the unsharded
//! stage's.

use std::ops::Range;

use burn::module::Module;
use burn::tensor::Gradients;

use super::{Stage, StageGroup, vjp_seed};
use crate::ModelState;
use crate::backward_groups::{self, LayerParams};
use crate::engine::labels_tensor;
use crate::error::{EngineError, Result};
use crate::kernels::autodiff::as_tracked;
use crate::params::{self, ParamLayout};
use crate::pipeline::stage_engine::StageSeed;
use crate::recompute::{buffers_restored, detached};
use crate::sharded::ShardedPass;
use crate::spec::ModelSpec;
use crate::spec::activation::Activation;

/// What a micro-batch in flight keeps under sharding: each group's input, off the tape,
/// and the dropout seed its forward ran with.
pub(super) struct Kept {
    inputs: Vec<Vec<Activation>>,
    seed: Option<u64>,
}

impl<M: Module + 'static> Stage<M> {
    /// Group `g`'s parameters gathered from `pass` into the model (requiring their gradient
    /// when `tape`), the group after it in the pass's order (`next`) announced.
    fn gather_group(
        &mut self,
        g: usize,
        next: Option<usize>,
        pass: &mut dyn ShardedPass,
        tape: bool,
    ) -> Result<M> {
        let (slot, layout) = self.weights.released_model()?;
        let model = slot.take().ok_or(EngineError::ModelUnavailable)?;
        let group = &self.groups[g];
        let len = group_len(layout, &group.params);
        self.scratch.clear();
        self.scratch.resize(len, 0.0);
        let gathered = {
            let _span = tracing::info_span!(target: "flotilla::engine", "gather_params").entered();
            pass.gather(group.params.clone(), &mut self.scratch)
        };
        if let Err(e) = gathered {
            *slot = Some(model);
            return Err(e);
        }
        if let Some(next) = next.and_then(|n| self.groups.get(n)) {
            pass.prefetch(next.params.clone())?;
        }
        params::write_range(
            model,
            layout,
            group.params.clone(),
            Some(&self.scratch),
            tape,
        )
    }

    /// Puts `model` back with group `g`'s parameters released.
    fn release_group(&mut self, g: usize, model: M) -> Result<()> {
        let params = self.groups[g].params.clone();
        let (slot, layout) = self.weights.released_model()?;
        *slot = Some(params::write_range(model, layout, params, None, false)?);
        Ok(())
    }

    /// Group `g` of `model` on `acts` (its input slots), dropout masks drawn as the stage
    /// draws them.
    fn run_group(&self, model: &M, g: usize, acts: Vec<Activation>) -> Result<Vec<Activation>> {
        self.weights.with_dropout_rng(|| match self.run_group {
            Some(run) => run(model, &self.slots, self.groups[g].layers.clone(), acts),
            None => (self.run)(model, &self.slots, acts),
        })
    }

    /// [`crate::StageEngine::forward_sharded`].
    pub(super) fn sharded_forward(
        &mut self,
        mb: usize,
        n: usize,
        inputs: &[&[f32]],
        pass: &mut dyn ShardedPass,
    ) -> Result<Vec<Vec<f32>>> {
        self.check_free(mb)?;
        let _span = tracing::info_span!(target: "flotilla::engine", "forward", mb).entered();
        let device = self.weights.device.clone();
        let mut x = self.activations(n, inputs, &device, false)?;
        let mut kept = Vec::with_capacity(self.groups.len());
        for g in 0..self.groups.len() {
            let model = self.gather_group(g, Some(g + 1), pass, false)?;
            let y = as_tracked(|| self.run_group(&model, g, x.clone()));
            self.release_group(g, model)?;
            kept.push(x);
            x = y?.into_iter().map(detached).collect();
        }
        let flat = x.iter().map(Activation::to_flat).collect::<Result<_>>()?;
        let seed = self.seed;
        self.kept.insert(mb, Kept { inputs: kept, seed });
        self.peak = self.peak.max(self.in_flight_count());
        Ok(flat)
    }

    /// [`crate::StageEngine::backward_sharded`].
    pub(super) fn sharded_backward(
        &mut self,
        mb: usize,
        seed: StageSeed<'_>,
        pass: &mut dyn ShardedPass,
    ) -> Result<(Option<f32>, Vec<Vec<f32>>)> {
        let mut kept = self.kept.remove(&mb).ok_or_else(|| {
            EngineError::Batch(format!(
                "stage {}: backward for micro-batch {mb}, which has no forward in flight",
                self.slots.index
            ))
        })?;
        let _span = tracing::info_span!(target: "flotilla::engine", "backward", mb).entered();
        if let Some(s) = kept.seed {
            self.set_seed(s);
        }
        let (mut from_next, mut seed, mut value) = (None::<Activation>, Some(seed), None);
        let mut grad_inputs = Vec::new();
        for g in (0..self.groups.len()).rev() {
            let model = self.gather_group(g, g.checked_sub(1), pass, true)?;
            let inputs = kept.inputs.pop().ok_or(EngineError::NoGradients)?;
            let leaves: Vec<Activation> = match g > 0 || self.slots.index > 0 {
                true => inputs.into_iter().map(Activation::require_grad).collect(),
                false => inputs,
            };
            // The first forward updated the group's running statistics (batch norm): the
            // recomputation's update is undone.
            let layout = self.weights.buffer_layout();
            let y = buffers_restored(&model, layout, || self.run_group(&model, g, leaves.clone()))
                .and_then(|y| y);
            let differentiated = y.and_then(|y| match seed.take() {
                Some(s) => self.seed_backward(y, s).map(|(grads, v)| {
                    value = v;
                    grads
                }),
                None => match from_next.take() {
                    Some(gy) => main_of(y)?.dot_grad(gy).map(|t| t.backward()),
                    None => Err(EngineError::NoGradients),
                },
            });
            let mut grads = match differentiated {
                Ok(grads) => grads,
                Err(e) => {
                    self.release_group(g, model)?;
                    return Err(e);
                }
            };
            let params = self.groups[g].params.clone();
            let layout = &self.weights.layout;
            let handed =
                params::for_each_grad_in(&model, Some(&grads), layout, params, &mut |i, v| {
                    pass.ready(i, v)
                });
            if g > 0 {
                from_next = leaves.first().and_then(|x| x.take_grad(&mut grads));
            } else if self.slots.index > 0 {
                grad_inputs = leaves
                    .iter()
                    .map(|x| x.grad(&grads).unwrap_or_else(|| Ok(vec![0.0; x.numel()])))
                    .collect::<Result<_>>()?;
            }
            drop(grads);
            self.release_group(g, model)?;
            handed?;
        }
        Ok((value, grad_inputs))
    }

    /// The backward of the last group's outputs `y` by `seed`: its gradients, and the
    /// micro-batch's unweighted mean loss when the seed is the loss.
    fn seed_backward(
        &self,
        y: Vec<Activation>,
        seed: StageSeed<'_>,
    ) -> Result<(Gradients, Option<f32>)> {
        match seed {
            StageSeed::Loss { labels, weight } => {
                let logits = main_of(y)?.into_logits();
                let [rows, _] = logits.dims();
                if labels.len() != rows {
                    return Err(EngineError::Batch(format!(
                        "{} labels for a micro-batch of {rows} rows of logits",
                        labels.len()
                    )));
                }
                let targets = labels_tensor(labels, &self.weights.device);
                let loss = self.loss.forward(logits, targets);
                let grads = (loss.clone() * weight).backward();
                Ok((grads, Some(loss.into_scalar::<f32>())))
            }
            StageSeed::Grads(outputs) => {
                if outputs.len() != y.len() {
                    return Err(EngineError::Batch(format!(
                        "stage {}: {} output gradients for {} outputs",
                        self.slots.index,
                        outputs.len(),
                        y.len()
                    )));
                }
                let sum = vjp_seed(&y, outputs)?.ok_or(EngineError::NoGradients)?;
                Ok((sum.backward(), None))
            }
        }
    }

    /// [`crate::StageEngine::forward_eval_sharded`].
    pub(super) fn sharded_eval(
        &mut self,
        n: usize,
        inputs: &[&[f32]],
        pass: &mut dyn ShardedPass,
    ) -> Result<Vec<Vec<f32>>> {
        let device = self.weights.base_device.clone();
        let mut x = self.activations(n, inputs, &device, false)?;
        for g in 0..self.groups.len() {
            let model = self.gather_group(g, Some(g + 1), pass, false)?;
            let valid = model.valid();
            let y = match self.run_group {
                Some(run) => run(&valid, &self.slots, self.groups[g].layers.clone(), x),
                None => (self.run)(&valid, &self.slots, x),
            };
            self.release_group(g, model)?;
            x = y?;
        }
        x.iter().map(Activation::to_flat).collect()
    }
}

/// The values of the parameters `params` of `layout`.
fn group_len(layout: &ParamLayout, params: &Range<usize>) -> usize {
    layout.params[params.clone()].iter().map(|p| p.len).sum()
}

/// The main activation of a group's outputs (the first).
fn main_of(y: Vec<Activation>) -> Result<Activation> {
    y.into_iter().next().ok_or(EngineError::NoGradients)
}

/// The groups of a stage that runs as one: every layer and parameter.
pub(super) fn whole(layers: Range<usize>, layout: &ParamLayout) -> Vec<StageGroup> {
    vec![StageGroup {
        layers,
        params: 0..layout.params.len(),
    }]
}

/// A spec stage's groups for at most `max_bytes` of parameters each: the whole model's
/// backward groups ([`crate::backward_groups::plan`]; the stage's layers alone hold
/// parameters, `layers`) cut to the stage's layers `range`. `0`: one group.
pub(super) fn spec_groups(
    spec: &ModelSpec,
    layers: &[LayerParams],
    range: &Range<usize>,
    max_bytes: usize,
) -> Result<Vec<StageGroup>> {
    let groups = backward_groups::plan(spec, layers, max_bytes)?;
    Ok(groups
        .into_iter()
        .filter_map(|g| {
            let layers = g.layers.start.max(range.start)..g.layers.end.min(range.end);
            (!layers.is_empty()).then_some(StageGroup {
                layers,
                params: g.params,
            })
        })
        .collect())
}
