//! Forward and backward of the whole model in layer groups (chosen by
//! [`crate::backward_groups`]), handing each group's parameter gradients on as soon as its
//! backward is done, as PyTorch DDP's reducer does, so that their all-reduce overlaps the
//! backward of the earlier groups.
//!
//! It is what a pipeline [`crate::Stage`] does across processes, within one model: forward runs
//! group by group on the one model (the same parameters, so one optimizer and one set of
//! weights); at each cut the main activation is detached into a fresh leaf that requires a
//! gradient, which the next group takes as its input. Backward differentiates the loss through
//! the last group, then, for each earlier group, `Σ y·g` over its output `y`, with `g` the
//! gradient of the next group's input leaf, down to group 0. Since only the main activation
//! crosses a cut, every gradient is computed by the same operations on the same values as in one
//! backward pass, and is bit for bit the same.

use std::collections::HashMap;
use std::ops::Range;

use burn::prelude::*;
use burn::tensor::Gradients;

use crate::backward_groups::BackwardGroup;
use crate::error::{EngineError, Result};
use crate::params::{self, ParamLayout};
use crate::spec::activation::Activation;
use crate::spec::model::SequentialModel;

/// The gradients of one backward pass (a group's, or the whole model's).
pub(crate) struct GroupGrads {
    /// The parameters they are for, as indices into [`ParamLayout::params`].
    pub(crate) params: Range<usize>,
    /// burn's gradients (`None`: the group got no gradient, which reads as zeros).
    pub(crate) grads: Option<Gradients>,
}

/// Calls `f(index, gradient)` for every parameter of `passes` (in the order given; within a
/// pass in flat order).
pub(crate) fn for_each_grad<M: Module>(
    model: &M,
    layout: &ParamLayout,
    passes: &[GroupGrads],
    f: &mut dyn FnMut(usize, &[f32]) -> Result<()>,
) -> Result<()> {
    if passes.is_empty() {
        return Err(EngineError::NoGradients);
    }
    for pass in passes {
        params::for_each_grad_in(model, pass.grads.as_ref(), layout, pass.params.clone(), f)?;
    }
    Ok(())
}

/// Forward of `input` through `groups` (layer order, at least one), the loss of the logits by
/// `loss`, then backward group by group from the last, calling `ready` with each group's
/// parameter gradients (in flat order within the group) as soon as its backward is done.
/// Returns the loss and the groups' gradients in layer order.
pub(crate) fn forward_backward(
    model: &SequentialModel,
    layout: &ParamLayout,
    groups: &[BackwardGroup],
    input: Activation,
    loss: impl FnOnce(Tensor<2>) -> Tensor<1>,
    ready: &mut dyn FnMut(usize, &[f32]) -> Result<()>,
) -> Result<(f32, Vec<GroupGrads>)> {
    let samples = input.samples() as u64;
    let forward = tracing::info_span!(
        target: "flotilla::engine",
        "forward",
        samples,
        groups = groups.len() as u64
    )
    .entered();
    // Per group: its input leaf (none for group 0) and its output (none for the last group,
    // whose output goes into the loss).
    let mut inputs: Vec<Option<Activation>> = Vec::with_capacity(groups.len());
    let mut outputs: Vec<Option<Activation>> = Vec::with_capacity(groups.len());
    let mut x = input;
    let mut logits = None;
    for (g, group) in groups.iter().enumerate() {
        let input_leaf = (g > 0).then(|| x.clone());
        // Nothing named crosses a cut, so each group keeps its own named outputs.
        let mut kept = HashMap::new();
        let y = model.run_range(group.layers.clone(), x, &mut kept);
        inputs.push(input_leaf);
        if g + 1 == groups.len() {
            logits = Some(y.into_logits());
            outputs.push(None);
            break;
        }
        x = y.leaf();
        outputs.push(Some(y));
    }
    let logits = logits.ok_or_else(|| EngineError::InvalidSpec("no backward group".into()))?;
    let loss = loss(logits);
    drop(forward);

    let mut passes = Vec::with_capacity(groups.len());
    let mut grad_out: Option<Activation> = None;
    for g in (0..groups.len()).rev() {
        let backward =
            tracing::info_span!(target: "flotilla::engine", "backward", group = g as u64).entered();
        let mut grads = match (g + 1 == groups.len(), outputs[g].take(), grad_out.take()) {
            (true, _, _) => Some(loss.backward()),
            (false, Some(y), Some(gy)) => Some(y.dot_grad(gy)?.backward()),
            // The next group's input got no gradient: this group's parameters get none.
            (false, _, _) => None,
        };
        grad_out = match (&inputs[g], grads.as_mut()) {
            (Some(leaf), Some(grads)) => leaf.take_grad(grads),
            _ => None,
        };
        drop(backward);
        params::for_each_grad_in(
            model,
            grads.as_ref(),
            layout,
            groups[g].params.clone(),
            ready,
        )?;
        passes.push(GroupGrads {
            params: groups[g].params.clone(),
            grads,
        });
    }
    passes.reverse();
    Ok((loss.into_scalar::<f32>(), passes))
}
