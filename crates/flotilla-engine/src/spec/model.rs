//! The burn model built from a [`crate::ModelSpec`] (by [`crate::spec::build`]): a `Vec` of layer
//! modules applied in order.

use burn::module::{Module, Param};
use burn::nn::activation::SiLU;
use burn::nn::attention::MultiHeadAttention;
use burn::nn::conv::Conv2d;
use burn::nn::pool::{AvgPool2d, MaxPool2d};
use burn::nn::transformer::TransformerEncoderLayer;
use burn::nn::{
    BatchNorm, Dropout, Embedding, Gelu, LayerNorm, Linear, Relu, RmsNorm, Sigmoid, Tanh,
};

use std::collections::HashMap;
use std::ops::Range;

use burn::prelude::*;

use crate::collective::ReducerHandle;
use crate::spec::activation::{Activation, map_tensor};
use crate::spec::graph::Merge;
use crate::spec::sequence;
use crate::{kernels, sync_batch_norm};

/// One layer of a [`SequentialModel`]. Its variant names do not appear in checkpoints:
/// tensors are saved as `layers.<index>.<name>`, as a PyTorch `nn.Sequential` (or
/// `nn.ModuleList`) named `layers` would name them (`weight`, `bias`; a batch norm's
/// `running_mean` and `running_var`; the sub-modules of attention and of a block: see
/// [`crate::spec::sequence`]).
// A model holds one `Layer` per layer of its spec, so the size of the largest variant costs
// nothing worth boxing (and burn's `Module` derive does not take a `Box`).
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum Layer {
    /// 2-D convolution.
    Conv2d(Conv2d),
    /// Max pooling.
    MaxPool(MaxPool2d),
    /// Average pooling.
    AvgPool(AvgPool2d),
    /// Fully connected (on the last dimension).
    Linear(Linear),
    /// Fully connected with the token embedding's table as its weight (`tie_embedding`).
    TiedLinear(TiedLinear),
    /// ReLU.
    Relu(Relu),
    /// Tanh.
    Tanh(Tanh),
    /// Sigmoid.
    Sigmoid(Sigmoid),
    /// GELU (exact).
    Gelu(Gelu),
    /// SiLU.
    Silu(SiLU),
    /// Flatten `[N, ...]` to `[N, features]` (no parameters).
    Flatten(Flatten),
    /// Dropout.
    Dropout(Dropout),
    /// Identity (a merge point without a computation).
    Identity(Identity),
    /// Layer normalization over the last dimension.
    LayerNorm(LayerNorm),
    /// RMS normalization over the last dimension.
    RmsNorm(RmsNorm),
    /// Batch normalization (per channel or feature, running statistics as buffers).
    BatchNorm(BatchNorm),
    /// Token embedding (the first layer; token ids in, a sequence out).
    Embedding(Embedding),
    /// Learned positional embedding: the table is an [`Embedding`]'s weight `[max_len, d]`.
    PosEmbedding(Embedding),
    /// Causal multi-head self-attention.
    Attention(MultiHeadAttention),
    /// Pre-LN transformer block.
    Block(TransformerEncoderLayer),
}

/// A linear layer whose weight is the token embedding's table (layer 0's `[vocab, dim]`,
/// used transposed): only its bias is its own. Autodiff sums the table's gradient over its
/// two uses.
#[derive(Module, Debug)]
pub struct TiedLinear {
    /// The bias `[vocab]`, if any.
    pub bias: Option<Param<Tensor<1>>>,
}

/// Passes its input on; it has no parameters.
#[derive(Module, Debug, Default)]
pub struct Identity;

/// A layer's named links, from the spec (not parameters; never saved).
#[derive(Debug, Clone, Default)]
pub struct Links {
    /// Names under which the layer's output is kept.
    pub keep: Vec<String>,
    /// Names merged into the layer's input.
    pub take: Vec<String>,
    /// How they are merged.
    pub merge: Merge,
}

/// Flattens every dimension after the batch dimension; it has no parameters.
#[derive(Module, Debug, Default)]
pub struct Flatten;

