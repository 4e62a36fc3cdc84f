//! Upper bounds on what a model spec may ask for, checked while its shapes are inferred,
//! before any tensor exists: a spec asking for more is an error naming the limit, never an
//! allocation. The sequence layers' sizes are bounded the same way: an embedding's `vocab`
//! and `dim` and a positional table's `max_len` by the layer's parameters, `dim` also by its
//! output activation, attention `heads` by the scores inside the layer (`heads × T × T` per
//! sample, an activation of its own) and a block's `mlp` by its parameters and hidden
//! activation.

use crate::error::{EngineError, Result};
use crate::spec::layer::LayerSpec;
use crate::spec::shape::Shape;

/// The largest spec file (or text) read, in bytes.
pub const MAX_SPEC_BYTES: u64 = 16 << 20;

/// Bounds on a model spec; [`SpecLimits::default`] is what [`crate::ModelSpec::from_yaml`]
/// applies, [`crate::ModelSpec::from_yaml_with`] takes others.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecLimits {
    /// Most layers in a model.
    pub max_layers: usize,
    /// Most parameters of one layer.
    pub max_layer_params: u64,
    /// Most parameters of the whole model.
    pub max_model_params: u64,
    /// Most values of one sample's activation (the input, every layer's input and output,
    /// and the largest tensor inside a layer: attention scores, a block's MLP hidden layer).
    pub max_activation_values: u64,
}

impl Default for SpecLimits {
    fn default() -> Self {
        SpecLimits {
            max_layers: 10_000,
            max_layer_params: 1 << 30,
            max_model_params: 4 << 30,
            max_activation_values: 1 << 28,
        }
    }
}

impl SpecLimits {
    /// The layer count against `max_layers`.
    pub fn check_layers(&self, layers: usize) -> Result<()> {
        over(
            "the number of layers",
            "max_layers",
            layers as u128,
            self.max_layers as u64,
        )
    }

    /// An activation's size (`what` names it) against `max_activation_values`.
    pub fn check_activation(&self, what: &str, shape: &Shape) -> Result<()> {
        over(
            what,
            "max_activation_values",
            values(shape),
            self.max_activation_values,
        )
    }

    /// The largest tensor inside layer `index` on `input` (attention scores
    /// `heads × T × T`, a transformer block's MLP hidden `T × mlp·d`) against
    /// `max_activation_values`.
    pub fn check_inner(&self, index: usize, layer: &LayerSpec, input: &Shape) -> Result<()> {
        let Shape::Seq { t, d } = *input else {
            return Ok(());
        };
        let (t, d) = (t as u128, d as u128);
        let (what, values) = match *layer {
            LayerSpec::Attention { heads } => ("attention scores", heads as u128 * t * t),
            LayerSpec::TransformerBlock { heads, mlp } => {
                let scores = heads as u128 * t * t;
                let hidden = t * d * mlp as u128;
                match scores >= hidden {
                    true => ("attention scores", scores),
                    false => ("MLP hidden layer", hidden),
                }
            }
            _ => return Ok(()),
        };
        let what = format!("layer {index} ({})'s {what}", layer.kind());
        over(
            &what,
            "max_activation_values",
            values,
            self.max_activation_values,
        )
    }

    /// Layer `index`'s parameter count on `input` against `max_layer_params`; returns it.
    pub fn check_layer_params(
        &self,
        index: usize,
        layer: &LayerSpec,
        input: &Shape,
    ) -> Result<u64> {
        let n = layer_params(layer, input);
        let what = format!("layer {index} ({})'s parameter count", layer.kind());
        over(&what, "max_layer_params", n, self.max_layer_params)?;
        Ok(n as u64)
    }

    /// The model's parameter count against `max_model_params`.
    pub fn check_model_params(&self, total: u64) -> Result<()> {
        let what = "the model's parameter count";
        over(
            what,
            "max_model_params",
            total as u128,
            self.max_model_params,
        )
    }
}

fn over(what: &str, limit: &'static str, value: u128, max: u64) -> Result<()> {
    if value > max as u128 {
        return Err(EngineError::LimitExceeded {
            what: what.to_string(),
            value,
            limit,
            max,
        });
    }
    Ok(())
}

/// Values of one sample of `shape`, without overflow.
fn values(shape: &Shape) -> u128 {
    match *shape {
        Shape::Image { c, h, w } => c as u128 * h as u128 * w as u128,
        Shape::Flat(f) => f as u128,
        Shape::Seq { t, d } => t as u128 * d as u128,
    }
}

