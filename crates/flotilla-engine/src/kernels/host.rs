//! Flex tensors as `f32` slices and back, for the kernels of this module.

use burn::backend::Flex;
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::tensor::{DType, TensorData};

/// `tensor` in row-major order (a copy only if it is strided), or `None` unless it is `f32`.
pub(crate) fn contiguous_f32(tensor: &FloatTensor<Flex>) -> Option<FloatTensor<Flex>> {
    (tensor.dtype() == DType::F32).then(|| tensor.to_contiguous())
}

/// The values of a tensor [`contiguous_f32`] returned.
pub(crate) fn values(tensor: &FloatTensor<Flex>) -> &[f32] {
    tensor.as_slice::<f32>().unwrap_or(&[])
}

/// A Flex tensor of `shape` holding `values` (moved, not copied).
pub(crate) fn tensor(values: Vec<f32>, shape: impl Into<burn::tensor::Shape>) -> FloatTensor<Flex> {
    Flex::float_from_data(TensorData::new(values, shape), &Default::default())
}
