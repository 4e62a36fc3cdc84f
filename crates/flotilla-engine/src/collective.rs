//! A differentiable all-reduce: the one collective a model's forward pass takes part in
//! (synchronized batch norm's statistics, [`crate::sync_batch_norm`]).
//!
//! [`all_reduce_sum`] sums a tensor over every rank of a group; its backward sums the incoming
//! gradient over the ranks again, since every rank's input reaches every rank's output. burn
//! has no cross-process collective in its autodiff graph (its own `DistributedOps` reduce
//! across the devices of one process), so this is a burn **backend extension**
//! ([`#[backend_extension]`](burn::backend::backend_extension)): the forward op on each
//! backend, and a hand-written `Backward` on `Autodiff` that runs the same all-reduce on the
//! gradient. The engine never sees the communication layer: the sum itself is a
//! [`Reducer`] over a flat `f32` buffer, which the caller supplies (`flotilla-burn` and the
//! all-reduce strategies wrap a process group in one).
//!
//! Every rank must call it in the same order with tensors of the same shape, in forward and in
//! backward alike; the same model on the same shapes does. A backend op cannot return an
//! error, so a failed sum is kept in the [`ReducerHandle`] ([`ReducerHandle::take_error`]) and
//! the op returns its input unchanged; the caller checks after the pass.

// burn 0.22 deprecates NdArray and LibTorch but still ships them: the extension names them.
#![cfg_attr(any(feature = "ndarray", feature = "libtorch"), allow(deprecated))]

use std::fmt;
use std::sync::{Arc, Mutex};

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, Flex, TensorMetadata};
use burn::prelude::*;
use burn::tensor::TensorData;
use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, unary};

use crate::kernels::autodiff::record;
use crate::kernels::backends::{engine_extension, impl_on_burn_backends};

/// An element-wise sum of a flat buffer over every rank of a group, in place (the same buffer
/// length on every rank).
pub trait Reducer: Send + Sync {
    /// Replaces `values` by their sum over the ranks.
    ///
    /// # Errors
    /// What the communication layer reports, as text (the engine does not know its types).
    fn all_reduce_sum(&self, values: &mut [f32]) -> std::result::Result<(), String>;

    /// How many ranks take part (1: the sum is the value itself).
    fn world(&self) -> usize;
}

/// A [`Reducer`] as the differentiable all-reduce carries it through burn's dispatch and
/// autodiff graph, with the first error any of its sums met.
#[derive(Clone)]
pub struct ReducerHandle {
    reducer: Arc<dyn Reducer>,
    error: Arc<Mutex<Option<String>>>,
}

impl fmt::Debug for ReducerHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ReducerHandle(world {})", self.reducer.world())
    }
}

impl ReducerHandle {
    /// Wraps `reducer`.
    pub fn new(reducer: Arc<dyn Reducer>) -> Self {
        Self {
            reducer,
            error: Arc::new(Mutex::new(None)),
        }
    }

    /// How many ranks take part.
    pub fn world(&self) -> usize {
        self.reducer.world()
    }

    /// The first error a sum met since the last call (the sums after it were skipped).
    pub fn take_error(&self) -> Option<String> {
        self.error.lock().ok().and_then(|mut e| e.take())
    }

    /// Sums `values` over the ranks, unless an earlier sum failed (then they stay local and
    /// the pass is void: see [`ReducerHandle::take_error`]).
    pub fn sum_in_place(&self, values: &mut [f32]) {
        let Ok(mut error) = self.error.lock() else {
            return;
        };
        if error.is_some() {
            return;
        }
        if let Err(e) = self.reducer.all_reduce_sum(values) {
            *error = Some(e);
        }
    }

    /// The sum over the ranks of a tensor of any backend, through host memory.
    fn sum_primitive<B: Backend>(&self, tensor: FloatTensor<B>) -> FloatTensor<B> {
        if self.world() == 1 {
            return tensor;
        }
        let device = tensor.device();
        let shape = tensor.shape();
        let read = burn::tensor::try_read_sync(B::float_into_data(tensor.clone()));
        let values = read
            .and_then(|r| r.ok())
            .and_then(|data| data.try_into_vec_as::<f32>().ok());
        let Some(mut values) = values else {
            if let Ok(mut error) = self.error.lock() {
                error.get_or_insert_with(|| "a tensor could not be read for a sum".into());
            }
            return tensor;
        };
        self.sum_in_place(&mut values);
        B::float_from_data(TensorData::new(values, shape), &device)
    }
}

engine_extension! {
    /// The backend side of the differentiable all-reduce.
    pub trait CollectiveOps: Backend {
        /// The element-wise sum of `tensor` over the ranks of `reducer` (through host memory,
        /// on every backend but `Autodiff`).
        fn all_reduce_sum(tensor: FloatTensor<Self>, reducer: ReducerHandle) -> FloatTensor<Self> {
            reducer.sum_primitive::<Self>(tensor)
        }
    }
}

// Flex, NdArray, LibTorch and wgpu's `Cube`: the sum through host memory.
impl CollectiveOps for Flex {}
impl_on_burn_backends!(CollectiveOps);

/// The all-reduce's backward: the gradient summed over the ranks.
#[derive(Debug)]
struct AllReduceSum;

impl<B: Backend + CollectiveOps> Backward<B, 1> for AllReduceSum {
    type State = ReducerHandle;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let reducer = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            B::all_reduce_sum(grad, reducer)
        });
    }
}

impl<B: Backend + CollectiveOps, C: CheckpointStrategy> CollectiveOps for Autodiff<B, C> {
    fn all_reduce_sum(tensor: FloatTensor<Self>, reducer: ReducerHandle) -> FloatTensor<Self> {
        let (tensor, node) = tensor.into_parts();
        let output = B::all_reduce_sum(tensor, reducer.clone());
        record(
            AllReduceSum.prepare::<C>([node]),
            output,
            |output| (output, reducer),
            |output| output,
        )
    }
}

/// The element-wise sum of `tensor` over the ranks of `reducer`, differentiable: its gradient
/// is the incoming gradient summed over the ranks.
pub fn all_reduce_sum<const D: usize>(tensor: Tensor<D>, reducer: &ReducerHandle) -> Tensor<D> {
    if reducer.world() == 1 {
        return tensor;
    }
    Tensor::from_dispatch(<Dispatch as CollectiveOps>::all_reduce_sum(
        tensor.into_dispatch(),
        reducer.clone(),
    ))
}
