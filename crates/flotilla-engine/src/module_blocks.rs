//! A user's module as the blocks ZeRO-3 shards it by (PyTorch FSDP's `fully_shard` per
//! transformer block): the program's own stage modules ([`crate::StageModule`],
//! `UserModule::with_stages`), which in sequence compute what its whole module computes.
//! Each block is built without its parameters' values (burn draws a parameter at its first
//! use, and a block's never is) and runs with the values a pass gathers for it
//! ([`ModuleBlock`]); [`Blocks`] knows where each block's parameters sit in the whole module's
//! flat order, which they must match tensor for tensor. The pass that runs them is
//! `module_blocks_pass.rs`.

use std::ops::Range;

use burn::tensor::Gradients;

use crate::error::{EngineError, Result};
use crate::params::ParamLayout;
use crate::pipeline::named_tensors::NamedTensors;
use crate::spec::shape::Shape;

/// What the sharded pass does with one block, whatever its module's type.
pub(crate) trait BlockRun {
    /// The names of the tensors it takes and gives.
    fn names(&self) -> (Vec<String>, Vec<String>);

    /// Where its parameters sit among its own (the shapes the gathered values take).
    fn layout(&self) -> &ParamLayout;

    /// Its forward on `inputs` with `values` as its parameters (its layout's flat order),
    /// run as `how` says; they stay in the block until [`BlockRun::release`].
    fn run(&mut self, values: &[f32], inputs: NamedTensors, how: Pass) -> Result<NamedTensors>;

    /// Hands each parameter's gradient in `grads` (zeros for one without) to `ready`, by its
    /// index among the block's own, in flat order.
    fn grads(
        &self,
        grads: Option<&Gradients>,
        ready: &mut dyn FnMut(usize, &[f32]) -> Result<()>,
    ) -> Result<()>;

    /// Drops its parameters' values.
    fn release(&mut self) -> Result<()>;

    /// How many buffer values it keeps (batch norm's running statistics).
    fn buffer_len(&self) -> usize;
}

/// How a block runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pass {
    /// Off the tape: its parameters require no gradient (a first forward, recomputed later).
    Off,
    /// On the tape: its parameters require their gradient.
    Tape,
    /// For evaluation (burn's `valid()`: no autodiff, inference behaviour), on inputs on the
    /// device without autodiff.
    Valid,
}

/// One block of a user's module for ZeRO-3 (opaque outside the engine): a
/// [`crate::StageModule`] whose parameters hold values only while a pass runs it.
pub struct ModuleBlock(Box<dyn BlockRun>);

impl ModuleBlock {
    /// `block` behind the opaque type.
    pub(crate) fn new(block: Box<dyn BlockRun>) -> Self {
        Self(block)
    }
}

/// A user's module as its blocks, in order: what the sharded pass runs.
pub(crate) struct Blocks {
    pub(crate) blocks: Vec<Box<dyn BlockRun>>,
    /// What each block takes and gives.
    pub(crate) names: Vec<(Vec<String>, Vec<String>)>,
    /// Each block's parameters: indices into the whole module's layout.
    pub(crate) params: Vec<Range<usize>>,
    /// One sample of the batch's inputs, which block 0 takes.
    pub(crate) input: Shape,
}

impl Blocks {
    /// `blocks`, in order; `input` is one sample's shape. Refused: no blocks, or a first
    /// block that does not take one tensor or a last that does not give one.
    pub(crate) fn new(blocks: Vec<ModuleBlock>, input: Shape) -> Result<Self> {
        let blocks: Vec<_> = blocks.into_iter().map(|b| b.0).collect();
        let names: Vec<_> = blocks.iter().map(|b| b.names()).collect();
        match (names.first(), names.last()) {
            (Some((first, _)), Some((_, last))) if first.len() == 1 && last.len() == 1 => {}
            _ => {
                return Err(EngineError::InvalidSpec(
                    "a module's blocks: the first takes one tensor (the batch's inputs), the \
                     last gives one (the logits)"
                        .into(),
                ));
            }
        }
        let mut params = Vec::with_capacity(blocks.len());
        let mut first = 0;
        for b in &blocks {
            let n = b.layout().params.len();
            params.push(first..first + n);
            first += n;
        }
        Ok(Self {
            blocks,
            names,
            params,
            input,
        })
    }

    /// Refuses blocks whose parameters are not `layout`'s (the whole module's), tensor for
    /// tensor in flat order, a block without parameters (no group to gather) or one with
    /// buffers.
    pub(crate) fn check(&self, layout: &ParamLayout) -> Result<()> {
        let mine: Vec<_> = self
            .blocks
            .iter()
            .flat_map(|b| b.layout().params.iter())
            .collect();
        let mismatch = |what: String| {
            Err(EngineError::ParamsSharded(format!(
                "the module's stage modules are its ZeRO-3 blocks, whose parameters are the \
                 whole module's in order: {what}"
            )))
        };
        if mine.len() != layout.params.len() {
            return mismatch(format!(
                "the blocks have {} parameter tensors, the module {}",
                mine.len(),
                layout.params.len()
            ));
        }
        for (b, p) in mine.iter().zip(&layout.params) {
            if b.shape != p.shape {
                return mismatch(format!(
                    "block tensor `{}` {:?} where the module has `{}` {:?}",
                    b.name, b.shape, p.name, p.shape
                ));
            }
        }
        if let Some(g) = self.params.iter().position(Range::is_empty) {
            return mismatch(format!("block {g} has no parameters"));
        }
        // A block's forward updates its own buffers, not the module's, which evaluation,
        // the ranks' average and checkpoints read: refused until they are carried back.
        if let Some(g) = self.blocks.iter().position(|b| b.buffer_len() > 0) {
            return Err(EngineError::ParamsSharded(format!(
                "block {g} keeps running statistics (batch norm), which a module run as its \
                 blocks (ZeRO stage 3, recomputation) does not carry back to the module yet: \
                 train it with ZeRO stage 2 or less, without recomputation"
            )));
        }
        Ok(())
    }

    /// The blocks' parameters in the order their gradients are ready (the last block's
    /// first): the module's backward groups under ZeRO-3.
    pub(crate) fn groups(&self) -> Vec<Range<usize>> {
        self.params.iter().rev().cloned().collect()
    }
}
