//! One layer of a model spec, with the shape rule of every layer.

use serde::{Deserialize, Serialize};

use crate::error::{EngineError, Result};
use crate::spec::shape::Shape;

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
        /// Whether its weight is the token embedding's (layer 0's `[vocab, dim]` table, used
        /// transposed: a language model's head tied to its input embedding, GPT-2's and
        /// nanoGPT's `lm_head.weight = wte.weight`): `out` is then the vocabulary and the input
        /// the embedding's width; the layer has no weight of its own, and the table's gradient
        /// is the sum of both uses (default false, and then not written: an untied spec's text,
        /// and so its config hash, is what it was before the key existed).
        #[serde(default, skip_serializing_if = "is_false")]
        tie_embedding: bool,
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
    /// Gaussian error linear unit (exact, with `erf`).
    Gelu,
    /// Sigmoid linear unit `x · sigmoid(x)`.
    Silu,
    /// Layer normalization over the last dimension (the features of a flat activation, of
    /// each position of a sequence), with a weight and a bias; epsilon 1e-5.
    LayerNorm,
    /// RMS normalization over the last dimension, with a weight; epsilon 1e-5.
    RmsNorm,
    /// Batch normalization per channel of an image (2-d) or per feature of a flat activation
    /// (1-d), with a weight and a bias; momentum 0.1, epsilon 1e-5. Its running statistics
    /// are buffers, not parameters (see [`crate::ModelState::buffer_layout`]).
    BatchNorm,
    /// Token embedding: the first layer of a model whose input `[T]` holds token ids (as
    /// `f32` integers); gives a sequence `[T, dim]`.
    Embedding {
        /// Number of distinct tokens (ids `0..vocab`).
        vocab: usize,
        /// Features per token.
        dim: usize,
    },
    /// A learned positional embedding: a `[max_len, d]` table whose first `T` rows are added
    /// to a sequence `[T, d]`.
    PosEmbedding {
        /// Rows of the table: the longest context the model takes.
        max_len: usize,
    },
    /// Causal multi-head self-attention on a sequence (query, key, value and output
    /// projections, each with a bias): position `i` attends to positions `0..=i`.
    Attention {
        /// Number of heads; must divide the features `d`.
        heads: usize,
    },
    /// A pre-LN transformer block on a sequence: `x + attention(ln(x))`, then
    /// `x + mlp(ln(x))` with a GELU MLP of `mlp · d` hidden features; no dropout.
    TransformerBlock {
        /// Number of attention heads; must divide the features `d`.
        heads: usize,
        /// The MLP's hidden width as a multiple of `d` (default 4).
        #[serde(default = "four")]
        mlp: usize,
    },
}

fn one() -> usize {
    1
}
fn yes() -> bool {
    true
}
fn is_false(b: &bool) -> bool {
    !*b
}
fn four() -> usize {
    4
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
            LayerSpec::Gelu => "gelu",
            LayerSpec::Silu => "silu",
            LayerSpec::LayerNorm => "layer_norm",
            LayerSpec::RmsNorm => "rms_norm",
            LayerSpec::BatchNorm => "batch_norm",
            LayerSpec::Embedding { .. } => "embedding",
            LayerSpec::PosEmbedding { .. } => "pos_embedding",
            LayerSpec::Attention { .. } => "attention",
            LayerSpec::TransformerBlock { .. } => "transformer_block",
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
    match *layer {
        LayerSpec::Conv2d { .. } | LayerSpec::Maxpool { .. } | LayerSpec::Avgpool { .. } => {
            image_output(layer, input).map_err(err)
        }
        LayerSpec::Embedding { .. }
        | LayerSpec::PosEmbedding { .. }
        | LayerSpec::Attention { .. }
        | LayerSpec::TransformerBlock { .. } => sequence_output(index, layer, input).map_err(err),
        LayerSpec::Linear { out, .. } => match input {
            _ if out == 0 => Err(err("out must be positive".into())),
            Shape::Flat(_) => Ok(Shape::Flat(out)),
            Shape::Seq { t, .. } => Ok(Shape::Seq { t, d: out }),
            Shape::Image { .. } => Err(err(format!(
                "needs a flat or sequence input but gets {input}; add `- flatten` before it"
            ))),
        },
        LayerSpec::Flatten => Ok(Shape::Flat(input.numel())),
        LayerSpec::Dropout { p } => {
            if !(0.0..1.0).contains(&p) {
                return Err(err(format!("p must be in [0, 1), got {p}")));
            }
            Ok(input)
        }
        LayerSpec::LayerNorm | LayerSpec::RmsNorm => match input {
            Shape::Image { .. } => Err(err(format!(
                "normalizes the last dimension of a flat or sequence input but gets image {input}"
            ))),
            _ => Ok(input),
        },
        LayerSpec::BatchNorm => match input {
            Shape::Seq { .. } => Err(err(format!(
                "takes an image (per channel) or a flat input (per feature) but gets sequence {input}; use layer_norm"
            ))),
            _ => Ok(input),
        },
        LayerSpec::Relu
        | LayerSpec::Tanh
        | LayerSpec::Sigmoid
        | LayerSpec::Identity
        | LayerSpec::Gelu
        | LayerSpec::Silu => Ok(input),
    }
}

