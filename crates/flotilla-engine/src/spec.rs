//! Model specs: an ordered list of layers read from YAML, with shapes inferred and checked at
//! load time, before any tensor exists.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::path::Path;

use crate::error::{EngineError, Result};

/// One layer of a sequential model, as written in a spec file.
///
/// Parameterised layers are one-key maps (`- conv2d: {out: 6, k: 5}`); the others are plain
/// words (`- relu`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum LayerSpec {
    /// 2-D convolution with a square kernel.
    Conv2d {
        /// Output channels.
        out: usize,
        /// Kernel size (square).
        k: usize,
        /// Stride (default 1).
        #[serde(default = "one")]
        stride: usize,
        /// Zero padding on each side (default 0).
        #[serde(default)]
        padding: usize,
        /// Whether the layer has a bias (default true).
        #[serde(default = "yes")]
        bias: bool,
    },
    /// 2-D max pooling with a square window.
    Maxpool {
        /// Window size.
        k: usize,
        /// Stride (default: the window size).
        #[serde(default)]
        stride: Option<usize>,
    },
    /// 2-D average pooling with a square window.
    Avgpool {
        /// Window size.
        k: usize,
        /// Stride (default: the window size).
        #[serde(default)]
        stride: Option<usize>,
    },
    /// Fully connected layer on a flat input.
    Linear {
        /// Output features.
        out: usize,
        /// Whether the layer has a bias (default true).
        #[serde(default = "yes")]
        bias: bool,
    },
    /// Rectified linear unit.
    Relu,
    /// Hyperbolic tangent.
    Tanh,
    /// Logistic sigmoid.
    Sigmoid,
    /// Flattens `[C, H, W]` into `[C*H*W]`.
    Flatten,
    /// Dropout with drop probability `p` (active in training only; each rank draws its own mask).
    Dropout {
        /// Drop probability in `[0, 1)`.
        p: f64,
    },
}

fn one() -> usize {
    1
}
fn yes() -> bool {
    true
}

impl LayerSpec {
    /// The layer's kind as written in a spec (`conv2d`, `relu`, ...).
    pub fn kind(&self) -> &'static str {
        match self {
            LayerSpec::Conv2d { .. } => "conv2d",
            LayerSpec::Maxpool { .. } => "maxpool",
            LayerSpec::Avgpool { .. } => "avgpool",
            LayerSpec::Linear { .. } => "linear",
            LayerSpec::Relu => "relu",
            LayerSpec::Tanh => "tanh",
            LayerSpec::Sigmoid => "sigmoid",
            LayerSpec::Flatten => "flatten",
            LayerSpec::Dropout { .. } => "dropout",
        }
    }
}

/// The shape of one sample's activation between layers (the batch dimension is implicit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// An image-like activation `[channels, height, width]`.
    Image {
        /// Channels.
        c: usize,
        /// Height.
        h: usize,
        /// Width.
        w: usize,
    },
    /// A flat feature vector.
    Flat(usize),
}

impl Shape {
    /// Number of values per sample.
    pub fn numel(&self) -> usize {
        match *self {
            Shape::Image { c, h, w } => c * h * w,
            Shape::Flat(f) => f,
        }
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Shape::Image { c, h, w } => write!(f, "[{c}, {h}, {w}]"),
            Shape::Flat(n) => write!(f, "[{n}]"),
        }
    }
}

/// A sequential model: its input shape and its layers, in order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// A short name for logs (`lenet5`).
    #[serde(default = "unnamed")]
    pub name: String,
    /// One sample's input shape: `[C, H, W]` or `[F]`.
    pub input: Vec<usize>,
    /// The layers, applied in order.
    #[serde(with = "serde_norway::with::singleton_map_recursive")]
    pub layers: Vec<LayerSpec>,
}

fn unnamed() -> String {
    "model".to_string()
}

/// Specs shipped with Flotilla, by name.
pub const BUILTIN_SPECS: &[(&str, &str)] = &[
    ("lenet5", include_str!("../../../models/lenet5.yaml")),
    ("mlp", include_str!("../../../models/mlp.yaml")),
];

impl ModelSpec {
    /// Parses a spec from YAML text; `source_name` names it in errors.
    pub fn from_yaml(text: &str, source_name: &str) -> Result<Self> {
        let spec: ModelSpec = serde_norway::from_str(text).map_err(|e| EngineError::SpecParse {
            source_name: source_name.to_string(),
            message: e.to_string(),
        })?;
        spec.output_shape()?;
        Ok(spec)
    }

