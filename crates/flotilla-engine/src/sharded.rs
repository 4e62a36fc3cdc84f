//! Forward and backward of a model whose parameters are sharded over the ranks (ZeRO stage
//! 3, PyTorch FSDP's `fully_shard` per backward group): no rank holds every parameter at
//! once.
//!
//! The model runs in its backward groups ([`crate::backward_groups`]). Forward: each group's
//! parameters are gathered ([`ShardedPass::gather`]) just before it runs, it runs **off the
//! tape** (its parameters and input require no gradient, so burn's autodiff records nothing
//! and keeps no operand), only its input is kept, and its parameters are released. The last
//! group runs on the tape: the loss, its backward, its gradients handed on
//! ([`ShardedPass::ready`]), its parameters released. Then, for each earlier group from the
//! last: its parameters are gathered again, its forward is recomputed on the tape from the
//! kept input (a leaf that requires its gradient), and backward from the next group's input
//! gradient gives its parameters' gradients, handed on, and its own input's; its
//! parameters and the burn gradients are released.
//!
//! The recomputed forward is the same operations on the same values as the first, so every
//! gradient is bit for bit that of the grouped backward of [`crate::grouped`] (and of one
//! backward pass). What a rank holds at most: its shard (the caller's), one group's gathered
//! parameters and gradients, the groups' inputs, and one group's activations on the tape.
//!
//! A layer whose forward changes state (batch norm's running statistics) or draws random
//! numbers (dropout) would do so twice: such a model is refused
//! ([`check_shardable`]).

use std::collections::HashMap;
use std::ops::Range;

use burn::prelude::*;

use crate::backward_groups::BackwardGroup;
use crate::error::{EngineError, Result};
use crate::kernels::autodiff::as_tracked;
use crate::params::{self, ParamLayout};
use crate::spec::activation::{Activation, map_tensor};
use crate::spec::model::{Layer, SequentialModel};

/// Where a sharded model's parameters come from and where its gradients go: the caller's
/// side of [`crate::Engine::forward_backward_sharded`] (a ZeRO-3 rank's shard and its
/// collectives).
pub trait ShardedPass {
    /// Writes the values of the parameters `params` (a backward group's: consecutive
    /// indices into the layout's `params`, their values one after the other in flat order)
    /// into `out`, whose length is theirs. Collective: every rank gathers the same groups in
    /// the same order.
    ///
    /// # Errors
    /// What the caller's gathering met; the pass stops with it.
    fn gather(&mut self, params: Range<usize>, out: &mut [f32]) -> Result<()>;

    /// Takes the gradient of parameter `param` (an index into the layout's `params`), as
    /// [`crate::Engine::forward_backward_streaming`]'s `ready` does: every parameter once,
    /// group by group from the last, within a group in flat order.
    ///
    /// # Errors
    /// What the caller met; the pass stops with it.
    fn ready(&mut self, param: usize, grad: &[f32]) -> Result<()>;
}

/// Where a ZeRO-3 rank's shard of the initial parameters goes as
/// [`crate::BurnEngine::new_released`] draws them, one layer at a time.
pub trait ShardSink {
    /// The model's layout and its backward groups (in the order of
    /// [`crate::Engine::backward_groups`]), before any value.
    ///
    /// # Errors
    /// The caller's; the engine is not built.
    fn plan(&mut self, layout: &ParamLayout, groups: &[Range<usize>]) -> Result<()>;

    /// Parameter `param`'s initial values (every parameter once, in flat order).
    ///
    /// # Errors
    /// The caller's; the engine is not built.
    fn values(&mut self, param: usize, values: &[f32]) -> Result<()>;
}

/// Refuses a model whose forward pass changes state or draws random numbers, which the
/// recomputed forward of a sharded backward would do twice.
pub(crate) fn check_shardable(model: &SequentialModel) -> Result<()> {
    for (i, layer) in model.layers.iter().enumerate() {
        let why = match layer {
            Layer::BatchNorm(_) => "batch norm updates its running statistics in forward",
            Layer::Dropout(d) if d.prob > 0.0 => "dropout draws its mask in forward",
            _ => continue,
        };
        return Err(EngineError::ParamsSharded(format!(
            "layer {i}: {why}, and a sharded backward recomputes each group's forward; \
             train it with ZeRO stage 2 or less"
        )));
    }
    Ok(())
}

/// The model with group `group`'s parameters gathered from `pass` (requiring their
/// gradient when `tape`), in `scratch` (reused).
fn gathered(
    model: SequentialModel,
    layout: &ParamLayout,
    group: &BackwardGroup,
    pass: &mut dyn ShardedPass,
    (scratch, tape): (&mut Vec<f32>, bool),
) -> Result<SequentialModel> {
    let len: usize = layout.params[group.params.clone()]
        .iter()
        .map(|p| p.len)
        .sum();
    scratch.clear();
    scratch.resize(len, 0.0);
    {
        let _span = tracing::info_span!(target: "flotilla::engine", "gather_params").entered();
        pass.gather(group.params.clone(), scratch)?;
    }
    params::write_range(model, layout, group.params.clone(), Some(scratch), tape)
}

