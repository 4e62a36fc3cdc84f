//! Activation recomputation (PyTorch's `checkpoint`, per backward group): forward runs each
//! group but the last **off the tape** (burn's autodiff records nothing and keeps no
//! operand) and keeps only the group's input; backward recomputes each group's forward on the
//! tape from its kept input, one group at a time, and differentiates it with the next
//! group's input gradient. At most one group's activations are on the tape at once, beside
//! the groups' inputs.
//!
//! The recomputed forward is the same operations on the same values as the first (the
//! off-tape forward runs the tracked kernels, [`as_tracked`]), so every gradient is bit for
//! bit that of the grouped backward of [`crate::grouped`] (and of one backward pass). Dropout
//! draws each layer's mask from the RNG re-seeded for the step and the layer
//! ([`SequentialModel::dropout_seed`]), so the recomputed forward draws the masks the first
//! one drew. A batch norm's forward updates its running statistics, which the recomputed
//! forward would do a second time: that update is undone
//! ([`updates_undone`]), so the statistics are those of one forward too.
//!
//! Where a group's parameters come from is the [`GroupSource`]'s: the whole model's own
//! ([`forward_backward`], `recompute: true`), or gathered from the ranks' shards for each use
//! ([`crate::sharded`], ZeRO stage 3).

use std::collections::HashMap;
use std::ops::Range;

use burn::prelude::*;
use burn::tensor::Gradients;

use crate::backward_groups::BackwardGroup;
use crate::buffers::Tensors;
use crate::error::{EngineError, Result};
use crate::grouped::GroupGrads;
use crate::kernels::autodiff::as_tracked;
use crate::params::{self, ParamLayout};
use crate::rng::under_rng_lock;
use crate::spec::activation::{Activation, map_tensor};
use crate::spec::model::{Layer, SequentialModel};

/// Where a recomputing pass takes each group's parameters and what it does with them after.
pub(crate) trait GroupSource {
    /// The model that runs group `g`, its parameters on the tape when `tape` (the
    /// recomputed forward) and off it otherwise (the first forward).
    fn model(&mut self, g: usize, tape: bool) -> Result<SequentialModel>;

    /// Group `g`'s first forward is done with `model`.
    fn forward_done(&mut self, g: usize, model: SequentialModel) -> Result<()>;

    /// Group `g`'s backward is done: `model` ran it, `grads` hold its parameters'
    /// gradients (`None`: they got none, which reads as zeros).
    fn backward_done(
        &mut self,
        g: usize,
        model: SequentialModel,
        grads: Option<Gradients>,
    ) -> Result<()>;

    /// Whether the pass keeps every group's forward on the tape, with the parameters it ran
    /// with, until its backward ([`run`]: nothing recomputed); by default it recomputes.
    fn keeps_forward(&self) -> bool {
        false
    }

    /// The model as it stands, for a kept group's backward (its parameters are still those
    /// its forward ran with).
    fn held(&mut self) -> Result<SequentialModel> {
        Err(EngineError::ModelUnavailable)
    }
}

/// Runs `run`, a forward of `model`'s layers `layers` recomputed for its backward, and
/// undoes what it did to the running statistics of a batch norm among them
/// ([`buffers_restored`]). Free when `layers` hold no batch norm: no module walk on the step.
fn updates_undone<T>(
    model: &SequentialModel,
    layers: &Range<usize>,
    run: impl FnOnce() -> T,
) -> Result<T> {
    let normed = model.layers[layers.clone()]
        .iter()
        .any(|l| matches!(l, Layer::BatchNorm(_)));
    if !normed {
        return Ok(run());
    }
    let layout = ParamLayout::of_tensors(model, Tensors::Buffers);
    buffers_restored(model, &layout, run)
}

