//! Forward and backward of a model whose parameters are sharded over the ranks (ZeRO stage
//! 3, PyTorch FSDP's `fully_shard` per backward group): no rank holds every parameter at
//! once.
//!
//! The model runs in its backward groups ([`crate::backward_groups`]). Forward: each group's
//! parameters are gathered ([`ShardedPass::gather`]) just before it runs (and the next group's
//! announced, [`ShardedPass::prefetch`], so that its gather may overlap this one's compute), it
//! runs **off the tape** (its parameters and input require no gradient, so burn's autodiff
//! records nothing and keeps no operand), only its input is kept, and its parameters are
//! released. The last group runs on the tape: the loss, its backward, its gradients handed on
//! ([`ShardedPass::ready`]), its parameters released. Then, for each earlier group from the
//! last: its parameters are gathered again, its forward is recomputed on the tape from the kept
//! input (a leaf that requires its gradient), and backward from the next group's input gradient
//! gives its parameters' gradients, handed on, and its own input's; its parameters and the burn
//! gradients are released.
//!
//! Kept (`reshard_after_forward: false`, FSDP2's `reshard_after_forward=False`): each group's
//! parameters are gathered once, before its forward, which runs on the tape; they stay in the
//! model, with the group's activations, until its backward has handed its gradients on. No
//! second gather and no recomputed forward, for every group's parameters and activations held
//! at the end of forward.
//!
//! The recomputed forward is the same operations on the same values as the first, so every
//! gradient is bit for bit that of the grouped backward of [`crate::grouped`] (and of one
//! backward pass). What a rank holds at most: its shard (the caller's), one group's gathered
//! parameters and gradients, the groups' inputs, and one group's activations on the tape.
//!
//! Batch norm's running statistics (buffers) are never released: the recomputed forward's
//! second update of them is undone ([`crate::recompute`]). Dropout draws the same masks both times
//! (each layer's from the step's dropout seed, [`SequentialModel::dropout_seed`]). A head
//! tied to the embedding borrows the first group's table ([`crate::sharded_tie`]). The pass
//! itself is [`crate::recompute`]'s (`recompute: true` runs it on the whole model); this
//! module's [`GroupSource`] gathers and releases each group.

use std::collections::HashMap;
use std::ops::Range;

use burn::prelude::*;
use burn::tensor::Gradients;

use crate::backward_groups::BackwardGroup;
use crate::error::{EngineError, Result};
use crate::params::{self, ParamLayout};
use crate::recompute::{self, GroupSource};
use crate::sharded_tie::Tie;
use crate::spec::activation::Activation;
use crate::spec::model::SequentialModel;

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

    /// Says that [`ShardedPass::gather`] of `params` (the next group's) comes after the
    /// group just gathered has run: a pass that can may start that gather now, so that it
    /// overlaps the current group's compute (FSDP's prefetch). Called right after each
    /// gather but the pass's last, the same on every rank; the default starts nothing.
    ///
    /// # Errors
    /// What the caller met starting it; the pass stops with it.
    fn prefetch(&mut self, params: Range<usize>) -> Result<()> {
        let _ = params;
        Ok(())
    }

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

/// The model with group `group`'s parameters gathered from `pass` (requiring their
/// gradient when `tape`), in `scratch` (reused); `pass` is then told of the `next` group's
/// gather ([`ShardedPass::prefetch`]).
fn gathered(
    model: SequentialModel,
    layout: &ParamLayout,
    (group, next): (&BackwardGroup, Option<&BackwardGroup>),
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
    if let Some(next) = next {
        pass.prefetch(next.params.clone())?;
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

/// A sharded model's parameters for a recomputing pass: each group's gathered from `pass`
/// for each use and released after it, its gradients handed to `pass` and dropped. With
/// `keep`, each group's gathered once, before its forward, and kept (on the tape) until its
/// backward ends.
struct Gathered<'a> {
    model: &'a mut Option<SequentialModel>,
    layout: &'a ParamLayout,
    groups: &'a [BackwardGroup],
    pass: &'a mut dyn ShardedPass,
    scratch: Vec<f32>,
    keep: bool,
    /// A head tied to the embedding's table, which its group borrows ([`Tie`]).
    tie: Option<Tie>,
}

impl GroupSource for Gathered<'_> {
    fn model(&mut self, g: usize, tape: bool) -> Result<SequentialModel> {
        let m = take(self.model)?;
        // The pass's order: forward 0, 1, .. up to the last group (on the tape), then
        // backward down to 0; kept, forward 0 up to the last only.
        let next = if tape && !self.keep {
            g.checked_sub(1)
        } else {
            Some(g + 1)
        };
        let groups = (&self.groups[g], next.and_then(|n| self.groups.get(n)));
        let m = gathered(m, self.layout, groups, self.pass, (&mut self.scratch, tape))?;
        match self.tie.as_mut() {
            Some(tie) => {
                // Kept gathered, the table stays in the model: nothing to lend.
                if !self.keep {
                    tie.gathered(g, &self.scratch, self.layout);
                }
                tie.lend(g, m, self.layout, (tape, self.keep))
            }
            None => Ok(m),
        }
    }

    fn forward_done(&mut self, g: usize, model: SequentialModel) -> Result<()> {
        *self.model = Some(match self.keep {
            true => model,
            false => {
                let m = released(model, self.layout, &self.groups[g])?;
                give_back(self.tie.as_ref(), g, m, self.layout, false)?
            }
        });
        Ok(())
    }

    fn keeps_forward(&self) -> bool {
        self.keep
    }

    fn held(&mut self) -> Result<SequentialModel> {
        take(self.model)
    }

    fn backward_done(
        &mut self,
        g: usize,
        model: SequentialModel,
        grads: Option<Gradients>,
    ) -> Result<()> {
        let pass = &mut *self.pass;
        let mut ready = |i: usize, grad: &[f32]| pass.ready(i, grad);
        let params = self.groups[g].params.clone();
        let handed = match self.tie.as_mut() {
            Some(tie) => tie
                .user_done(g, &model, grads.as_ref(), self.layout)
                .and_then(|()| {
                    let mut summed = tie.summed(g, &mut ready);
                    params::for_each_grad_in(
                        &model,
                        grads.as_ref(),
                        self.layout,
                        params,
                        &mut summed,
                    )
                }),
            None => {
                params::for_each_grad_in(&model, grads.as_ref(), self.layout, params, &mut ready)
            }
        };
        drop(grads);
        let m = released(model, self.layout, &self.groups[g])?;
        *self.model = Some(give_back(self.tie.as_ref(), g, m, self.layout, self.keep)?);
        handed
    }
}

