//! ZeRO-3's forward and backward of a user's module as its blocks ([`Blocks`]): what
//! `sharded.rs` does for a spec's backward groups, with the program's own modules as the
//! groups; with the module's own parameters as the source ([`OwnParams`]), its recomputation
//! (`recompute: true`). Forward: each block's parameters are gathered
//! ([`ShardedPass::gather`], the next block's announced), it runs **off the tape** on its
//! inputs (kept for backward), and its parameters are released. The last block runs on the
//! tape, then the loss, its backward, its gradients handed on ([`ShardedPass::ready`]). Then,
//! for each earlier block from the last: gathered again, its forward recomputed on the tape
//! from its kept inputs (leaves that require their gradient), differentiated with the
//! gradients its outputs got from the blocks that took them; its parameters' gradients are
//! handed on and its inputs' go to the blocks that gave them. A recomputed forward's
//! update of a block's running statistics (batch norm) is undone: they are those of one
//! forward.
//!
//! A block takes each input from the nearest earlier block that gives it (the batch's
//! inputs for the first), as a pipeline of the same modules routes them; a tensor that two
//! blocks take gets the sum of their gradients. Dropout: each block's forward draws from
//! the RNG seeded for that block and step ([`Weights::with_block_rng`]), so its recomputation
//! draws the same masks. The first forward runs the tracked kernels ([`as_tracked`]): the
//! recomputed one is the same operations on the same values, so the gradients are those of
//! the module's blocks run once on the tape, bit for bit.

use std::collections::HashMap;
use std::ops::Range;

use burn::module::Module;
use burn::prelude::*;

use crate::error::{EngineError, Result};
use crate::kernels::autodiff::as_tracked;
use crate::module_blocks::{Blocks, Pass};
use crate::params::{self, ParamLayout};
use crate::pipeline::named_tensors::NamedTensors;
use crate::recompute::detached;
use crate::sharded::ShardedPass;
use crate::spec::activation::Activation;
use crate::spec::graph::Merge;
use crate::weights::Weights;

/// One input of a block as the pass keeps it: its name, the block that gave it (`None`: the
/// batch) and its value.
struct Kept {
    name: String,
    from: Option<usize>,
    value: Activation,
}

/// What earlier blocks gave, by name: the nearest giver and the value.
type Given = HashMap<String, (Option<usize>, Activation)>;

/// Forward of `input` and backward through `blocks` (see the module documentation), each
/// block's parameters gathered from `pass` and its gradients handed to it; every block is
/// released after, failed or not. With `keep` (FSDP's `reshard_after_forward=False`), each
/// block is gathered once, before its forward, which runs on the tape and is kept, with its
/// parameters, until its backward: nothing recomputed, the same gradients. Returns the
/// batch's loss by `loss`.
pub(crate) fn forward_backward<M: Module>(
    blocks: &mut Blocks,
    weights: &Weights<M>,
    (input, keep): (Activation, bool),
    loss: impl FnOnce(Tensor<2>) -> Tensor<1>,
    pass: &mut dyn ShardedPass,
) -> Result<f32> {
    let result = run(blocks, weights, (input, keep), loss, pass);
    if result.is_err() {
        release_all(blocks);
    }
    result
}

/// A block's forward on the tape: its inputs (leaves that require their gradient, but the
/// batch's) and its outputs.
type Taped = (Vec<Kept>, NamedTensors);

/// The forward of `input` through `blocks` (see [`forward_backward`]): each block's inputs
/// kept off the tape for its recomputation, the last block's among them, or (`keep`) each
/// block run on the tape and kept.
fn forward<M: Module>(
    blocks: &mut Blocks,
    weights: &Weights<M>,
    (input, keep): (Activation, bool),
    pass: &mut dyn ShardedPass,
    scratch: &mut Vec<f32>,
) -> Result<(Vec<Vec<Kept>>, Vec<Taped>)> {
    let _span = tracing::info_span!(target: "flotilla::engine", "forward").entered();
    let last = blocks.blocks.len() - 1;
    let mut given = Given::new();
    given.insert(blocks.names[0].0[0].clone(), (None, input));
    let (mut kept, mut taped) = (Vec::new(), Vec::new());
    for g in 0..=last {
        let inputs = inputs_of(blocks, &given, g)?;
        if g == last && !keep {
            kept.push(inputs);
            break;
        }
        gather(blocks, g, (g < last).then_some(g + 1), pass, scratch)?;
        let block = &mut blocks.blocks[g];
        let (inputs, out) = if keep {
            let leaves = leaves(inputs);
            let run = || block.run(scratch, named(&leaves), Pass::Tape);
            let out = weights.with_block_rng(g, run);
            (leaves, out)
        } else {
            let run = || as_tracked(|| block.run(scratch, named(&inputs), Pass::Off));
            let out = weights.with_block_rng(g, run);
            block.release()?;
            (inputs, out)
        };
        let out = out?;
        for name in &blocks.names[g].1 {
            let value = detached(out.activation(name, g)?);
            given.insert(name.clone(), (Some(g), value));
        }
        match keep {
            true => taped.push((inputs, out)),
            false => kept.push(inputs),
        }
    }
    Ok((kept, taped))
}

