//! Model specs, and the burn models built from them: a spec's layers ([`layer`]), named links
//! ([`graph`]), shapes ([`shape`]) and limits ([`limits`]); the model built from a spec
//! ([`build`], [`model`]), the activations between its layers ([`activation`]) and its
//! sequence layers ([`sequence`]).
//!
//! Here, the spec itself: an ordered list of layers read from YAML, with named links between
//! them (see [`crate::spec::graph`]), shapes inferred and checked at load time, before any
//! tensor exists.

pub(crate) mod activation;
mod build;
pub(crate) mod graph;
mod layer;
pub(crate) mod limits;
pub(crate) mod model;
pub(crate) mod sequence;
pub(crate) mod shape;

use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::Path;

use crate::error::{EngineError, Result};
use crate::spec::graph::Node;
pub use crate::spec::layer::LayerSpec;
use crate::spec::layer::layer_output;
use crate::spec::limits::{MAX_SPEC_BYTES, SpecLimits};
pub use crate::spec::shape::Shape;

/// A sequential model: its input shape and its layers, in order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// A short name for logs (`lenet5`).
    #[serde(default = "unnamed")]
    pub name: String,
    /// One sample's input shape: `[C, H, W]` or `[F]` (or `[T]` token ids, when the first
    /// layer is an `embedding`).
    pub input: Vec<usize>,
    /// The layers, applied in order, with their named links (see [`Node`]).
    pub layers: Vec<Node>,
}

fn unnamed() -> String {
    "model".to_string()
}

/// Specs shipped with Flotilla, by name.
pub const BUILTIN_SPECS: &[(&str, &str)] = &[
    ("lenet5", include_str!("../../../../models/lenet5.yaml")),
    ("mlp", include_str!("../../../../models/mlp.yaml")),
    (
        "resnet-mnist",
        include_str!("../../../../models/resnet-mnist.yaml"),
    ),
    ("resmlp", include_str!("../../../../models/resmlp.yaml")),
    (
        "resnet-bn",
        include_str!("../../../../models/resnet-bn.yaml"),
    ),
    ("gpt-char", include_str!("../../../../models/gpt-char.yaml")),
    (
        "gpt-char-tied",
        include_str!("../../../../models/gpt-char-tied.yaml"),
    ),
];

impl ModelSpec {
    /// Parses a spec from YAML text and checks it against the default [`SpecLimits`];
    /// `source_name` names it in errors.
    pub fn from_yaml(text: &str, source_name: &str) -> Result<Self> {
        Self::from_yaml_with(text, source_name, &SpecLimits::default())
    }

    /// Parses a spec from YAML text (at most `MAX_SPEC_BYTES`, 16 MiB) and checks its shapes
    /// against `limits`, before any tensor exists. (Later shape inference applies the
    /// default limits: pass limits tighter than those.)
    pub fn from_yaml_with(text: &str, source_name: &str, limits: &SpecLimits) -> Result<Self> {
        spec_size(source_name, text.len() as u64)?;
        let spec: ModelSpec = serde_norway::from_str(text).map_err(|e| EngineError::SpecParse {
            source_name: source_name.to_string(),
            message: e.to_string(),
        })?;
        let io = spec.infer_io_with(limits)?;
        logits_output(io.last().map(|(_, out)| *out))?;
        Ok(spec)
    }

    /// Reads and checks a spec file (at most `MAX_SPEC_BYTES`, 16 MiB, checked before
    /// reading).
    pub fn load(path: &Path) -> Result<Self> {
        let name = path.display().to_string();
        let meta = std::fs::metadata(path).map_err(|e| EngineError::io(path, e))?;
        spec_size(&name, meta.len())?;
        let text = std::fs::read_to_string(path).map_err(|e| EngineError::io(path, e))?;
        Self::from_yaml(&text, &name)
    }

    /// A spec shipped with Flotilla by its name (`BUILTIN_SPECS`: the repository's
    /// `models/*.yaml`), or `None`.
    pub fn builtin(name: &str) -> Option<Self> {
        BUILTIN_SPECS
            .iter()
            .find(|(n, _)| *n == name)
            .and_then(|(n, text)| Self::from_yaml(text, n).ok())
    }

    /// Resolves a model reference: a built-in name, else a path to a spec file.
    pub fn resolve(reference: &str) -> Result<Self> {
        if let Some(spec) = Self::builtin(reference) {
            return Ok(spec);
        }
        let path = Path::new(reference);
        if path.exists() {
            return Self::load(path);
        }
        let names: Vec<&str> = BUILTIN_SPECS.iter().map(|(n, _)| *n).collect();
        Err(EngineError::InvalidSpec(format!(
            "`{reference}` is neither a built-in model ({}) nor an existing spec file",
            names.join(", ")
        )))
    }

