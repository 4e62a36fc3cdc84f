//! The burn model built from a [`ModelSpec`]: a `Vec` of layer modules applied in order.

use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::pool::{AvgPool2d, AvgPool2dConfig, MaxPool2d, MaxPool2dConfig};
use burn::nn::{
    Dropout, DropoutConfig, Linear, LinearConfig, PaddingConfig2d, Relu, Sigmoid, Tanh,
};
use burn::prelude::*;

use std::collections::HashMap;
use std::ops::Range;

use burn::tensor::{Gradients, TensorData};

use crate::error::{EngineError, Result};
use crate::graph::Merge;
use crate::spec::{LayerSpec, ModelSpec, Shape};

/// One layer of a [`SequentialModel`]. Its variant names do not appear in checkpoints:
/// tensors are saved as `layers.<index>.<weight|bias>`, as a PyTorch `nn.Sequential` named
/// `layers` would name them.
#[derive(Module, Debug)]
pub enum Layer {
    /// 2-D convolution.
    Conv2d(Conv2d),
    /// Max pooling.
    MaxPool(MaxPool2d),
    /// Average pooling.
    AvgPool(AvgPool2d),
    /// Fully connected.
    Linear(Linear),
    /// ReLU.
    Relu(Relu),
    /// Tanh.
    Tanh(Tanh),
    /// Sigmoid.
    Sigmoid(Sigmoid),
    /// Flatten `[N, C, H, W]` to `[N, C*H*W]` (no parameters).
    Flatten(Flatten),
    /// Dropout.
    Dropout(Dropout),
    /// Identity (a merge point without a computation).
    Identity(Identity),
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
}

/// An activation between layers: image-like or flat, with the batch dimension first.
#[derive(Clone)]
pub(crate) enum Activation {
    Image(Tensor<4>),
    Flat(Tensor<2>),
}

impl Activation {
    /// `self` merged with `other` (shapes were checked at load time).
    fn merge(self, other: Activation, how: Merge) -> Activation {
        match (how, self, other) {
            (Merge::Add, Activation::Image(a), Activation::Image(b)) => Activation::Image(a + b),
            (Merge::Add, Activation::Flat(a), Activation::Flat(b)) => Activation::Flat(a + b),
            (Merge::Concat, Activation::Image(a), Activation::Image(b)) => {
                Activation::Image(Tensor::cat(vec![a, b], 1))
            }
            (Merge::Concat, Activation::Flat(a), Activation::Flat(b)) => {
                Activation::Flat(Tensor::cat(vec![a, b], 1))
            }
            // Shape inference rules out mixing images and flat activations.
            (_, a, _) => a,
        }
    }
}

impl Activation {
    /// `n` samples of `shape` from a flat row-major buffer (checked by the caller).
    pub(crate) fn from_flat(values: Vec<f32>, n: usize, shape: Shape, device: &Device) -> Self {
        match shape {
            Shape::Image { c, h, w } => Activation::Image(Tensor::from_data(
                TensorData::new(values, [n, c, h, w]),
                device,
            )),
            Shape::Flat(f) => {
                Activation::Flat(Tensor::from_data(TensorData::new(values, [n, f]), device))
            }
        }
    }

    /// The same values as a leaf whose gradient backward will compute.
    pub(crate) fn require_grad(self) -> Self {
        match self {
            Activation::Image(t) => Activation::Image(t.require_grad()),
            Activation::Flat(t) => Activation::Flat(t.require_grad()),
        }
    }

    /// The values, row-major.
    pub(crate) fn to_flat(&self) -> Result<Vec<f32>> {
        let data = match self {
            Activation::Image(t) => t.to_data(),
            Activation::Flat(t) => t.to_data(),
        };
        data.convert::<f32>()
            .try_into_vec::<f32>()
            .map_err(|e| EngineError::Batch(format!("reading an activation: {e:?}")))
    }

    /// This leaf's gradient after a backward pass, row-major (`None` if it got none).
    pub(crate) fn grad(&self, grads: &Gradients) -> Option<Result<Vec<f32>>> {
        let data = match self {
            Activation::Image(t) => t.grad(grads)?.into_data(),
            Activation::Flat(t) => t.grad(grads)?.into_data(),
        };
        Some(
            data.convert::<f32>()
                .try_into_vec::<f32>()
                .map_err(|e| EngineError::Batch(format!("reading a gradient: {e:?}"))),
        )
    }

    /// `Σ self · g`: the scalar whose gradient with respect to `self` is `g` (the
    /// vector-Jacobian product's seed). `g` has `self`'s shape, row-major.
    pub(crate) fn dot(&self, g: Vec<f32>) -> Tensor<1> {
        match self {
            Activation::Image(t) => {
                let g = Tensor::<4>::from_data(TensorData::new(g, t.shape()), &t.device());
                (t.clone() * g).sum()
            }
            Activation::Flat(t) => {
                let g = Tensor::<2>::from_data(TensorData::new(g, t.shape()), &t.device());
                (t.clone() * g).sum()
            }
        }
    }

    /// The same values as a fresh leaf of a new graph whose gradient backward will compute
    /// (the cut between two backward groups; no copy of the values).
    pub(crate) fn leaf(&self) -> Self {
        match self {
            Activation::Image(t) => Activation::Image(t.clone().detach().require_grad()),
            Activation::Flat(t) => Activation::Flat(t.clone().detach().require_grad()),
        }
    }