/// `inputs` as a block's forward on the tape takes them: those an earlier block gave as
/// leaves that require their gradient.
fn leaves(inputs: Vec<Kept>) -> Vec<Kept> {
    inputs
        .into_iter()
        .map(|k| match k.from {
            Some(_) => Kept {
                value: k.value.require_grad(),
                ..k
            },
            None => k,
        })
        .collect()
}

/// [`forward_backward`] without the release after a failure.
fn run<M: Module>(
    blocks: &mut Blocks,
    weights: &Weights<M>,
    input: (Activation, bool),
    loss: impl FnOnce(Tensor<2>) -> Tensor<1>,
    pass: &mut dyn ShardedPass,
) -> Result<f32> {
    let mut scratch = Vec::new();
    let (mut kept, mut taped) = forward(blocks, weights, input, pass, &mut scratch)?;
    let mut grads_of = HashMap::new();
    let mut value = 0.0;
    let mut loss = Some(loss);
    for g in (0..blocks.blocks.len()).rev() {
        let _span =
            tracing::info_span!(target: "flotilla::engine", "backward", group = g as u64).entered();
        let (leaves, out) = match taped.pop() {
            Some(t) => t,
            None => {
                let inputs = kept.pop().ok_or(EngineError::NoGradients)?;
                gather(blocks, g, g.checked_sub(1), pass, &mut scratch)?;
                let leaves = leaves(inputs);
                // A block's recomputed forward updates its running statistics a second
                // time: undone (the last block's forward runs here only, once).
                let settled = match g + 1 < blocks.blocks.len() {
                    true => blocks.buffers_of(g)?,
                    false => None,
                };
                let block = &mut blocks.blocks[g];
                let run = || block.run(&scratch, named(&leaves), Pass::Tape);
                let out = weights.with_block_rng(g, run);
                if let Some(values) = settled {
                    block.write_buffers(&values)?;
                }
                (leaves, out?)
            }
        };
        let outputs = &blocks.names[g].1;
        let mut grads = match loss.take() {
            Some(loss) => {
                let l = loss(out.activation(&outputs[0], g)?.into_logits());
                let grads = l.backward();
                value = l.into_scalar::<f32>();
                Some(grads)
            }
            None => seed(&out, outputs, g, &mut grads_of)?.map(|s| s.backward()),
        };
        if let Some(grads) = grads.as_mut() {
            for k in &leaves {
                if let (Some(from), Some(dx)) = (k.from, k.value.take_grad(grads)) {
                    add_grad(&mut grads_of, (from, k.name.clone()), dx);
                }
            }
        }
        let first = blocks.params[g].start;
        let block = &mut blocks.blocks[g];
        block.grads(grads.as_ref(), &mut |i, grad| pass.ready(first + i, grad))?;
        drop(grads);
        block.release()?;
    }
    Ok(value)
}

/// The logits of `input` (`None`: no samples on this rank, but the gathers take part) by the
/// blocks, each gathered from `pass`, run for evaluation and released: an evaluation's
/// forward. `input` is on the device without autodiff.
pub(crate) fn logits(
    blocks: &mut Blocks,
    input: Option<Activation>,
    pass: &mut dyn ShardedPass,
) -> Result<Option<Tensor<2>>> {
    let last = blocks.blocks.len() - 1;
    let mut scratch = Vec::new();
    let mut given = Given::new();
    let has_input = input.is_some();
    if let Some(x) = input {
        given.insert(blocks.names[0].0[0].clone(), (None, x));
    }
    for g in 0..=last {
        gather(blocks, g, (g < last).then_some(g + 1), pass, &mut scratch)?;
        if has_input {
            let inputs = inputs_of(blocks, &given, g)?;
            let block = &mut blocks.blocks[g];
            let out = block.run(&scratch, named(&inputs), Pass::Valid);
            block.release()?;
            let out = out?;
            for name in &blocks.names[g].1 {
                given.insert(name.clone(), (Some(g), out.activation(name, g)?));
            }
        }
    }
    if !has_input {
        return Ok(None);
    }
    let name = &blocks.names[last].1[0];
    let (_, logits) = given
        .remove(name)
        .ok_or_else(|| EngineError::Batch(format!("the last block gave no `{name}`")))?;
    Ok(Some(logits.into_logits()))
}