/// Runs `run`, a forward recomputed for its backward, and undoes what it did to `model`'s
/// buffers (laid out by `layout`): a batch norm's forward updates its running statistics,
/// which the first forward of the same batch already did. The buffers are read before
/// (settled: burn keeps an update pending until the next read) and written back after;
/// every copy of `model` shares them (burn keeps them behind a shared cell), so the copy the
/// forward ran on is restored. Free without buffers. The recomputed output is the first
/// forward's either way: in training a batch norm normalizes by the batch's statistics, not
/// the running ones.
pub(crate) fn buffers_restored<M: Module, T>(
    model: &M,
    layout: &ParamLayout,
    run: impl FnOnce() -> T,
) -> Result<T> {
    if layout.total == 0 {
        return Ok(run());
    }
    let mut kept = vec![0.0; layout.total];
    params::read_values(&model.valid(), layout, &mut kept, Tensors::Buffers)?;
    let out = run();
    // Settle the recomputation's update first: left pending, it would overwrite `kept`.
    drop(model.valid());
    drop(params::write_values(
        model.clone(),
        layout,
        &kept,
        Tensors::Buffers,
    )?);
    Ok(out)
}

/// `forward` of `model`'s layers `layers`, holding the RNG's lock when one of them draws a
/// dropout mask (each re-seeded for its layer by the step's dropout seed, which a pass that
/// recomputes needs: refused without).
fn with_masks<T>(
    model: &SequentialModel,
    layers: &Range<usize>,
    forward: impl FnOnce() -> T,
) -> Result<T> {
    let draws = model.layers[layers.clone()]
        .iter()
        .any(|l| matches!(l, Layer::Dropout(d) if d.prob > 0.0));
    if !draws {
        return Ok(forward());
    }
    if model.dropout_seed.is_none() {
        return Err(EngineError::Recompute(
            "a recomputed forward draws its dropout masks again from the step's dropout seed, \
             and none is set (Engine::set_dropout_seed)"
                .into(),
        ));
    }
    Ok(under_rng_lock(forward))
}

/// `x` without a tape behind it and requiring no gradient (the next group's input off the
/// tape; no copy of the values).
pub(crate) fn detached(x: Activation) -> Activation {
    map_tensor!(x, |t| t.detach())
}

/// A group's forward on the tape, kept for its backward: its input (a leaf that requires
/// its gradient, but the first group's) and its output.
type Taped = (Activation, Activation);

/// The forward of `input` through `groups` (see [`run`]): each group's input kept off the
/// tape for its recomputation, the last group's among them (a recomputing source), or each
/// group run on the tape and kept ([`GroupSource::keeps_forward`]).
fn forward(
    groups: &[BackwardGroup],
    input: Activation,
    source: &mut dyn GroupSource,
) -> Result<(Vec<Activation>, Vec<Taped>)> {
    let _span = tracing::info_span!(target: "flotilla::engine", "forward").entered();
    let keeps = source.keeps_forward();
    let (mut inputs, mut taped) = (Vec::new(), Vec::new());
    let mut x = input;
    for (g, group) in groups.iter().enumerate() {
        let layers = &group.layers;
        if keeps {
            let m = source.model(g, true)?;
            let leaf = if g > 0 { x.require_grad() } else { x };
            let run = || m.run_range(layers.clone(), leaf.clone(), &mut HashMap::new());
            let y = with_masks(&m, layers, run);
            source.forward_done(g, m)?;
            let y = y?;
            x = detached(y.clone());
            taped.push((leaf, y));
        } else if g + 1 < groups.len() {
            let m = source.model(g, false)?;
            let run = || m.run_range(layers.clone(), x.clone(), &mut HashMap::new());
            let y = with_masks(&m, layers, || as_tracked(run))?;
            source.forward_done(g, m)?;
            inputs.push(x);
            x = detached(y);
        } else {
            inputs.push(x);
            break;
        }
    }
    Ok((inputs, taped))
}

