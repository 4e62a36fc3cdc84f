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

    /// Where its buffers (batch norm's running statistics) sit among its own.
    fn buffer_layout(&self) -> ParamLayout;

    /// Copies its buffers into `out` (their layout's flat order), their pending updates
    /// settled.
    fn read_buffers(&self, out: &mut [f32]) -> Result<()>;

    /// Replaces its buffers with `src` (their layout's flat order).
    fn write_buffers(&mut self, src: &[f32]) -> Result<()>;
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
    /// Each block's buffers: values of the whole module's flat buffers.
    pub(crate) buffers: Vec<Range<usize>>,
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
        let (mut params, mut buffers) = (Vec::new(), Vec::new());
        let (mut first, mut at) = (0, 0);
        for b in &blocks {
            let n = b.layout().params.len();
            params.push(first..first + n);
            first += n;
            let len = b.buffer_layout().total;
            buffers.push(at..at + len);
            at += len;
        }
        Ok(Self {
            blocks,
            names,
            params,
            buffers,
            input,
        })
    }

    /// Refuses blocks whose parameters are not `layout`'s (the whole module's), tensor for
    /// tensor in flat order, or a block without parameters (no group to gather).
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
        Ok(())
    }

    /// Refuses blocks whose buffers (batch norm's running statistics) are not `buffers`'s
    /// (the whole module's), tensor for tensor in flat order: the module's are carried into
    /// the blocks before a pass and back after ([`Blocks::load_buffers`]).
    pub(crate) fn check_buffers(&self, buffers: &ParamLayout) -> Result<()> {
        let layouts: Vec<_> = self.blocks.iter().map(|b| b.buffer_layout()).collect();
        let ours: Vec<_> = layouts
            .iter()
            .flat_map(|l| &l.params)
            .map(|p| &p.shape)
            .collect();
        let theirs: Vec<_> = buffers.params.iter().map(|p| &p.shape).collect();
        if ours != theirs {
            return Err(EngineError::ParamsSharded(format!(
                "the module's stage modules are its blocks, whose running statistics (batch \
                 norm) are the whole module's in order: the blocks have {ours:?}, the module \
                 {theirs:?}"
            )));
        }
        Ok(())
    }

    /// Whether any block keeps buffers.
    pub(crate) fn has_buffers(&self) -> bool {
        self.buffers.iter().any(|r| !r.is_empty())
    }

    /// The whole module's buffers `src` (its flat order) into the blocks.
    pub(crate) fn load_buffers(&mut self, src: &[f32]) -> Result<()> {
        for (block, range) in self.blocks.iter_mut().zip(&self.buffers) {
            if !range.is_empty() {
                block.write_buffers(&src[range.clone()])?;
            }
        }
        Ok(())
    }

    /// The blocks' buffers into `out` (the whole module's flat order).
    pub(crate) fn store_buffers(&self, out: &mut [f32]) -> Result<()> {
        for (block, range) in self.blocks.iter().zip(&self.buffers) {
            if !range.is_empty() {
                block.read_buffers(&mut out[range.clone()])?;
            }
        }
        Ok(())
    }

    /// Block `g`'s buffers (`None`: it keeps none), to undo its recomputed forward's update.
    pub(crate) fn buffers_of(&self, g: usize) -> Result<Option<Vec<f32>>> {
        let len = self.buffers[g].len();
        if len == 0 {
            return Ok(None);
        }
        let mut values = vec![0.0; len];
        self.blocks[g].read_buffers(&mut values)?;
        Ok(Some(values))
    }

    /// The blocks' parameters in the order their gradients are ready (the last block's
    /// first): the module's backward groups under ZeRO-3.
    pub(crate) fn groups(&self) -> Vec<Range<usize>> {
        self.params.iter().rev().cloned().collect()
    }
}