    /// The input shape as a [`Shape`].
    pub fn input_shape(&self) -> Result<Shape> {
        Shape::of_sample(&self.input).ok_or_else(|| {
            EngineError::InvalidSpec(format!(
                "input must be [C, H, W] or [F] with positive sizes, got {:?}",
                self.input
            ))
        })
    }

    /// The activation shape after every layer (`shapes[i]` is layer `i`'s output), checking
    /// that each layer accepts its input. Errors name the layer.
    pub fn infer_shapes(&self) -> Result<Vec<Shape>> {
        Ok(self.infer_io()?.into_iter().map(|(_, out)| out).collect())
    }

    /// Every layer's input (after its dependencies are merged in) and output shape, checking
    /// names (dangling, cyclic, kept twice), shapes and the default [`SpecLimits`]. Errors
    /// name the layer.
    pub fn infer_io(&self) -> Result<Vec<(Shape, Shape)>> {
        self.infer_io_with(&SpecLimits::default())
    }

    /// [`ModelSpec::infer_io`] under `limits`: the layer count, every activation's size and
    /// every layer's (and the model's) parameter count, each checked before it is used.
    pub fn infer_io_with(&self, limits: &SpecLimits) -> Result<Vec<(Shape, Shape)>> {
        if self.layers.is_empty() {
            return Err(EngineError::InvalidSpec("the model has no layers".into()));
        }
        limits.check_layers(self.layers.len())?;
        let producers = graph::producers(&self.layers)?;
        let mut named: HashMap<String, Shape> = HashMap::new();
        let mut shape = self.input_shape()?;
        limits.check_activation("the input's size", &shape)?;
        let mut io = Vec::with_capacity(self.layers.len());
        let mut params = 0u64;
        for (index, node) in self.layers.iter().enumerate() {
            let input = graph::merged_input(index, node, shape, &named, &producers)?;
            let kind = node.layer.kind();
            limits.check_activation(&format!("layer {index} ({kind})'s input size"), &input)?;
            params =
                params.saturating_add(limits.check_layer_params(index, &node.layer, &input)?);
            limits.check_model_params(params)?;
            shape = layer_output(index, &node.layer, input)?;
            check_tie(index, &node.layer, input, &self.layers[0].layer)?;
            limits.check_inner(index, &node.layer, &input)?;
            limits.check_activation(&format!("layer {index} ({kind})'s output size"), &shape)?;
            for name in &node.out_variables {
                named.insert(name.clone(), shape);
            }
            io.push((input, shape));
        }
        Ok(io)
    }

    /// Every layer's parameter count, from the layers' shapes (no model is built; a head
    /// tied to the embedding counts 0, its weight is the embedding's).
    pub fn layer_param_counts(&self) -> Result<Vec<u64>> {
        let io = self.infer_io()?;
        Ok((self.layers.iter().zip(&io))
            .map(|(node, (input, _))| limits::layer_params(&node.layer, input))
            .map(|n| u64::try_from(n).unwrap_or(u64::MAX))
            .collect())
    }

    /// The model's parameter count, from its layers' shapes (no model is built): what the
    /// launcher's memory estimate starts from.
    pub fn param_count(&self) -> Result<u64> {
        let counts = self.layer_param_counts()?;
        Ok(counts.iter().fold(0u64, |sum, &n| sum.saturating_add(n)))
    }

    /// The parameters of the model's largest layer (a transformer block's, say): the least a
    /// backward group holds, so what ZeRO-3 gathers at a time at least.
    pub fn largest_layer_params(&self) -> Result<u64> {
        Ok(self.layer_param_counts()?.into_iter().max().unwrap_or(0))
    }

    /// The model's output shape: flat class logits `[classes]` (a classifier) or a sequence
    /// `[T, classes]` (a sequence model: class logits at every position).
    pub fn output_shape(&self) -> Result<Shape> {
        logits_output(self.infer_shapes()?.last().copied())
    }

    /// The number of classes the model's logits are over (per position, for a sequence
    /// model).
    pub fn classes(&self) -> Result<usize> {
        Ok(match self.output_shape()? {
            Shape::Seq { d, .. } => d,
            other => other.numel(),
        })
    }

    /// How many labels one sample has: 1 for a classifier, `T` for a sequence model (one
    /// class per position, row-major in a batch's labels).
    pub fn labels_per_sample(&self) -> Result<usize> {
        Ok(match self.output_shape()? {
            Shape::Seq { t, .. } => t,
            _ => 1,
        })
    }

    /// The vocabulary size if the model takes token ids (its first layer is an `embedding`):
    /// every input value must then be an integer in `0..vocab`.
    pub fn token_vocab(&self) -> Option<usize> {
        match self.layers.first().map(|n| &n.layer) {
            Some(LayerSpec::Embedding { vocab, .. }) => Some(*vocab),
            _ => None,
        }
    }