/// Forward of `input` and backward through `groups` (layer order, at least one), each
/// group's parameters from `source` (see the module documentation). A source that
/// [`GroupSource::keeps_forward`] runs every group on the tape in forward and keeps it
/// (FSDP's `reshard_after_forward=False`): backward differentiates the kept graphs, group by
/// group from the last, and recomputes nothing. Returns the batch's loss by `loss`.
pub(crate) fn run(
    groups: &[BackwardGroup],
    input: Activation,
    loss: impl FnOnce(Tensor<2>) -> Tensor<1>,
    source: &mut dyn GroupSource,
) -> Result<f32> {
    if groups.is_empty() {
        return Err(EngineError::InvalidSpec("no backward group".into()));
    }
    let (mut inputs, mut taped) = forward(groups, input, source)?;
    let mut grad_out: Option<Activation> = None;
    let mut value = 0.0;
    let mut loss = Some(loss);
    for g in (0..groups.len()).rev() {
        let _span =
            tracing::info_span!(target: "flotilla::engine", "backward", group = g as u64).entered();
        let (m, leaf, y) = match taped.pop() {
            Some((leaf, y)) => (source.held()?, leaf, y),
            None => {
                let m = source.model(g, true)?;
                let input = inputs.pop().ok_or(EngineError::NoGradients)?;
                let leaf = if g > 0 { input.require_grad() } else { input };
                let layers = &groups[g].layers;
                // The last group's forward runs here only (`forward` stops before it): its
                // update of the statistics is the step's one.
                let again = g + 1 < groups.len();
                let y = with_masks(&m, layers, || {
                    let run = || m.run_range(layers.clone(), leaf.clone(), &mut HashMap::new());
                    if again {
                        updates_undone(&m, layers, run)
                    } else {
                        Ok(run())
                    }
                })??;
                (m, leaf, y)
            }
        };
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
        source.backward_done(g, m, grads)?;
    }
    Ok(value)
}

/// The whole model's parameters for a recomputing pass: the model itself on the tape, a
/// copy of its parameter handles off it (no values copied); each group's gradients handed to
/// `ready` as its backward ends and kept.
struct Whole<'a> {
    model: &'a SequentialModel,
    untracked: SequentialModel,
    layout: &'a ParamLayout,
    groups: &'a [BackwardGroup],
    ready: &'a mut dyn FnMut(usize, &[f32]) -> Result<()>,
    kept: Vec<GroupGrads>,
}

impl GroupSource for Whole<'_> {
    fn model(&mut self, _g: usize, tape: bool) -> Result<SequentialModel> {
        Ok(if tape {
            self.model.clone()
        } else {
            self.untracked.clone()
        })
    }

    fn forward_done(&mut self, _g: usize, _model: SequentialModel) -> Result<()> {
        Ok(())
    }

    fn backward_done(
        &mut self,
        g: usize,
        model: SequentialModel,
        grads: Option<Gradients>,
    ) -> Result<()> {
        let pass = GroupGrads {
            params: self.groups[g].params.clone(),
            grads,
        };
        // The later groups' passes: a tied head's use of a table this group holds.
        let tied = crate::grouped::tied_param(&model, self.layout);
        crate::grouped::hand_on(
            &model,
            self.layout,
            &pass,
            (self.kept.iter(), tied),
            self.ready,
        )?;
        self.kept.push(pass);
        Ok(())
    }
}

/// [`crate::grouped::forward_backward`] with each group's forward recomputed in backward
/// (`recompute: true`): the same loss, gradients and order of `ready`'s calls, bit for bit,
/// with one group's activations held at a time instead of all of them.
pub(crate) fn forward_backward(
    model: &SequentialModel,
    layout: &ParamLayout,
    groups: &[BackwardGroup],
    input: Activation,
    loss: impl FnOnce(Tensor<2>) -> Tensor<1>,
    ready: &mut dyn FnMut(usize, &[f32]) -> Result<()>,
) -> Result<(f32, Vec<GroupGrads>)> {
    let mut whole = Whole {
        model,
        untracked: model.clone().no_grad(),
        layout,
        groups,
        ready,
        kept: Vec::with_capacity(groups.len()),
    };
    let value = run(groups, input, loss, &mut whole)?;
    let mut passes = whole.kept;
    passes.reverse();
    Ok((value, passes))
}
