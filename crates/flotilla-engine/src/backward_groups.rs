//! Choosing the layer groups of a grouped backward pass (see [`crate::grouped`]).
//!
//! Backward runs group by group, last group first, and each group's parameter gradients are
//! handed on as soon as its backward is done (so a data-parallel strategy can start their
//! all-reduce while backward continues). The groups are consecutive ranges of layers, chosen
//! **from the last layer backwards**:
//!
//! - A cut between layers `c - 1` and `c` is allowed only where nothing but the main
//!   activation crosses it: no named tensor (`out_variables`) produced before `c` is taken by a
//!   layer at or after `c` (the [`crate::Crossing`]s of a [`crate::StageCut`] at `c` would be the
//!   main activation alone). A skip's gradient is the sum of the gradients of its consumers;
//!   cut across, it would be summed in another order than in one backward pass, and the
//!   gradients would no longer be bit for bit those of [`crate::Engine::forward_backward`].
//!   The allowed cuts divide the model into indivisible **segments**.
//! - Going backwards, segments are added to the open group while its parameter bytes (4 per
//!   `f32`) stay within `max_bytes`; a segment with parameters that would overflow it closes
//!   the group and opens the next one. A segment larger than `max_bytes` is a group of its own.
//! - Layers without parameters never open a group: they join the **earlier** group (the one
//!   before them in layer order), so that a group's gradients are handed on as soon as its
//!   own parameterised layers are differentiated, before the backward of the parameterless
//!   layers below them (a ReLU, a pooling). Parameterless layers before the first layer with
//!   parameters belong to group 0; after the last, to the last group. So every group has
//!   parameters (unless the model has none: then there is one group).
//! - `max_bytes = 0` turns grouping off: one group of every layer, today's one backward pass.
//!   `usize::MAX` gives the same single group.

use std::ops::Range;

use crate::error::{EngineError, Result};
use crate::params::ParamLayout;
use crate::pipeline::cut::ranges_from_points;
use crate::spec::ModelSpec;
use crate::spec::graph;
use crate::spec::model::SequentialModel;

/// One group of a grouped backward pass: consecutive layers and their parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackwardGroup {
    /// The model layers of the group.
    pub layers: Range<usize>,
    /// Their parameter tensors, as indices into [`ParamLayout::params`] (consecutive, since
    /// parameters are in layer order).
    pub params: Range<usize>,
    /// Bytes of those parameters (4 per value).
    pub bytes: usize,
}

/// The parameter tensors and values of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct LayerParams {
    /// Number of parameter tensors.
    pub(crate) tensors: usize,
    /// Number of values.
    pub(crate) values: usize,
}

/// The parameters of each layer of `model`, in layer order.
pub(crate) fn layer_params(model: &SequentialModel) -> Vec<LayerParams> {
    model
        .layers
        .iter()
        .map(|layer| {
            let layout = ParamLayout::of(layer);
            LayerParams {
                tensors: layout.params.len(),
                values: layout.total,
            }
        })
        .collect()
}

/// The layers `c` (in `1..layers`) before which a cut leaves only the main activation
/// crossing: no named tensor produced before `c` is taken at or after `c`. Ascending.
pub(crate) fn clean_cuts(spec: &ModelSpec) -> Result<Vec<usize>> {
    // Shape inference checks that every name has exactly one earlier producer.
    spec.infer_io()?;
    let producers = graph::producers(&spec.layers)?;
    let n = spec.layers.len();
    let mut crossed = vec![false; n + 1];
    for (consumer, node) in spec.layers.iter().enumerate() {
        for name in &node.dependencies {
            if let Some(&producer) = producers.get(name)
                && let Some(cuts) = crossed.get_mut(producer + 1..=consumer)
            {
                cuts.fill(true);
            }
        }
    }
    Ok((1..n).filter(|&c| !crossed[c]).collect())
}

/// The groups of `spec` (whose layers have the parameters `layers`) for at most `max_bytes`
/// of parameters per group where the allowed cuts permit (see the module documentation), in
/// layer order (group 0 holds the first layers; backward runs the last group first).
pub(crate) fn plan(
    spec: &ModelSpec,
    layers: &[LayerParams],
    max_bytes: usize,
) -> Result<Vec<BackwardGroup>> {
    let n = spec.layers.len();
    if layers.len() != n {
        return Err(EngineError::InvalidSpec(format!(
            "backward groups: {} layers of parameters for a spec of {n} layers",
            layers.len()
        )));
    }
    let bytes_of = |r: Range<usize>| -> usize {
        layers[r]
            .iter()
            .map(|l| l.values.saturating_mul(std::mem::size_of::<f32>()))
            .fold(0, usize::saturating_add)
    };
    let mut starts = Vec::new();
    if max_bytes != 0 {
        let mut bounds = vec![0];
        bounds.extend(clean_cuts(spec)?);
        bounds.push(n);
        // The open group's parameter bytes, and the first layer of its earliest segment with
        // parameters (where it starts if an earlier segment overflows it).
        let mut open = 0usize;
        let mut low = n;
        for w in bounds.windows(2).rev() {
            let segment = bytes_of(w[0]..w[1]);
            if segment == 0 {
                continue;
            }
            if open > 0 && open.saturating_add(segment) > max_bytes {
                starts.push(low);
                open = 0;
            }
            open = open.saturating_add(segment);
            low = w[0];
        }
        starts.reverse();
    }
    let mut first_param = 0;
    Ok(ranges_from_points(&starts, n)
        .into_iter()
        .map(|layers_range| {
            let tensors: usize = layers[layers_range.clone()].iter().map(|l| l.tensors).sum();
            let group = BackwardGroup {
                params: first_param..first_param + tensors,
                bytes: bytes_of(layers_range.clone()),
                layers: layers_range,
            };
            first_param += tensors;
            group
        })
        .collect())
}