/// `model` after group `g` with a tied table lent to it released ([`Tie::take_back`]).
fn give_back(
    tie: Option<&Tie>,
    g: usize,
    model: SequentialModel,
    layout: &ParamLayout,
    held: bool,
) -> Result<SequentialModel> {
    match tie {
        Some(tie) => tie.take_back(g, model, layout, held),
        None => Ok(model),
    }
}

/// Forward of `input` and backward through `groups` (layer order, at least one) of a model
/// whose parameters `pass` gathers (see the module documentation); `model` holds none
/// between groups (every group released) and is handed back so. With `keep` (FSDP's
/// `reshard_after_forward=False`), each group's parameters are gathered once, before its
/// forward, which runs on the tape, and stay gathered with its activations until its
/// backward ends: half the gathers and no recomputed forward, for every group's parameters
/// and activations held at the end of forward; the same gradients, bit for bit. Returns the
/// batch's loss by `loss`.
pub(crate) fn forward_backward(
    model: &mut Option<SequentialModel>,
    layout: &ParamLayout,
    groups: &[BackwardGroup],
    (input, keep): (Activation, bool),
    loss: impl FnOnce(Tensor<2>) -> Tensor<1>,
    pass: &mut dyn ShardedPass,
) -> Result<f32> {
    let tie = model.as_ref().and_then(|m| Tie::of(m, layout, groups));
    let mut source = Gathered {
        model,
        layout,
        groups,
        pass,
        scratch: Vec::new(),
        keep,
        tie,
    };
    let result = recompute::run(groups, input, loss, &mut source);
    if keep && result.is_err() {
        // The groups gathered so far are released, as after a pass that ended.
        if let Some(m) = model.take() {
            *model = params::write_range(m, layout, 0..layout.params.len(), None, false).ok();
        }
    }
    result
}

/// The logits of `input` (`None`: no samples on this rank, but the gathers take part; on the
/// device without autodiff) by a model whose parameters `pass` gathers, group by group, each
/// run for evaluation (burn's `valid()`: dropout passes its input on) and released after: an
/// evaluation's forward.
pub(crate) fn logits(
    model: &mut Option<SequentialModel>,
    layout: &ParamLayout,
    groups: &[BackwardGroup],
    input: Option<Activation>,
    pass: &mut dyn ShardedPass,
) -> Result<Option<Tensor<2>>> {
    let mut scratch = Vec::new();
    let mut x = input;
    let mut tie = model.as_ref().and_then(|m| Tie::of(m, layout, groups));
    for (g, group) in groups.iter().enumerate() {
        let both = (group, groups.get(g + 1));
        let mut m = gathered(take(model)?, layout, both, pass, (&mut scratch, false))?;
        if let Some(tie) = tie.as_mut() {
            tie.gathered(g, &scratch, layout);
            m = tie.lend(g, m, layout, (false, false))?;
        }
        x = x.map(|x| {
            m.valid()
                .run_range(group.layers.clone(), x, &mut HashMap::new())
        });
        let m = released(m, layout, group)?;
        *model = Some(give_back(tie.as_ref(), g, m, layout, false)?);
    }
    Ok(x.map(Activation::into_logits))
}

/// The model out of its slot (put back by the caller).
fn take(model: &mut Option<SequentialModel>) -> Result<SequentialModel> {
    model.take().ok_or(EngineError::ModelUnavailable)
}