    /// Takes this leaf's gradient out of `grads` as a tensor (`None` if it got none).
    pub(crate) fn take_grad(&self, grads: &mut Gradients) -> Option<Activation> {
        match self {
            Activation::Image(t) => t.grad_remove(grads).map(Activation::Image),
            Activation::Flat(t) => t.grad_remove(grads).map(Activation::Flat),
        }
    }

    /// `Σ self · g` for a gradient tensor `g` of `self`'s shape (taken with
    /// [`Activation::take_grad`]): the seed of a vector-Jacobian product. Its backward hands
    /// `self` exactly `g` (`1 · g`), bit for bit.
    pub(crate) fn dot_grad(&self, g: Activation) -> Result<Tensor<1>> {
        match (self, g) {
            (Activation::Image(t), Activation::Image(g)) if t.shape() == g.shape() => {
                Ok((t.clone() * g).sum())
            }
            (Activation::Flat(t), Activation::Flat(g)) if t.shape() == g.shape() => {
                Ok((t.clone() * g).sum())
            }
            (_, g) => Err(EngineError::Batch(format!(
                "a gradient of {} values for an activation of {}",
                g.numel(),
                self.numel()
            ))),
        }
    }

    /// Number of values.
    pub(crate) fn numel(&self) -> usize {
        match self {
            Activation::Image(t) => t.shape().num_elements(),
            Activation::Flat(t) => t.shape().num_elements(),
        }
    }

    /// As `[N, features]` (logits).
    pub(crate) fn into_logits(self) -> Tensor<2> {
        match self {
            Activation::Flat(t) => t,
            Activation::Image(t) => t.flatten(1, 3),
        }
    }
}

impl SequentialModel {
    /// Builds the model on `device`; parameters are initialised from the device's RNG (seed it
    /// first for determinism). The spec must have passed shape inference.
    pub fn new(spec: &ModelSpec, device: &Device) -> Result<Self> {
        let io = spec.infer_io()?;
        let mut layers = Vec::with_capacity(spec.layers.len());
        let mut links = Vec::with_capacity(spec.layers.len());
        for (node, (input, _)) in spec.layers.iter().zip(io) {
            layers.push(build_layer(&node.layer, input, device)?);
            links.push(Links {
                keep: node.out_variables.clone(),
                take: node.dependencies.clone(),
                merge: node.merge,
            });
        }
        Ok(Self { layers, links })
    }

    /// The logits of the whole model for `input`.
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
        for i in range {
            let Some(layer) = self.layers.get(i) else {
                break;
            };
            let links = self.links.get(i).unwrap_or(&none);
            for name in &links.take {
                if let Some(other) = kept.get(name) {
                    x = x.merge(other.clone(), links.merge);
                }
            }
            x = apply(layer, x);
            for name in &links.keep {
                kept.insert(name.clone(), x.clone());
            }
        }
        x
    }
}

/// One layer on one activation.
fn apply(layer: &Layer, x: Activation) -> Activation {
    match (layer, x) {
        (Layer::Conv2d(m), Activation::Image(t)) => Activation::Image(m.forward(t)),
        (Layer::MaxPool(m), Activation::Image(t)) => Activation::Image(m.forward(t)),
        (Layer::AvgPool(m), Activation::Image(t)) => Activation::Image(m.forward(t)),
        (Layer::Linear(m), Activation::Flat(t)) => Activation::Flat(m.forward(t)),
        (Layer::Flatten(_), Activation::Image(t)) => Activation::Flat(t.flatten(1, 3)),
        (Layer::Flatten(_), flat @ Activation::Flat(_)) => flat,
        (Layer::Relu(m), x) => map_any(x, |t| m.forward(t), |t| m.forward(t)),
        (Layer::Tanh(m), x) => map_any(x, |t| m.forward(t), |t| m.forward(t)),
        (Layer::Sigmoid(m), x) => map_any(x, |t| m.forward(t), |t| m.forward(t)),
        (Layer::Dropout(m), x) => map_any(x, |t| m.forward(t), |t| m.forward(t)),
        // Shape inference at load time rules these out: a linear layer always follows
        // a flatten, an image layer never follows one.
        (Layer::Linear(m), Activation::Image(t)) => Activation::Flat(m.forward(t.flatten(1, 3))),
        (Layer::Identity(_), x) => x,
        (_, Activation::Flat(t)) => Activation::Flat(t),
    }
}

fn map_any(
    x: Activation,
    image: impl FnOnce(Tensor<4>) -> Tensor<4>,
    flat: impl FnOnce(Tensor<2>) -> Tensor<2>,
) -> Activation {
    match x {
        Activation::Image(t) => Activation::Image(image(t)),
        Activation::Flat(t) => Activation::Flat(flat(t)),
    }
}

fn build_layer(layer: &LayerSpec, input: Shape, device: &Device) -> Result<Layer> {
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
        LayerSpec::Linear { out, bias } => Layer::Linear(
            LinearConfig::new(input.numel(), out)
                .with_bias(bias)
                .init(device),
        ),
        LayerSpec::Relu => Layer::Relu(Relu::new()),
        LayerSpec::Tanh => Layer::Tanh(Tanh::new()),
        LayerSpec::Sigmoid => Layer::Sigmoid(Sigmoid::new()),
        LayerSpec::Flatten => Layer::Flatten(Flatten),
        LayerSpec::Dropout { p } => Layer::Dropout(DropoutConfig::new(p).init()),
        LayerSpec::Identity => Layer::Identity(Identity),
    })
}