/// A layer's parameter count on `input`, without overflow (in `u128`).
pub(crate) fn layer_params(layer: &LayerSpec, input: &Shape) -> u128 {
    let bias = |yes: bool, out: usize| if yes { out as u128 } else { 0 };
    // The features a layer on the last dimension sees (the channels of a batch norm).
    let last = match *input {
        Shape::Image { c, .. } => c as u128,
        Shape::Flat(f) => f as u128,
        Shape::Seq { d, .. } => d as u128,
    };
    // Query, key, value and output projections with their biases.
    let attention = 4 * (last * last + last);
    match (layer, *input) {
        // Its weight is the embedding's, counted there.
        (
            &LayerSpec::Linear {
                out,
                bias: b,
                tie_embedding: true,
            },
            _,
        ) => bias(b, out),
        (&LayerSpec::Linear { out, bias: b, .. }, Shape::Seq { d, .. }) => {
            d as u128 * out as u128 + bias(b, out)
        }
        (&LayerSpec::Linear { out, bias: b, .. }, s) => values(&s) * out as u128 + bias(b, out),
        (
            &LayerSpec::Conv2d {
                out, k, bias: b, ..
            },
            Shape::Image { c, .. },
        ) => c as u128 * out as u128 * k as u128 * k as u128 + bias(b, out),
        (LayerSpec::LayerNorm | LayerSpec::BatchNorm, _) => 2 * last,
        (LayerSpec::RmsNorm, _) => last,
        (&LayerSpec::Embedding { vocab, dim }, _) => vocab as u128 * dim as u128,
        (&LayerSpec::PosEmbedding { max_len }, _) => max_len as u128 * last,
        (LayerSpec::Attention { .. }, _) => attention,
        (&LayerSpec::TransformerBlock { mlp, .. }, _) => {
            let hidden = last * mlp as u128;
            // Two layer norms, attention, and the MLP's two linear layers with biases.
            4 * last + attention + 2 * last * hidden + hidden + last
        }
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use crate::ModelSpec;
    use std::time::{Duration, Instant};

    /// Parses `text`, expecting an error naming `limit`, within milliseconds.
    fn refused(text: &str, limit: &str) {
        let t = Instant::now();
        let e = ModelSpec::from_yaml(text, "crafted.yaml")
            .expect_err("over the limit")
            .to_string();
        assert!(
            t.elapsed() < Duration::from_millis(500),
            "took {:?}",
            t.elapsed()
        );
        assert!(e.contains(limit), "{e}");
    }

    #[test]
    fn a_huge_linear_layer_is_refused_before_allocation() {
        refused(
            "input: [784]\nlayers:\n  - linear: {out: 1000000000000}\n",
            "max_layer_params",
        );
        refused(
            "input: [784]\nlayers:\n  - linear: {out: 18446744073709551615}\n",
            "max_layer_params",
        );
    }

    #[test]
    fn a_huge_convolution_is_refused() {
        refused(
            "input: [3, 8, 8]\nlayers:\n  - conv2d: {out: 100000000, k: 3, padding: 1}\n  - flatten\n  - linear: {out: 2}\n",
            "max_layer_params",
        );
        // A padding that would overflow the image's size.
        refused(
            "input: [1, 8, 8]\nlayers:\n  - conv2d: {out: 1, k: 1, padding: 9223372036854775807}\n  - flatten\n  - linear: {out: 2}\n",
            "is too large",
        );
        // A padding that fits but gives an activation over the limit.
        refused(
            "input: [1, 8, 8]\nlayers:\n  - conv2d: {out: 1, k: 1, padding: 100000}\n  - flatten\n  - linear: {out: 2}\n",
            "max_activation_values",
        );
    }

    #[test]
    fn a_huge_input_or_activation_is_refused() {
        refused(
            "input: [4294967296, 4294967296, 4294967296]\nlayers:\n  - flatten\n  - linear: {out: 2}\n",
            "max_activation_values",
        );
        refused(
            "input: [1000000000000]\nlayers:\n  - relu\n",
            "max_activation_values",
        );
    }

    #[test]
    fn too_many_layers_or_parameters_are_refused() {
        let mut text = String::from("input: [4]\nlayers:\n");
        for _ in 0..10_001 {
            text.push_str("  - relu\n");
        }
        refused(&text, "max_layers");
        let mut wide = String::from("input: [30000]\nlayers:\n");
        for _ in 0..6 {
            wide.push_str("  - linear: {out: 30000}\n");
        }
        refused(&wide, "max_model_params");
        let big = "x".repeat(super::MAX_SPEC_BYTES as usize + 1);
        refused(&big, "MAX_SPEC_BYTES");
    }

    #[test]
    fn huge_sequence_layers_are_refused_before_allocation() {
        let seq = |layers: &str, t: u64| {
            format!(
                "input: [{t}]\nlayers:\n  - embedding: {{vocab: 16, dim: 8}}\n{layers}  - linear: {{out: 16}}\n"
            )
        };
        refused(
            "input: [4]\nlayers:\n  - embedding: {vocab: 16000000, dim: 1000}\n  - linear: {out: 2}\n",
            "layer 0 (embedding)'s parameter count",
        );
        refused(
            "input: [4]\nlayers:\n  - embedding: {vocab: 2, dim: 1000000000000}\n  - linear: {out: 2}\n",
            "max_layer_params",
        );
        refused(
            &seq("  - pos_embedding: {max_len: 1000000000000}\n", 4),
            "layer 1 (pos_embedding)'s parameter count",
        );
        refused(
            &seq("  - attention: {heads: 4}\n", 100_000),
            "layer 1 (attention)'s attention scores is 40000000000",
        );
        refused(
            &seq("  - transformer_block: {heads: 2, mlp: 1000000000}\n", 4),
            "max_layer_params",
        );
        refused(
            &seq("  - transformer_block: {heads: 2, mlp: 1000000}\n", 100),
            "layer 1 (transformer_block)'s MLP hidden layer",
        );
        refused(
            &seq("  - attention: {heads: 18446744073709551615}\n", 4),
            "heads do not divide d_model 8",
        );
    }

    #[test]
    fn custom_limits_apply() {
        let text = "input: [784]\nlayers:\n  - linear: {out: 10}\n";
        ModelSpec::from_yaml(text, "t").expect("within the defaults");
        let tight = super::SpecLimits {
            max_layer_params: 1000,
            ..Default::default()
        };
        let e = ModelSpec::from_yaml_with(text, "t", &tight)
            .expect_err("7850 parameters")
            .to_string();
        assert!(
            e.contains("7850") && e.contains("max_layer_params = 1000"),
            "{e}"
        );
    }
}
