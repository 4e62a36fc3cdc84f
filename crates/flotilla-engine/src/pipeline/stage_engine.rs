//! [`StageEngine`]: what a pipeline runs on one rank, whatever the stage is made of — a slice
//! of a spec's layers or a user's burn module ([`crate::Stage`] of either) — with flat
//! buffers in and out, so that the one pipeline (flotilla-train's) drives both.

use std::ops::Range;

use crate::error::Result;
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
}
