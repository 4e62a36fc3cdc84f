//! An activation between layers (image, flat or sequence, batch first), and what the engine,
//! its grouped backward and a pipeline stage do with one: build it from a flat buffer, merge
//! it into another, read it and its gradient back, seed a vector-Jacobian product with it.

use burn::prelude::*;
use burn::tensor::{Gradients, TensorData};

use crate::device::copies;
use crate::error::{EngineError, Result};
use crate::spec::graph::Merge;
use crate::spec::shape::Shape;

/// An activation between layers, with the batch dimension first.
#[derive(Clone)]
pub(crate) enum Activation {
    /// `[n, c, h, w]`.
    Image(Tensor<4>),
    /// `[n, f]`.
    Flat(Tensor<2>),
    /// `[n, t, d]`.
    Seq(Tensor<3>),
}

/// `$body` on the tensor of any activation, bound to `$t` (its rank differs by kind), giving
/// an activation of the same kind.
macro_rules! map_tensor {
    ($x:expr, |$t:ident| $body:expr) => {
        match $x {
            $crate::spec::activation::Activation::Image($t) => {
                $crate::spec::activation::Activation::Image($body)
            }
            $crate::spec::activation::Activation::Flat($t) => {
                $crate::spec::activation::Activation::Flat($body)
            }
            $crate::spec::activation::Activation::Seq($t) => {
                $crate::spec::activation::Activation::Seq($body)
            }
        }
    };
}
pub(crate) use map_tensor;

/// `$body` on the tensor of any activation, bound to `$t`; its value as it is.
macro_rules! on_tensor {
    ($x:expr, |$t:ident| $body:expr) => {
        match $x {
            Activation::Image($t) => $body,
            Activation::Flat($t) => $body,
            Activation::Seq($t) => $body,
        }
    };
}

impl Activation {
    /// `self` merged with `other` (shapes were checked at load time).
    pub(crate) fn merge(self, other: Activation, how: Merge) -> Activation {
        use Activation::{Flat, Image, Seq};
        match (how, self, other) {
            (Merge::Add, Image(a), Image(b)) => Image(a + b),
            (Merge::Add, Flat(a), Flat(b)) => Flat(a + b),
            (Merge::Add, Seq(a), Seq(b)) => Seq(a + b),
            (Merge::Concat, Image(a), Image(b)) => Image(Tensor::cat(vec![a, b], 1)),
            (Merge::Concat, Flat(a), Flat(b)) => Flat(Tensor::cat(vec![a, b], 1)),
            (Merge::Concat, Seq(a), Seq(b)) => Seq(Tensor::cat(vec![a, b], 2)),
            // Shape inference rules out mixing kinds.
            (_, a, _) => a,
        }
    }

    /// `n` samples of `shape` from a flat row-major buffer (checked by the caller).
    pub(crate) fn from_flat(values: Vec<f32>, n: usize, shape: Shape, device: &Device) -> Self {
        let _copy = copies::to_device("activations", values.len());
        match shape {
            Shape::Image { c, h, w } => Activation::Image(Tensor::from_data(
                TensorData::new(values, [n, c, h, w]),
                device,
            )),
            Shape::Flat(f) => {
                Activation::Flat(Tensor::from_data(TensorData::new(values, [n, f]), device))
            }
            Shape::Seq { t, d } => Activation::Seq(Tensor::from_data(
                TensorData::new(values, [n, t, d]),
                device,
            )),
        }
    }

    /// The number of samples (the batch dimension).
    pub(crate) fn samples(&self) -> usize {
        on_tensor!(self, |t| t.dims()[0])
    }

    /// The same values as a leaf whose gradient backward will compute.
    pub(crate) fn require_grad(self) -> Self {
        map_tensor!(self, |t| t.require_grad())
    }

    /// The values, row-major.
    pub(crate) fn to_flat(&self) -> Result<Vec<f32>> {
        let _copy = copies::to_host("activations", self.numel());
        on_tensor!(self, |t| t.to_data())
            .convert::<f32>()
            .try_into_vec::<f32>()
            .map_err(|e| EngineError::Batch(format!("reading an activation: {e:?}")))
    }

    /// This leaf's gradient after a backward pass, row-major (`None` if it got none).
    pub(crate) fn grad(&self, grads: &Gradients) -> Option<Result<Vec<f32>>> {
        let _copy = copies::to_host("activation gradients", self.numel());
        let data = on_tensor!(self, |t| t.grad(grads)?.into_data());
        Some(
            data.convert::<f32>()
                .try_into_vec::<f32>()
                .map_err(|e| EngineError::Batch(format!("reading a gradient: {e:?}"))),
        )
    }

    /// `Σ self · g`: the scalar whose gradient with respect to `self` is `g` (the
    /// vector-Jacobian product's seed). `g` has `self`'s shape, row-major.
    pub(crate) fn dot(&self, g: Vec<f32>) -> Tensor<1> {
        let _copy = copies::to_device("activation gradients", g.len());
        on_tensor!(self, |t| {
            let g = Tensor::from_data(TensorData::new(g, t.shape()), &t.device());
            (t.clone() * g).sum()
        })
    }

    /// The same values as a fresh leaf of a new graph whose gradient backward will compute
    /// (the cut between two backward groups; no copy of the values).
    pub(crate) fn leaf(&self) -> Self {
        map_tensor!(self, |t| t.clone().detach().require_grad())
    }

    /// Takes this leaf's gradient out of `grads` as a tensor (`None` if it got none).
    pub(crate) fn take_grad(&self, grads: &mut Gradients) -> Option<Activation> {
        match self {
            Activation::Image(t) => t.grad_remove(grads).map(Activation::Image),
            Activation::Flat(t) => t.grad_remove(grads).map(Activation::Flat),
            Activation::Seq(t) => t.grad_remove(grads).map(Activation::Seq),
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
            (Activation::Seq(t), Activation::Seq(g)) if t.shape() == g.shape() => {
                Ok((t.clone() * g).sum())
            }
            (_, g) => Err(EngineError::Batch(format!(
                "a gradient of {} values for an activation of {}",
                g.numel(),
                self.numel()
            ))),
        }
    }

    /// The device its tensor is on.
    pub(crate) fn device(&self) -> Device {
        on_tensor!(self, |t| t.device())
    }

    /// Number of values.
    pub(crate) fn numel(&self) -> usize {
        on_tensor!(self, |t| t.shape().num_elements())
    }

    /// The logits as `[rows, classes]`: a row per sample (an image is flattened), or per
    /// position of a sequence (`[n, t, d]` as `[n · t, d]`, sample by sample).
    pub(crate) fn into_logits(self) -> Tensor<2> {
        match self {
            Activation::Flat(t) => t,
            Activation::Image(t) => t.flatten(1, 3),
            Activation::Seq(t) => t.flatten(0, 1),
        }
    }
}