/// `model` with group `group`'s parameters released.
fn released(
    model: SequentialModel,
    layout: &ParamLayout,
    group: &BackwardGroup,
) -> Result<SequentialModel> {
    params::write_range(model, layout, group.params.clone(), None, false)
}

/// `x` without a tape behind it and requiring no gradient (the next group's input off the
/// tape; no copy of the values).
fn detached(x: Activation) -> Activation {
    map_tensor!(x, |t| t.detach())
}

/// Forward of `input` and backward through `groups` (layer order, at least one) of a model
/// whose parameters `pass` gathers (see the module documentation); `model` holds none
/// between groups (every group released) and is handed back so. Returns the batch's loss
/// by `loss`.
pub(crate) fn forward_backward(
    model: &mut Option<SequentialModel>,
    layout: &ParamLayout,
    groups: &[BackwardGroup],
    input: Activation,
    loss: impl FnOnce(Tensor<2>) -> Tensor<1>,
    pass: &mut dyn ShardedPass,
) -> Result<f32> {
    let last = groups
        .len()
        .checked_sub(1)
        .ok_or_else(|| EngineError::InvalidSpec("no backward group".into()))?;
    let mut scratch = Vec::new();
    // Each group's input, kept off the tape for its recomputation.
    let mut inputs: Vec<Activation> = Vec::with_capacity(groups.len());
    let mut x = input;
    {
        let _span = tracing::info_span!(target: "flotilla::engine", "forward").entered();
        for group in &groups[..last] {
            let m = take(model)?;
            let m = gathered(m, layout, group, pass, (&mut scratch, false))?;
            let y =
                as_tracked(|| m.run_range(group.layers.clone(), x.clone(), &mut HashMap::new()));
            *model = Some(released(m, layout, group)?);
            inputs.push(x);
            x = detached(y);
        }
    }
    inputs.push(x);
    let mut grad_out: Option<Activation> = None;
    let mut value = 0.0;
    let mut loss = Some(loss);
    for g in (0..groups.len()).rev() {
        let group = &groups[g];
        let _span =
            tracing::info_span!(target: "flotilla::engine", "backward", group = g as u64).entered();
        let m = gathered(take(model)?, layout, group, pass, (&mut scratch, true))?;
        let input = inputs.pop().ok_or(EngineError::NoGradients)?;
        let leaf = if g > 0 { input.require_grad() } else { input };
        let y = m.run_range(group.layers.clone(), leaf.clone(), &mut HashMap::new());
        let mut grads = if let Some(loss) = loss.take() {
            let l = loss(y.into_logits());
            let grads = l.backward();
            value = l.into_scalar::<f32>();
            Some(grads)
        } else {
            match grad_out.take() {
                Some(gy) => Some(y.dot_grad(gy)?.backward()),
                // The next group's input got no gradient: this group's parameters get none.
                None => None,
            }
        };
        grad_out = match (g > 0, grads.as_mut()) {
            (true, Some(grads)) => leaf.take_grad(grads),
            _ => None,
        };
        let handed = params::for_each_grad_in(
            &m,
            grads.as_ref(),
            layout,
            group.params.clone(),
            &mut |i, grad| pass.ready(i, grad),
        );
        drop(grads);
        *model = Some(released(m, layout, group)?);
        handed?;
    }
    Ok(value)
}

/// The logits of `input` (`None`: no samples on this rank, but the gathers take part) by a
/// model whose parameters `pass` gathers, group by group off the tape, each released after
/// it ran: an evaluation's forward.
pub(crate) fn logits(
    model: &mut Option<SequentialModel>,
    layout: &ParamLayout,
    groups: &[BackwardGroup],
    input: Option<Activation>,
    pass: &mut dyn ShardedPass,
) -> Result<Option<Tensor<2>>> {
    let mut scratch = Vec::new();
    let mut x = input;
    for group in groups {
        let m = gathered(take(model)?, layout, group, pass, (&mut scratch, false))?;
        x = x.map(|x| m.run_range(group.layers.clone(), x, &mut HashMap::new()));
        *model = Some(released(m, layout, group)?);
    }
    Ok(x.map(Activation::into_logits))
}

/// The model out of its slot (put back by the caller).
fn take(model: &mut Option<SequentialModel>) -> Result<SequentialModel> {
    model.take().ok_or(EngineError::ModelUnavailable)
}
