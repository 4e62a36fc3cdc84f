//! Building the burn model of a spec: each layer's module from its spec and input shape
//! (checked by shape inference), and the links between layers.

use burn::nn::activation::SiLU;
use burn::nn::attention::MultiHeadAttentionConfig;
use burn::nn::conv::Conv2dConfig;
use burn::nn::pool::{AvgPool2dConfig, MaxPool2dConfig};
use burn::nn::transformer::{TransformerEncoderConfig, TransformerEncoderLayer};
use burn::nn::{
    BatchNormConfig, DropoutConfig, EmbeddingConfig, Gelu, Initializer, LayerNormConfig,
    LinearConfig, PaddingConfig2d, Relu, RmsNormConfig, Sigmoid, Tanh,
};
use burn::prelude::*;

use crate::error::{EngineError, Result};
use crate::kernels::layer_norm;
use crate::spec::model::{Flatten, Identity, Layer, Links, SequentialModel, TiedLinear};
use crate::spec::{LayerSpec, ModelSpec, Shape};

impl SequentialModel {
    /// Builds the model on `device`; parameters are initialised from the device's RNG (seed it
    /// first for determinism). The spec must have passed shape inference.
    pub fn new(spec: &ModelSpec, device: &Device) -> Result<Self> {
        let io = spec.infer_io()?;
        let mut layers = Vec::with_capacity(spec.layers.len());
        let mut links = Vec::with_capacity(spec.layers.len());
        let tied = spec.ties_embedding();
        for (node, (input, _)) in spec.layers.iter().zip(io) {
            let small = Initializer::Normal {
                mean: 0.0,
                std: TIED_TABLE_STD,
            };
            let layer = match (&node.layer, tied, input) {
                (&LayerSpec::Embedding { vocab, dim }, true, _) => Layer::Embedding(
                    EmbeddingConfig::new(vocab, dim)
                        .with_initializer(small)
                        .init(device),
                ),
                (&LayerSpec::PosEmbedding { max_len }, true, Shape::Seq { d, .. }) => {
                    Layer::PosEmbedding(
                        EmbeddingConfig::new(max_len, d)
                            .with_initializer(small)
                            .init(device),
                    )
                }
                (layer, _, _) => build_layer(layer, input, device)?,
            };
            layers.push(layer);
            links.push(Links {
                keep: node.out_variables.clone(),
                take: node.dependencies.clone(),
                merge: node.merge,
            });
        }
        Ok(Self {
            layers,
            links,
            batch_norm_sync: None,
            dropout_seed: None,
        })
    }
}

/// The standard deviation the token and positional embeddings' tables are drawn with when a
/// head is tied to the token table (GPT-2's, nanoGPT's): burn's and PyTorch's N(0, 1) would
/// give the head logits of standard deviation √dim on a layer-normed input (gpt-char tied:
/// 20.8 nats after 30 steps, against ln 256 = 5.5 for uniform guesses), and a token table
/// alone at 0.02 drowns in the positional one (3.02 after 300 steps; both at 0.02: 2.10,
/// untied 2.09).
pub const TIED_TABLE_STD: f64 = 0.02;

/// The burn module of `layer` on inputs of `input`, with parameters drawn from the device's
/// RNG.
fn build_layer(layer: &LayerSpec, input: Shape, device: &Device) -> Result<Layer> {
    // The features a layer on the last dimension sees (the channels of a batch norm).
    let last = match input {
        Shape::Image { c, .. } => c,
        Shape::Flat(f) => f,
        Shape::Seq { d, .. } => d,
    };
    Ok(match *layer {
        LayerSpec::Conv2d { .. } | LayerSpec::Maxpool { .. } | LayerSpec::Avgpool { .. } => {
            image_layer(layer, input, device)?
        }
        LayerSpec::Linear {
            out,
            bias,
            tie_embedding,
        } => {
            let inputs = match input {
                Shape::Seq { d, .. } => d,
                other => other.numel(),
            };
            let config = LinearConfig::new(inputs, out).with_bias(bias);
            match tie_embedding {
                // burn's bias of a linear layer, drawn the same way.
                true => Layer::TiedLinear(TiedLinear {
                    bias: bias.then(|| {
                        config
                            .initializer
                            .init_with([out], Some(inputs), Some(out), device)
                    }),
                }),
                false => Layer::Linear(config.init(device)),
            }
        }
        LayerSpec::Relu => Layer::Relu(Relu::new()),
        LayerSpec::Tanh => Layer::Tanh(Tanh::new()),
        LayerSpec::Sigmoid => Layer::Sigmoid(Sigmoid::new()),
        LayerSpec::Gelu => Layer::Gelu(Gelu::new()),
        LayerSpec::Silu => Layer::Silu(SiLU::new()),
        LayerSpec::Flatten => Layer::Flatten(Flatten),
        LayerSpec::Dropout { p } => Layer::Dropout(DropoutConfig::new(p).init()),
        LayerSpec::Identity => Layer::Identity(Identity),
        LayerSpec::LayerNorm => Layer::LayerNorm(
            LayerNormConfig::new(last)
                .with_epsilon(layer_norm::EPSILON)
                .init(device),
        ),
        LayerSpec::RmsNorm => Layer::RmsNorm(RmsNormConfig::new(last).init(device)),
        LayerSpec::BatchNorm => Layer::BatchNorm(BatchNormConfig::new(last).init(device)),
        LayerSpec::Embedding { vocab, dim } => {
            Layer::Embedding(EmbeddingConfig::new(vocab, dim).init(device))
        }
        LayerSpec::PosEmbedding { max_len } => {
            Layer::PosEmbedding(EmbeddingConfig::new(max_len, last).init(device))
        }
        LayerSpec::Attention { heads } => Layer::Attention(
            MultiHeadAttentionConfig::new(last, heads)
                .with_dropout(0.0)
                .init(device),
        ),
        LayerSpec::TransformerBlock { heads, mlp } => {
            let config = TransformerEncoderConfig::new(last, mlp * last, heads, 1)
                .with_dropout(0.0)
                .with_layer_norm_eps(layer_norm::EPSILON)
                .with_norm_first(true);
            Layer::Block(TransformerEncoderLayer::new(&config, device))
        }
    })
}

/// A convolution or pooling layer.
fn image_layer(layer: &LayerSpec, input: Shape, device: &Device) -> Result<Layer> {
    Ok(match *layer {
        LayerSpec::Conv2d {
            out,
            k,
            stride,
            padding,
            bias,
        } => {
            let Shape::Image { c, .. } = input else {
                return Err(EngineError::InvalidSpec(format!(
                    "conv2d needs an image input, got {input}"
                )));
            };
            Layer::Conv2d(
                Conv2dConfig::new([c, out], [k, k])
                    .with_stride([stride, stride])
                    .with_padding(PaddingConfig2d::Explicit(
                        padding, padding, padding, padding,
                    ))
                    .with_bias(bias)
                    .init(device),
            )
        }
        LayerSpec::Maxpool { k, stride } => Layer::MaxPool(
            MaxPool2dConfig::new([k, k])
                .with_strides([stride.unwrap_or(k); 2])
                .init(),
        ),
        LayerSpec::Avgpool { k, stride } => Layer::AvgPool(
            AvgPool2dConfig::new([k, k])
                .with_strides([stride.unwrap_or(k); 2])
                .init(),
        ),
        _ => Layer::Identity(Identity),
    })
}