/// A model: the layers of a spec, applied in order to a batch, with the named outputs that
/// later layers take as extra inputs (residual and concatenating links).
#[derive(Module, Debug)]
pub struct SequentialModel {
    /// The layers, in spec order.
    pub layers: Vec<Layer>,
    /// Each layer's links, in spec order.
    #[module(skip)]
    pub links: Vec<Links>,
    /// When set, every batch norm trains with the statistics of every rank's batch
    /// ([`crate::sync_batch_norm`]); never saved.
    #[module(skip)]
    pub batch_norm_sync: Option<ReducerHandle>,
    /// When set (a training step's dropout seed), each dropout layer draws its mask from the
    /// RNG re-seeded for that seed and its index: the masks depend on neither the layers
    /// run before it in the same pass nor how the pass is cut, so a recomputed forward
    /// (recomputation, ZeRO-3) draws the first one's. The caller holds the RNG's lock.
    #[module(skip)]
    pub dropout_seed: Option<u64>,
}

// `SequentialModel::new` (building the model of a spec) is in `crate::spec::build`.
impl SequentialModel {
    /// The logits of the whole model for `input`, as `[rows, classes]` (a row per sample, or
    /// per position of a sequence model).
    pub(crate) fn logits(&self, input: Activation) -> Tensor<2> {
        let mut kept = HashMap::new();
        self.run_range(0..self.layers.len(), input, &mut kept)
            .into_logits()
    }

    /// Applies the layers in `range` to `x`. `kept` holds the named outputs that these layers
    /// may take (received from earlier stages, or kept by earlier layers); the named outputs
    /// of these layers are added to it.
    pub(crate) fn run_range(
        &self,
        range: Range<usize>,
        input: Activation,
        kept: &mut HashMap<String, Activation>,
    ) -> Activation {
        let mut x = input;
        let none = Links::default();
        let mut i = range.start;
        while i < range.end {
            let Some(layer) = self.layers.get(i) else {
                break;
            };
            let links = self.links.get(i).unwrap_or(&none);
            for name in &links.take {
                if let Some(other) = kept.get(name) {
                    x = x.merge(other.clone(), links.merge);
                }
            }
            // A linear layer or a convolution and the ReLU right after it run as one kernel,
            // unless something keeps the layer's own output or merges into the ReLU's input.
            if let Layer::TiedLinear(head) = layer {
                x = self.tied_linear(head, x);
                for name in &links.keep {
                    kept.insert(name.clone(), x.clone());
                }
                i += 1;
                continue;
            }
            let fused = matches!(layer, Layer::Linear(_) | Layer::Conv2d(_))
                && matches!(self.layers.get(i + 1), Some(Layer::Relu(_)))
                && i + 1 < range.end
                && links.keep.is_empty()
                && self.takes_none(i + 1);
            let links = if fused {
                x = apply_relu_fused(layer, x);
                i += 1;
                self.links.get(i).unwrap_or(&none)
            } else {
                self.seed_dropout(i, layer, &x);
                x = apply(layer, x, self.batch_norm_sync.as_ref());
                links
            };
            for name in &links.keep {
                kept.insert(name.clone(), x.clone());
            }
            i += 1;
        }
        x
    }

    /// Re-seeds the RNG for layer `i`'s dropout mask when it is a dropout layer that draws one
    /// (in training: on an autodiff device) and a dropout seed is set
    /// ([`SequentialModel::dropout_seed`]).
    fn seed_dropout(&self, i: usize, layer: &Layer, x: &Activation) {
        if let (Layer::Dropout(d), Some(seed)) = (layer, self.dropout_seed)
            && d.prob > 0.0
        {
            let device = x.device();
            if device.is_autodiff() {
                device.seed(crate::rng::mask_seed(seed, i));
            }
        }
    }

    /// `head` on `x` (`[n, t, dim]`, as the spec's shapes ensure): `x · tableᵀ + bias`, the
    /// table the model's token embedding's (layer 0). A model whose first layer holds no
    /// table (a pipeline stage after the first: refused when built) passes `x` on.
    fn tied_linear(&self, head: &TiedLinear, x: Activation) -> Activation {
        let (Some(Layer::Embedding(embedding)), Activation::Seq(t)) = (self.layers.first(), &x)
        else {
            return x;
        };
        let [n, len, dim] = t.dims();
        let table = embedding.weight.val();
        let vocab = table.dims()[0];
        let rows = t.clone().reshape([n * len, dim]);
        let mut y = rows.matmul(table.transpose());
        if let Some(b) = &head.bias {
            y = y + b.val().unsqueeze::<2>();
        }
        Activation::Seq(y.reshape([n, len, vocab]))
    }

