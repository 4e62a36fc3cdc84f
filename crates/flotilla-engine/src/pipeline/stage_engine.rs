//! [`StageEngine`]: what a pipeline runs on one rank, whatever the stage is made of — a slice
//! of a spec's layers or a user's burn module ([`crate::Stage`] of either) — with flat
//! buffers in and out, so that the one pipeline (flotilla-train's) drives both.

use std::ops::Range;

use crate::error::Result;
use crate::sharded::ShardedPass;
use crate::spec::shape::Shape;
use crate::weights::ModelState;

/// One input or output of a stage, and one sample's shape: a spec's stage names the model
/// input, its main activation and its logits [`crate::MAIN`] and a skip tensor by its
/// `out_variables` name; a program's stage module names each tensor itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot {
    /// [`crate::MAIN`], an `out_variables` name, or the name a stage module gives.
    pub name: String,
    /// One sample's shape.
    pub shape: Shape,
}

/// What differentiates a sharded stage's last group ([`StageEngine::backward_sharded`]): the loss of the labels (weighted), or the
/// gradients of the output slots.
pub enum StageSeed<'a> {
    /// The last stage: cross-entropy against `labels`, its gradient scaled by `weight`.
    Loss {
        /// One label per sample (or per position of a sequence model).
        labels: &'a [i64],
        /// The micro-batch's share of the batch.
        weight: f32,
    },
    /// An earlier stage: the gradients of its output slots, in order.
    Grads(Vec<Vec<f32>>),
}

/// One pipeline stage: forward and backward on micro-batches, gradients accumulated until
/// [`StageEngine::step`]; its parameters, optimizer state and weight files through
/// [`ModelState`].
pub trait StageEngine: ModelState {
    /// This stage's position in the pipeline.
    fn index(&self) -> usize;

    /// The model layers this stage runs (a program's stage module `s`: `s..s + 1`).
    fn layers(&self) -> Range<usize>;

    /// Whether this is the last stage (it gives logits and computes the loss).
    fn is_last(&self) -> bool;

    /// What [`StageEngine::forward`] takes, in order.
    fn inputs(&self) -> &[Slot];

    /// What [`StageEngine::forward`] gives, in order.
    fn outputs(&self) -> &[Slot];

    /// Seeds the dropout masks of every following [`StageEngine::forward`], as
    /// [`crate::Engine::set_dropout_seed`] does for a whole model.
    fn set_dropout_seed(&mut self, seed: u64);

    /// Micro-batches whose forward ran and whose backward has not.
    fn in_flight(&self) -> usize;

    /// The most micro-batches ever in flight at once.
    fn peak_in_flight(&self) -> usize;

    /// Runs forward on micro-batch `mb` of `n` samples, keeping what its backward needs;
    /// returns the output slots.
    fn forward(&mut self, mb: usize, n: usize, inputs: &[&[f32]]) -> Result<Vec<Vec<f32>>>;

    /// Runs backward for micro-batch `mb` given the gradients of its output slots (same
    /// order and sizes as [`StageEngine::forward`] gave); accumulates the parameters' gradients and
    /// returns the gradients of the input slots (empty on stage 0).
    fn backward(&mut self, mb: usize, grad_outputs: Vec<Vec<f32>>) -> Result<Vec<Vec<f32>>>;

    /// On the last stage: the cross-entropy loss of micro-batch `mb` against `labels` (one per
    /// sample, or one per position of a sequence model), differentiated with weight `weight`
    /// (the micro-batch's share of the batch, so that the accumulated gradient is the whole
    /// batch's mean). Returns the unweighted mean loss and the gradients of the input slots.
    fn backward_loss(
        &mut self,
        mb: usize,
        labels: &[i64],
        weight: f32,
    ) -> Result<(f32, Vec<Vec<f32>>)>;

    /// The gradient accumulated since the last step, in [`crate::ModelState::layout`] order (to be
    /// averaged across replicas in place before [`StageEngine::step`]).
    fn grads_mut(&mut self) -> &mut [f32];

    /// Applies one optimizer step with the accumulated gradient, then zeroes it. Every
    /// micro-batch must have finished its backward pass.
    fn step(&mut self, lr: f64) -> Result<()>;

    /// Drops every micro-batch in flight and the accumulated gradient (after a failure).
    fn reset(&mut self);

    /// Forward without gradients (evaluation): returns the output slots.
    fn forward_eval(&self, n: usize, inputs: &[&[f32]]) -> Result<Vec<Vec<f32>>>;

    /// Cuts a spec stage into parameter groups of at most `max_bytes` each (4 per value)
    /// where only the main activation crosses (the backward groups' rule), what a sharded
    /// stage gathers at once; `0`: one group. A program's stage module is one group.
    ///
    /// # Errors
    /// The spec's shapes do not check.
    fn set_group_bytes(&mut self, max_bytes: usize) -> Result<()>;

    /// The parameter groups, in layer order: consecutive ranges of indices into
    /// [`ModelState::layout`]'s `params`, together all of them.
    fn param_groups(&self) -> Vec<Range<usize>>;

    /// Releases every parameter (the layout keeps their shapes): a sharded stage holds none
    /// between uses; [`ModelState::write_params`] gives them back.
    ///
    /// # Errors
    /// The model is out (a failed pass).
    fn release_params(&mut self) -> Result<()>;

    /// [`StageEngine::forward`] of a released stage, each group's parameters gathered from
    /// `pass` before it runs and released after; the group runs off the tape and only its
    /// input is kept (the module documentation of `pipeline/stage/sharded.rs`).
    ///
    /// # Errors
    /// As [`StageEngine::forward`], and what `pass` met.
    fn forward_sharded(
        &mut self,
        mb: usize,
        n: usize,
        inputs: &[&[f32]],
        pass: &mut dyn ShardedPass,
    ) -> Result<Vec<Vec<f32>>>;

    /// The backward of a micro-batch [`StageEngine::forward_sharded`] ran: from the last
    /// group, each gathered again, recomputed on the tape and differentiated by `seed` (the
    /// last group) or the next group's input gradient, its parameters' gradients handed to
    /// [`ShardedPass::ready`] (group by group from the last, within one in flat order) and
    /// none accumulated in the stage. Returns the loss (by a [`StageSeed::Loss`]) and the
    /// gradients of the input slots (empty on stage 0).
    ///
    /// # Errors
    /// As [`StageEngine::backward`], and what `pass` met.
    fn backward_sharded(
        &mut self,
        mb: usize,
        seed: StageSeed<'_>,
        pass: &mut dyn ShardedPass,
    ) -> Result<(Option<f32>, Vec<Vec<f32>>)>;

    /// [`StageEngine::forward_eval`] of a released stage, group by group through `pass`.
    ///
    /// # Errors
    /// As [`StageEngine::forward_eval`], and what `pass` met.
    fn forward_eval_sharded(
        &mut self,
        n: usize,
        inputs: &[&[f32]],
        pass: &mut dyn ShardedPass,
    ) -> Result<Vec<Vec<f32>>>;
}
