//! Flex tensors as host memory for the kernels of this module: `f32` slices, strided views
//! of their buffers, and new tensors from `Vec`s, without copies where the layout allows.

use burn::backend::flex::FlexTensor;
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{BackendTensor, DispatchTensor, DispatchTensorKind, Flex};
use burn::tensor::{DType, TensorData};

use super::gemm::MatRef;

/// `tensor` in row-major order (a copy only if it is strided), or `None` unless it is `f32`.
pub(crate) fn contiguous_f32(tensor: &FloatTensor<Flex>) -> Option<FloatTensor<Flex>> {
    (tensor.dtype() == DType::F32).then(|| tensor.to_contiguous())
}

/// The values of a tensor [`contiguous_f32`] returned (empty if it is not one).
pub(crate) fn slice(tensor: &FloatTensor<Flex>) -> &[f32] {
    values(tensor).unwrap_or(&[])
}

/// A contiguous `f32` tensor's values (`None`: another dtype, or not contiguous).
pub(crate) fn values(t: &FlexTensor) -> Option<&[f32]> {
    t.as_slice::<f32>()
}

/// A 2-D `f32` tensor as a strided view of its buffer (`None`: another dtype or rank, or a
/// negative stride).
pub(crate) fn matrix(t: &FlexTensor) -> Option<MatRef<'_>> {
    let layout = t.layout();
    if t.dtype() != DType::F32 || layout.num_dims() != 2 {
        return None;
    }
    let [rows, cols] = layout.shape().dims::<2>();
    let (rs, cs) = match layout.strides() {
        &[rs, cs] => (usize::try_from(rs).ok()?, usize::try_from(cs).ok()?),
        _ => return None,
    };
    let data = t.storage::<f32>().get(layout.start_offset()..)?;
    Some(MatRef {
        data,
        rows,
        cols,
        rs,
        cs,
    })
}

/// The Flex tensor `tensor` holds when that is a contiguous `f32` one (its buffer shared, not
/// copied), else `None`.
pub(crate) fn flex_f32(tensor: &DispatchTensor) -> Option<FlexTensor> {
    match &tensor.kind {
        DispatchTensorKind::Flex(BackendTensor::Float(t)) if values(t).is_some() => Some(t.clone()),
        _ => None,
    }
}

/// A Flex tensor of `shape` holding `values` (moved, not copied).
pub(crate) fn tensor(values: Vec<f32>, shape: impl Into<burn::tensor::Shape>) -> FloatTensor<Flex> {
    Flex::float_from_data(TensorData::new(values, shape), &Default::default())
}

/// Every one of `tensors` as [`contiguous_f32`] gives it, or `None` unless all are `f32`.
pub(crate) fn contiguous_f32_all<const N: usize>(
    tensors: [&FloatTensor<Flex>; N],
) -> Option<[FloatTensor<Flex>; N]> {
    let all: Option<Vec<_>> = tensors.into_iter().map(contiguous_f32).collect();
    all?.try_into().ok()
}