    /// Whether the model has a linear layer tied to its token embedding.
    pub(crate) fn ties_embedding(&self) -> bool {
        self.layers
            .iter()
            .any(|l| matches!(l, Layer::TiedLinear(_)))
    }

    /// Whether layer `i` merges nothing into its input.
    fn takes_none(&self, i: usize) -> bool {
        self.links.get(i).is_none_or(|l| l.take.is_empty())
    }
}

/// A linear layer (through ReLU when `relu`) on any activation, an image flattened first.
fn linear(m: &Linear, x: Activation, relu: bool) -> Activation {
    match x {
        // Shape inference at load time rules out a linear layer on an image.
        Activation::Image(t) => Activation::Flat(kernels::linear::linear(m, t.flatten(1, 3), relu)),
        x => map_tensor!(x, |t| kernels::linear::linear(m, t, relu)),
    }
}

/// A linear layer or a convolution followed by its ReLU, as one kernel.
fn apply_relu_fused(layer: &Layer, x: Activation) -> Activation {
    match (layer, x) {
        (Layer::Linear(m), x) => linear(m, x, true),
        (Layer::Conv2d(m), Activation::Image(t)) => {
            Activation::Image(crate::conv::conv2d_relu(m, t))
        }
        // Shape inference rules out a convolution on anything but an image; `fused` picks
        // no other layer.
        (_, x) => x,
    }
}

/// One layer on one activation (a batch norm synchronized over `sync`'s ranks when given).
fn apply(layer: &Layer, x: Activation, sync: Option<&ReducerHandle>) -> Activation {
    match (layer, x) {
        (Layer::Conv2d(m), Activation::Image(t)) => Activation::Image(crate::conv::conv2d(m, t)),
        (Layer::MaxPool(m), Activation::Image(t)) => {
            Activation::Image(kernels::max_pool::max_pool2d(m, t))
        }
        (Layer::AvgPool(m), Activation::Image(t)) => Activation::Image(m.forward(t)),
        (Layer::Linear(m), x) => linear(m, x, false),
        (Layer::Flatten(_), Activation::Image(t)) => Activation::Flat(t.flatten(1, 3)),
        (Layer::Flatten(_), Activation::Seq(t)) => Activation::Flat(t.flatten(1, 2)),
        (Layer::Relu(m), x) => map_tensor!(x, |t| m.forward(t)),
        (Layer::Tanh(m), x) => map_tensor!(x, |t| m.forward(t)),
        (Layer::Sigmoid(m), x) => map_tensor!(x, |t| m.forward(t)),
        (Layer::Gelu(_), x) => map_tensor!(x, |t| crate::kernels::gelu::gelu(t)),
        (Layer::Silu(m), x) => map_tensor!(x, |t| m.forward(t)),
        (Layer::Dropout(m), x) => map_tensor!(x, |t| m.forward(t)),
        (Layer::LayerNorm(m), x) => map_tensor!(x, |t| kernels::layer_norm::layer_norm(m, t)),
        (Layer::RmsNorm(m), x) => map_tensor!(x, |t| m.forward(t)),
        (Layer::BatchNorm(m), x) => match sync {
            Some(r) => map_tensor!(x, |t| sync_batch_norm::forward(m, t, r)),
            None => map_tensor!(x, |t| m.forward(t)),
        },
        (Layer::Embedding(m), Activation::Flat(ids)) => {
            Activation::Seq(sequence::embed_tokens(m, ids))
        }
        (Layer::PosEmbedding(m), Activation::Seq(t)) => {
            Activation::Seq(sequence::add_positions(m, t))
        }
        (Layer::Attention(m), Activation::Seq(t)) => {
            Activation::Seq(sequence::causal_attention(m, t))
        }
        (Layer::Block(m), Activation::Seq(t)) => Activation::Seq(sequence::block(m, t)),
        // Shape inference rules out every other pair (an image layer never follows a flatten,
        // a sequence layer always follows an embedding); a flatten of a flat input and an
        // identity pass their input on.
        (_, x) => x,
    }
}