/// The whole module's own parameters as the blocks' source (`recompute: true`, nothing
/// sharded): each block's values read from `model`, its gradients kept in `grads` (flat
/// order) and handed to `ready`.
pub(crate) struct OwnParams<'a, M> {
    pub(crate) model: &'a M,
    pub(crate) layout: &'a ParamLayout,
    pub(crate) grads: &'a mut [f32],
    pub(crate) ready: &'a mut dyn FnMut(usize, &[f32]) -> Result<()>,
}

impl<M: Module> ShardedPass for OwnParams<'_, M> {
    fn gather(&mut self, params: Range<usize>, out: &mut [f32]) -> Result<()> {
        params::read_range(self.model, self.layout, params, out)
    }

    fn ready(&mut self, param: usize, grad: &[f32]) -> Result<()> {
        let p = &self.layout.params[param];
        self.grads[p.offset..p.offset + p.len].copy_from_slice(grad);
        (self.ready)(param, grad)
    }
}

/// Block `g`'s parameters gathered from `pass` into `scratch`; `pass` is then told of the
/// `next` block's gather.
fn gather(
    blocks: &Blocks,
    g: usize,
    next: Option<usize>,
    pass: &mut dyn ShardedPass,
    scratch: &mut Vec<f32>,
) -> Result<()> {
    scratch.clear();
    scratch.resize(blocks.blocks[g].layout().total, 0.0);
    {
        let _span = tracing::info_span!(target: "flotilla::engine", "gather_params").entered();
        pass.gather(blocks.params[g].clone(), scratch)?;
    }
    if let Some(next) = next.and_then(|n| blocks.params.get(n)) {
        pass.prefetch(next.clone())?;
    }
    Ok(())
}

/// Block `g`'s inputs, each from the nearest earlier block that gives it.
fn inputs_of(blocks: &Blocks, given: &Given, g: usize) -> Result<Vec<Kept>> {
    blocks.names[g]
        .0
        .iter()
        .map(|name| match given.get(name) {
            Some((from, value)) => Ok(Kept {
                name: name.clone(),
                from: *from,
                value: value.clone(),
            }),
            None => Err(EngineError::InvalidSpec(format!(
                "block {g} takes `{name}`, which no earlier block gives"
            ))),
        })
        .collect()
}

/// The kept inputs by name, as a block takes them.
fn named(inputs: &[Kept]) -> NamedTensors {
    let mut t = NamedTensors::new();
    for k in inputs {
        t.put(&k.name, k.value.clone());
    }
    t
}

/// The seed of block `g`'s backward: `Σ y · dy` over its outputs `y` that later blocks gave
/// a gradient `dy` (taken from `grads_of`); `None` when none did.
fn seed(
    out: &NamedTensors,
    outputs: &[String],
    g: usize,
    grads_of: &mut HashMap<(usize, String), Activation>,
) -> Result<Option<Tensor<1>>> {
    let mut seed: Option<Tensor<1>> = None;
    for name in outputs {
        if let Some(dy) = grads_of.remove(&(g, name.clone())) {
            let term = out.activation(name, g)?.dot_grad(dy)?;
            seed = Some(match seed {
                Some(s) => s + term,
                None => term,
            });
        }
    }
    Ok(seed)
}

/// Adds `dx` to the gradient kept for `key` (a block's output by name; the same kind of
/// tensor, as the same tensor's gradients are).
fn add_grad(
    grads_of: &mut HashMap<(usize, String), Activation>,
    key: (usize, String),
    dx: Activation,
) {
    let sum = match grads_of.remove(&key) {
        None => dx,
        Some(kept) => kept.merge(dx, Merge::Add),
    };
    grads_of.insert(key, sum);
}

/// Releases every block (after a failed pass; a release's own failure is moot then).
fn release_all(blocks: &mut Blocks) {
    for block in &mut blocks.blocks {
        let _ = block.release();
    }
}