    /// Whether a linear layer of the model is tied to its token embedding (`tie_embedding`):
    /// the two layers share the table, so no cut may part them (ZeRO-3's groups,
    /// recomputation's, a pipeline's stages).
    pub fn ties_embedding(&self) -> bool {
        self.layers.iter().any(|n| {
            matches!(
                n.layer,
                LayerSpec::Linear {
                    tie_embedding: true,
                    ..
                }
            )
        })
    }

    /// Values of the token embedding's table when a head is tied to it (0: none): what
    /// ZeRO-3 keeps gathered through a step for the head.
    pub fn tied_table_values(&self) -> u64 {
        match (self.ties_embedding(), self.layers.first().map(|n| &n.layer)) {
            (true, Some(&LayerSpec::Embedding { vocab, dim })) => (vocab as u64) * (dim as u64),
            _ => 0,
        }
    }

    /// The canonical YAML text of the spec (used for the cluster-wide config hash).
    pub fn to_yaml(&self) -> String {
        serde_norway::to_string(self).unwrap_or_else(|_| format!("{self:?}"))
    }
}

/// The last layer's output, which must be class logits: flat, or a sequence.
/// Refuses a linear layer (`index`, on `input`) tied to the token embedding unless the model's
/// first layer is one whose table it can use transposed: `out` its vocabulary, the input a
/// sequence of its width.
fn check_tie(index: usize, layer: &LayerSpec, input: Shape, first: &LayerSpec) -> Result<()> {
    let LayerSpec::Linear {
        out,
        tie_embedding: true,
        ..
    } = *layer
    else {
        return Ok(());
    };
    let err = |message: String| EngineError::LayerShape {
        index,
        kind: layer.kind().to_string(),
        message,
    };
    let LayerSpec::Embedding { vocab, dim } = *first else {
        return Err(err(
            "tie_embedding: the model's first layer is not an embedding".into(),
        ));
    };
    match input {
        Shape::Seq { d, .. } if d == dim && out == vocab => Ok(()),
        Shape::Seq { d, .. } if d != dim => Err(err(format!(
            "tie_embedding: its input has width {d} but the embedding's table is {vocab} x {dim}"
        ))),
        Shape::Seq { .. } => Err(err(format!(
            "tie_embedding: out is {out} but the embedding's vocab is {vocab}"
        ))),
        _ => Err(err(format!(
            "tie_embedding: needs a sequence input of width {dim}, gets {input}"
        ))),
    }
}

fn logits_output(last: Option<Shape>) -> Result<Shape> {
    match last {
        Some(shape @ (Shape::Flat(_) | Shape::Seq { .. })) => Ok(shape),
        Some(other) => Err(EngineError::InvalidSpec(format!(
            "the last layer must give flat class logits (or a sequence of them), got {other}; end with flatten + linear"
        ))),
        None => Err(EngineError::InvalidSpec("the model has no layers".into())),
    }
}

