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
/// pass in flat order); the `tied` parameter's gradient is its sum over every pass.
pub(crate) fn for_each_grad<M: Module>(
    model: &M,
    layout: &ParamLayout,
    (passes, tied): (&[GroupGrads], Option<usize>),
    f: &mut dyn FnMut(usize, &[f32]) -> Result<()>,
) -> Result<()> {
    if passes.is_empty() {
        return Err(EngineError::NoGradients);
    }
    for (k, pass) in passes.iter().enumerate() {
        let others = passes
            .iter()
            .enumerate()
            .filter(|&(j, _)| j != k)
            .map(|(_, o)| o);
        hand_on(model, layout, pass, (others, tied), f)?;
    }
    Ok(())
}

/// The parameter that a later layer uses too, whose gradient sums over the groups: the
/// token embedding's table when a linear layer is tied to it (`tie_embedding`).
pub(crate) fn tied_param(model: &SequentialModel, layout: &ParamLayout) -> Option<usize> {
    if !model.ties_embedding() {
        return None;
    }
    layout
        .params
        .iter()
        .position(|p| p.name == "layers.0.weight")
}

/// Calls `f` with `pass`'s gradients as [`params::for_each_grad_in`] does; the `tied`
/// parameter's, when the pass holds it, is its own plus its gradients in `others` (the
/// passes of the other groups, which use it too: a tied head's).
pub(crate) fn hand_on<'a, M: Module>(
    model: &M,
    layout: &ParamLayout,
    pass: &GroupGrads,
    (others, tied): (impl Iterator<Item = &'a GroupGrads>, Option<usize>),
    f: &mut dyn FnMut(usize, &[f32]) -> Result<()>,
) -> Result<()> {
    let (grads, range) = (pass.grads.as_ref(), pass.params.clone());
    let Some(p) = tied.filter(|p| range.contains(p)) else {
        return params::for_each_grad_in(model, grads, layout, range, f);
    };
    let mut extra: Option<Vec<f32>> = None;
    for other in others {
        let Some(g) = other.grads.as_ref() else {
            continue;
        };
        if let Some(more) = params::grad_of(model, g, layout, p)? {
            extra = Some(match extra {
                Some(sum) => sum.iter().zip(&more).map(|(a, b)| a + b).collect(),
                None => more,
            });
        }
    }
    let Some(extra) = extra else {
        return params::for_each_grad_in(model, grads, layout, range, f);
    };
    params::for_each_grad_in(model, grads, layout, range, &mut |i, g| match i == p {
        true => f(
            i,
            &g.iter().zip(&extra).map(|(a, b)| a + b).collect::<Vec<_>>(),
        ),
        false => f(i, g),
    })
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
    let tied = tied_param(model, layout);
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
        let pass = GroupGrads {
            params: groups[g].params.clone(),
            grads,
        };
        // The later groups' passes: a tied head's use of a table this group holds.
        hand_on(model, layout, &pass, (passes.iter(), tied), ready)?;
        passes.push(pass);
    }
    passes.reverse();
    Ok((loss.into_scalar::<f32>(), passes))
}