    /// Reads and checks a spec file.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| EngineError::io(path, e))?;
        Self::from_yaml(&text, &path.display().to_string())
    }

    /// A spec shipped with Flotilla (`lenet5`, `mlp`).
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
        match self.input.as_slice() {
            [c, h, w] if *c > 0 && *h > 0 && *w > 0 => Ok(Shape::Image {
                c: *c,
                h: *h,
                w: *w,
            }),
            [f] if *f > 0 => Ok(Shape::Flat(*f)),
            other => Err(EngineError::InvalidSpec(format!(
                "input must be [C, H, W] or [F] with positive sizes, got {other:?}"
            ))),
        }
    }

    /// The activation shape after every layer (`shapes[i]` is layer `i`'s output), checking
    /// that each layer accepts its input. Errors name the layer.
    pub fn infer_shapes(&self) -> Result<Vec<Shape>> {
        if self.layers.is_empty() {
            return Err(EngineError::InvalidSpec("the model has no layers".into()));
        }
        let mut shape = self.input_shape()?;
        let mut shapes = Vec::with_capacity(self.layers.len());
        for (index, layer) in self.layers.iter().enumerate() {
            shape = layer_output(index, layer, shape)?;
            shapes.push(shape);
        }
        Ok(shapes)
    }

    /// The model's output shape, which must be flat (class logits).
    pub fn output_shape(&self) -> Result<Shape> {
        let shapes = self.infer_shapes()?;
        match shapes.last() {
            Some(Shape::Flat(n)) => Ok(Shape::Flat(*n)),
            Some(other) => Err(EngineError::InvalidSpec(format!(
                "the last layer must give flat class logits, got {other}; end with flatten + linear"
            ))),
            None => Err(EngineError::InvalidSpec("the model has no layers".into())),
        }
    }

    /// Checks that the model takes `input` samples and gives `classes` logits.
    pub fn check_io(&self, input: &[usize], classes: usize) -> Result<()> {
        let own = self.input_shape()?;
        if own.numel() != input.iter().product::<usize>() {
            return Err(EngineError::InvalidSpec(format!(
                "the model takes input {own} but the data set gives samples of {input:?}"
            )));
        }
        let out = self.output_shape()?;
        if out.numel() != classes {
            return Err(EngineError::InvalidSpec(format!(
                "the model gives {} outputs but the data set has {classes} classes",
                out.numel()
            )));
        }
        Ok(())
    }

    /// The canonical YAML text of the spec (used for the cluster-wide config hash).
    pub fn to_yaml(&self) -> String {
        serde_norway::to_string(self).unwrap_or_else(|_| format!("{self:?}"))
    }
}

fn layer_output(index: usize, layer: &LayerSpec, input: Shape) -> Result<Shape> {
    let err = |message: String| EngineError::LayerShape {
        index,
        kind: layer.kind().to_string(),
        message,
    };
    let image = |input: Shape| match input {
        Shape::Image { c, h, w } => Ok((c, h, w)),
        Shape::Flat(_) => Err(err(format!(
            "needs an image input [C, H, W] but gets flat {input}"
        ))),
    };
    match *layer {
        LayerSpec::Conv2d {
            out,
            k,
            stride,
            padding,
            ..
        } => {
            let (_, h, w) = image(input)?;
            if out == 0 || k == 0 || stride == 0 {
                return Err(err("out, k and stride must be positive".into()));
            }
            let (ph, pw) = (h + 2 * padding, w + 2 * padding);
            if ph < k || pw < k {
                return Err(err(format!(
                    "kernel {k}x{k} is larger than the padded input {ph}x{pw} (input {input})"
                )));
            }
            Ok(Shape::Image {
                c: out,
                h: (ph - k) / stride + 1,
                w: (pw - k) / stride + 1,
            })
        }
        LayerSpec::Maxpool { k, stride } | LayerSpec::Avgpool { k, stride } => {
            let (c, h, w) = image(input)?;
            let stride = stride.unwrap_or(k);
            if k == 0 || stride == 0 {
                return Err(err("k and stride must be positive".into()));
            }
            if h < k || w < k {
                return Err(err(format!(
                    "window {k}x{k} is larger than the input {input}"
                )));
            }
            Ok(Shape::Image {
                c,
                h: (h - k) / stride + 1,
                w: (w - k) / stride + 1,
            })
        }
        LayerSpec::Linear { out, .. } => match input {
            Shape::Flat(_) if out > 0 => Ok(Shape::Flat(out)),
            Shape::Flat(_) => Err(err("out must be positive".into())),
            Shape::Image { .. } => Err(err(format!(
                "needs a flat input but gets {input}; add `- flatten` before it"
            ))),
        },
        LayerSpec::Flatten => Ok(Shape::Flat(input.numel())),
        LayerSpec::Dropout { p } => {
            if !(0.0..1.0).contains(&p) {
                return Err(err(format!("p must be in [0, 1), got {p}")));
            }
            Ok(input)
        }
        LayerSpec::Relu | LayerSpec::Tanh | LayerSpec::Sigmoid => Ok(input),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtins_parse_and_infer() {
        let lenet = ModelSpec::builtin("lenet5").expect("lenet5");
        let shapes = lenet.infer_shapes().expect("shapes");
        assert_eq!(shapes[0], Shape::Image { c: 6, h: 28, w: 28 });
        assert_eq!(shapes[5], Shape::Image { c: 16, h: 5, w: 5 });
        assert_eq!(shapes[6], Shape::Flat(400));
        assert_eq!(lenet.output_shape().expect("out"), Shape::Flat(10));
        lenet.check_io(&[1, 28, 28], 10).expect("io");
        let mlp = ModelSpec::builtin("mlp").expect("mlp");
        assert_eq!(mlp.output_shape().expect("out"), Shape::Flat(10));
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
    fn output_must_be_flat_and_match_classes() {
        let e = ModelSpec::from_yaml("input: [1, 8, 8]\nlayers:\n  - relu\n", "t")
            .expect_err("not flat")
            .to_string();
        assert!(e.contains("flat class logits"), "{e}");
        let spec = ModelSpec::builtin("mlp").expect("mlp");
        let e = spec
            .check_io(&[1, 28, 28], 7)
            .expect_err("classes")
            .to_string();
        assert!(e.contains("10 outputs") && e.contains("7 classes"), "{e}");
    }
}
