//! The convolution as a burn backend extension: the forward op on Flex (over
//! [`super::kernels`], on Flex's own buffers; a ReLU that follows the layer fused), and a
//! hand-written `Backward` on `Autodiff` that computes the input, weight and bias gradients
//! in one pass over the batch (through the fused ReLU, from the kept output).
//!
//! Only Flex (and `Autodiff` over it) is routed; [`super::conv2d`] sends the other backends'
//! tensors to burn's own convolution and never here.

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Flex, backend_extension};
use burn::tensor::TensorData;
use burn_autodiff::Autodiff;
use burn_autodiff::NodeId;
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};

use super::geometry::ConvGeom;
use super::kernels;

/// The backend side of the convolution.
#[backend_extension(Flex, Autodiff)]
pub trait ConvOps: Backend {
    /// `x` `[N, C, H, W]` convolved with `weight` `[out, C, kh, kw]`, plus `bias` `[out]`
    /// (zeros for a layer without one), through ReLU when `relu`: `[N, out, Ho, Wo]`, the
    /// windows as `geom` describes them.
    fn conv2d_patches(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        geom: ConvGeom,
        relu: bool,
    ) -> FloatTensor<Self>;
}

/// The gradients of a convolution: the input's (when asked), the weight's and the bias'.
pub type ConvGrads<B> = (Option<FloatTensor<B>>, FloatTensor<B>, FloatTensor<B>);

/// The gradients of [`ConvOps::conv2d_patches`], on the backend under `Autodiff`.
pub trait ConvGradOps: ConvOps {
    /// The gradients of the input (when `with_input`), weight and bias for the output gradient
    /// `grad`, through the fused ReLU whose output was `relu_output` when there is one.
    fn conv2d_patches_grads(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        relu_output: Option<FloatTensor<Self>>,
        geom: ConvGeom,
        with_input: bool,
    ) -> ConvGrads<Self>;
}

/// A Flex tensor's values as one contiguous `f32` slice (copied only when it is a strided
/// view). [`super::conv2d`] sends only `f32` tensors here.
fn values(t: &FloatTensor<Flex>) -> std::borrow::Cow<'_, [f32]> {
    match t.as_slice::<f32>() {
        Some(v) => v.into(),
        None => t
            .to_contiguous()
            .into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .unwrap_or_default()
            .into(),
    }
}

/// A new Flex tensor over `values`.
fn tensor(values: Vec<f32>, shape: Vec<usize>) -> FloatTensor<Flex> {
    FloatTensor::<Flex>::from_data(TensorData::new(values, shape))
}

impl ConvOps for Flex {
    fn conv2d_patches(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        geom: ConvGeom,
        relu: bool,
    ) -> FloatTensor<Self> {
        let y = kernels::forward(&geom, &values(&x), &values(&weight), &values(&bias), relu);
        let [ho, wo] = geom.output;
        tensor(y, vec![geom.batch, geom.out, ho, wo])
    }
}

impl ConvGradOps for Flex {
    fn conv2d_patches_grads(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        relu_output: Option<FloatTensor<Self>>,
        geom: ConvGeom,
        with_input: bool,
    ) -> ConvGrads<Self> {
        let (x, weight, grad) = (values(&x), values(&weight), values(&grad));
        let relu_output = relu_output.as_ref().map(values);
        let input = kernels::BackwardInputs {
            x: &x,
            weight: &weight,
            dy: &grad,
            relu_output: relu_output.as_deref(),
        };
        let g = kernels::backward(&geom, input, with_input);
        let [c, h, w] = geom.input;
        let [kh, kw] = geom.kernel;
        (
            g.x.map(|dx| tensor(dx, vec![geom.batch, c, h, w])),
            tensor(g.weight, vec![geom.out, c, kh, kw]),
            tensor(g.bias, vec![geom.out]),
        )
    }
}

/// The convolution's backward (parents: input, weight, bias).
#[derive(Debug)]
struct ConvBackward;

/// What the backward keeps: the checkpointed input and weight, the geometry and, with a fused
/// ReLU, the layer's output.
#[derive(Clone, Debug)]
struct ConvState<B: Backend> {
    x: NodeId,
    weight: NodeId,
    geom: ConvGeom,
    relu_output: Option<FloatTensor<B>>,
}

/// The output gradient of the op at `node`, and the gradients it gives the parents that track
/// one (`x`, `weight`, `bias`), registered in `grads`.
fn run_backward<B: ConvGradOps>(
    grad: FloatTensor<B>,
    [x_node, weight_node, bias_node]: [Option<NodeId>; 3],
    state: ConvState<B>,
    grads: &mut Gradients,
    checkpointer: &mut Checkpointer,
) {
    let x = checkpointer.retrieve_node_output::<FloatTensor<B>>(state.x);
    let weight = checkpointer.retrieve_node_output::<FloatTensor<B>>(state.weight);
    let with_input = x_node.is_some();
    let (dx, dw, db) =
        B::conv2d_patches_grads(x, weight, grad, state.relu_output, state.geom, with_input);
    if let (Some(node), Some(dx)) = (x_node, dx) {
        grads.register::<B>(node, dx);
    }
    if let Some(node) = weight_node {
        grads.register::<B>(node, dw);
    }
    if let Some(node) = bias_node {
        grads.register::<B>(node, db);
    }
}

impl<B: ConvGradOps> Backward<B, 3> for ConvBackward {
    type State = ConvState<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let parents = ops.parents.map(|p| p.map(|n| n.id));
        run_backward::<B>(grad, parents, ops.state, grads, checkpointer);
    }
}

impl<B: ConvGradOps, C: CheckpointStrategy> ConvOps for Autodiff<B, C> {
    fn conv2d_patches(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        geom: ConvGeom,
        relu: bool,
    ) -> FloatTensor<Self> {
        let nodes = [x.node(), weight.node(), bias.node()];
        let forward = |x: FloatTensor<Self>, weight: FloatTensor<Self>, bias: FloatTensor<Self>| {
            B::conv2d_patches(
                x.into_primitive(),
                weight.into_primitive(),
                bias.into_primitive(),
                geom,
                relu,
            )
        };
        match ConvBackward.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(mut prep) => {
                let (x_id, weight_id) = (prep.checkpoint(&x), prep.checkpoint(&weight));
                let y = forward(x, weight, bias);
                let state = ConvState {
                    x: x_id,
                    weight: weight_id,
                    geom,
                    relu_output: relu.then(|| y.clone()),
                };
                prep.finish(state, y)
            }
            OpsKind::UnTracked(prep) => prep.finish(forward(x, weight, bias)),
        }
    }
}
