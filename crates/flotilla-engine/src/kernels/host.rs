//! Flex's tensors as host matrices: strided views of their buffers and new tensors from
//! `Vec`s, without copies.

use burn::backend::flex::FlexTensor;
use burn::tensor::{DType, TensorData};

use super::gemm::MatRef;

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

/// A contiguous `f32` tensor's values (`None`: another dtype, or not contiguous).
pub(crate) fn values(t: &FlexTensor) -> Option<&[f32]> {
    t.as_slice::<f32>()
}

/// A tensor of `shape` holding `values` (moved, not copied).
pub(crate) fn tensor(values: Vec<f32>, shape: Vec<usize>) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape))
}