/// A spec's size in bytes against [`MAX_SPEC_BYTES`].
fn spec_size(source_name: &str, bytes: u64) -> Result<()> {
    if bytes > MAX_SPEC_BYTES {
        return Err(EngineError::LimitExceeded {
            what: format!("{source_name}'s size in bytes"),
            value: bytes as u128,
            limit: "MAX_SPEC_BYTES",
            max: MAX_SPEC_BYTES,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_parameter_count_of_every_shipped_spec_is_its_built_models() {
        use crate::{BurnEngine, ModelState, OptimizerSpec};
        for (name, _) in BUILTIN_SPECS {
            let spec = ModelSpec::builtin(name).expect("a builtin");
            let built = BurnEngine::new(&spec, &OptimizerSpec::default(), "flex", 0)
                .expect("built")
                .num_params();
            assert_eq!(spec.param_count().expect("counted"), built as u64, "{name}");
        }
    }

    #[test]
    fn builtins_parse_and_infer() {
        let lenet = ModelSpec::builtin("lenet5").expect("lenet5");
        let shapes = lenet.infer_shapes().expect("shapes");
        assert_eq!(shapes[0], Shape::Image { c: 6, h: 28, w: 28 });
        assert_eq!(shapes[5], Shape::Image { c: 16, h: 5, w: 5 });
        assert_eq!(shapes[6], Shape::Flat(400));
        assert_eq!(lenet.output_shape().expect("out"), Shape::Flat(10));
        assert_eq!(lenet.input_shape().expect("in").numel(), 28 * 28);
        let mlp = ModelSpec::builtin("mlp").expect("mlp");
        assert_eq!(mlp.output_shape().expect("out"), Shape::Flat(10));
    }

    #[test]
    fn sequence_and_batch_norm_builtins_parse_and_read_back() {
        let gpt = ModelSpec::builtin("gpt-char").expect("gpt-char");
        let shapes = gpt.infer_shapes().expect("shapes");
        assert_eq!(shapes[0], Shape::Seq { t: 64, d: 128 });
        assert_eq!(
            gpt.output_shape().expect("out"),
            Shape::Seq { t: 64, d: 256 }
        );
        assert_eq!(
            (
                gpt.classes().expect("classes"),
                gpt.labels_per_sample().expect("labels")
            ),
            (256, 64)
        );
        assert_eq!(gpt.token_vocab(), Some(256));
        let bn = ModelSpec::builtin("resnet-bn").expect("resnet-bn");
        assert_eq!(bn.labels_per_sample().expect("labels"), 1);
        assert_eq!(bn.token_vocab(), None);
        assert_eq!(bn.classes().expect("classes"), 10);
        // The canonical YAML (the config hash) reads back the same.
        for s in [gpt, bn] {
            let again = ModelSpec::from_yaml(&s.to_yaml(), "again").expect("round trip");
            assert_eq!(again, s);
        }
    }

    /// Fuzzing found: sizes near `usize::MAX` overflowed the shape arithmetic (a panic), and
    /// absurd but representable sizes passed, to be allocated when the model is built.
    #[test]
    fn absurd_sizes_are_refused_when_read() {
        let err = |text: &str| {
            ModelSpec::from_yaml(text, "t")
                .expect_err("refused")
                .to_string()
        };
        let e = err(
            "input: [1, 4, 4]\nlayers:\n  - conv2d: {out: 2, k: 1, padding: 9223372036854775807}\n  - flatten\n  - linear: {out: 10}\n",
        );
        assert!(
            e.contains("layer 0 (conv2d)") && e.contains("padding"),
            "{e}"
        );
        let e = err(
            "input: [4294967296, 4294967296, 4294967296]\nlayers:\n  - flatten\n  - linear: {out: 10}\n",
        );
        assert!(e.contains("max_activation_values"), "{e}");
        let e = err("input: [100000]\nlayers:\n  - linear: {out: 100000}\n");
        assert!(
            e.contains("layer 0 (linear)") && e.contains("max_layer_params"),
            "{e}"
        );
        let e = err(
            "input: [1, 10000, 10000]\nlayers:\n  - conv2d: {out: 64, k: 1}\n  - flatten\n  - linear: {out: 2}\n",
        );
        assert!(
            e.contains("layer 0 (conv2d)'s output size") && e.contains("max_activation_values"),
            "{e}"
        );
        ModelSpec::from_yaml("input: [10000]\nlayers:\n  - linear: {out: 10000}\n", "t")
            .expect("1e8 weights are fine");
    }

    #[test]
    fn linear_on_image_names_the_layer() {
        let text = "input: [1, 28, 28]\nlayers:\n  - conv2d: {out: 4, k: 3}\n  - relu\n  - linear: {out: 10}\n";
        let e = ModelSpec::from_yaml(text, "t")
            .expect_err("must fail")
            .to_string();
        assert!(e.contains("layer 2 (linear)"), "{e}");
        assert!(e.contains("add `- flatten`"), "{e}");
    }

    #[test]
    fn kernel_too_big_is_clear() {
        let text = "input: [1, 4, 4]\nlayers:\n  - conv2d: {out: 4, k: 5}\n  - flatten\n  - linear: {out: 2}\n";
        let e = ModelSpec::from_yaml(text, "t")
            .expect_err("must fail")
            .to_string();
        assert!(
            e.contains("layer 0 (conv2d)") && e.contains("larger"),
            "{e}"
        );
    }

    #[test]
    fn unknown_layer_and_unknown_key_are_errors() {
        let e = ModelSpec::from_yaml("input: [4]\nlayers:\n  - convolution: {out: 3}\n", "f.yaml")
            .expect_err("unknown kind")
            .to_string();
        assert!(e.contains("f.yaml") && e.contains("convolution"), "{e}");
        let e = ModelSpec::from_yaml(
            "input: [4]\nlayers:\n  - linear: {out: 3, kernel: 2}\n",
            "f",
        )
        .expect_err("unknown key")
        .to_string();
        assert!(e.contains("kernel"), "{e}");
        let e = ModelSpec::from_yaml("input: [4]\nlayer:\n  - relu\n", "f")
            .expect_err("unknown top key")
            .to_string();
        assert!(e.contains("layer"), "{e}");
    }

    #[test]
    fn output_must_be_flat_class_logits() {
        let e = ModelSpec::from_yaml("input: [1, 8, 8]\nlayers:\n  - relu\n", "t")
            .expect_err("not flat")
            .to_string();
        assert!(e.contains("flat class logits"), "{e}");
    }
}