/// The output of a convolution or pooling layer on `input`.
fn image_output(layer: &LayerSpec, input: Shape) -> std::result::Result<Shape, String> {
    let Shape::Image { c, h, w } = input else {
        return Err(format!(
            "needs an image input [C, H, W] but gets {} {input}",
            input.kind()
        ));
    };
    match *layer {
        LayerSpec::Conv2d {
            out,
            k,
            stride,
            padding,
            ..
        } => {
            if out == 0 || k == 0 || stride == 0 {
                return Err("out, k and stride must be positive".into());
            }
            let pad = |x: usize| padding.checked_mul(2).and_then(|p| p.checked_add(x));
            let (Some(ph), Some(pw)) = (pad(h), pad(w)) else {
                return Err(format!("padding {padding} is too large"));
            };
            if ph < k || pw < k {
                return Err(format!(
                    "kernel {k}x{k} is larger than the padded input {ph}x{pw} (input {input})"
                ));
            }
            Ok(Shape::Image {
                c: out,
                h: (ph - k) / stride + 1,
                w: (pw - k) / stride + 1,
            })
        }
        LayerSpec::Maxpool { k, stride } | LayerSpec::Avgpool { k, stride } => {
            let stride = stride.unwrap_or(k);
            if k == 0 || stride == 0 {
                return Err("k and stride must be positive".into());
            }
            if h < k || w < k {
                return Err(format!("window {k}x{k} is larger than the input {input}"));
            }
            Ok(Shape::Image {
                c,
                h: (h - k) / stride + 1,
                w: (w - k) / stride + 1,
            })
        }
        _ => Ok(input),
    }
}

/// The most distinct token ids a model takes: ids travel as `f32` values, exact up to 2^24.
pub const MAX_VOCAB: usize = 1 << 24;

/// The output of an embedding (layer `index`) or of a layer on sequences, on `input`.
fn sequence_output(
    index: usize,
    layer: &LayerSpec,
    input: Shape,
) -> std::result::Result<Shape, String> {
    if let LayerSpec::Embedding { vocab, dim } = *layer {
        return match input {
            _ if index != 0 => Err(format!(
                "must be the first layer: it takes the model's input of token ids, but gets the output of layer {} ({input})",
                index - 1
            )),
            Shape::Flat(t) if vocab > 0 && dim > 0 && vocab <= MAX_VOCAB => {
                Ok(Shape::Seq { t, d: dim })
            }
            Shape::Flat(_) if vocab > MAX_VOCAB => Err(format!(
                "vocab {vocab} is more than {MAX_VOCAB} (2^24), the most token ids f32 values carry exactly"
            )),
            Shape::Flat(_) => Err("vocab and dim must be positive".into()),
            _ => Err(format!(
                "takes token ids, an input [T], but the model's input is {} {input}",
                input.kind()
            )),
        };
    }
    let Shape::Seq { t, d } = input else {
        return Err(format!(
            "needs a sequence input [T, D] (after an embedding) but gets {} {input}",
            input.kind()
        ));
    };
    let heads_divide = |heads: usize| match heads {
        0 => Err("heads must be positive".to_string()),
        h if !d.is_multiple_of(h) => Err(format!(
            "{h} heads do not divide d_model {d} ({d} % {h} = {})",
            d % h
        )),
        _ => Ok(input),
    };
    match *layer {
        LayerSpec::PosEmbedding { max_len } if t > max_len => Err(format!(
            "context {t} is larger than the positional table (max_len {max_len})"
        )),
        LayerSpec::Attention { heads } => heads_divide(heads),
        LayerSpec::TransformerBlock { mlp: 0, .. } => Err("mlp must be positive".into()),
        LayerSpec::TransformerBlock { heads, .. } => heads_divide(heads),
        _ => Ok(input),
    }
}
