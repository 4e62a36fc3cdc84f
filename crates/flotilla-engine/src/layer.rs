//! One layer of a model spec and the shape of one sample's activation between layers, with
//! the shape rule of every layer.

use serde::{Deserialize, Serialize};
use std::fmt;

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
    /// Passes its input on: a place to merge dependencies (`- identity:` with
    /// `dependencies: [...]`).
    Identity,
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
            LayerSpec::Identity => "identity",
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
    /// Number of values per sample (saturating at `usize::MAX`; a checked spec's shapes are
    /// within [`crate::SpecLimits::max_activation_values`]).
    pub fn numel(&self) -> usize {
        match *self {
            Shape::Image { c, h, w } => c.saturating_mul(h).saturating_mul(w),
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

/// The output shape of layer `index` on `input`, or why the layer cannot take it.
pub fn layer_output(index: usize, layer: &LayerSpec, input: Shape) -> Result<Shape> {
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
            let pad = |x: usize| padding.checked_mul(2).and_then(|p| p.checked_add(x));
            let (Some(ph), Some(pw)) = (pad(h), pad(w)) else {
                return Err(err(format!("padding {padding} is too large")));
            };
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
        LayerSpec::Relu | LayerSpec::Tanh | LayerSpec::Sigmoid | LayerSpec::Identity => Ok(input),
    }
}
