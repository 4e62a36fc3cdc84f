//! One field (e.g. Adam's `moment_1`) of one piece of a shard being cut by
//! [`crate::ShardRecut`]: where its values are, stretch by stretch, until the shard is
//! written; then put together one piece at a time, as burn's writer reaches it
//! ([`PieceField::tensor`]), so that a cut holds its output and one piece's field, not
//! every field twice.

use std::ops::Range;
use std::sync::Arc;

use burn::store::burn_pack::{self, Bytes, DType};

/// Where a stretch's values are.
pub(super) enum Data {
    /// A state tensor of a file, over its whole source piece, read from the file when the
    /// shard is written.
    File(burn_pack::Tensor),
    /// Values copied out of a file received whole, over the stretch alone.
    Held(Vec<u8>),
}

/// Values of a field over flat range `range` (the data's), of which the piece takes the
/// part inside its own range.
pub(super) struct Stretch {
    pub(super) range: Range<usize>,
    pub(super) data: Arc<Data>,
}

/// A piece's field: its element type, how many of its values the stretches give, and them.
pub(super) struct PieceField {
    pub(super) dtype: DType,
    pub(super) filled: usize,
    pub(super) stretches: Vec<Stretch>,
}

impl PieceField {
    /// The field of piece `id` (flat range `range`) named `name`, as a tensor whose bytes
    /// are put together from its stretches only when the writer asks for them.
    pub(super) fn tensor(self, id: usize, name: &str, range: Range<usize>) -> burn_pack::Tensor {
        let size = self.dtype.size();
        let stretches = self.stretches;
        let (len, bytes) = (range.len(), range.len() * size);
        let provider = move || assemble(&stretches, &range, size);
        burn_pack::Tensor::deferred(
            format!("{id}.{name}"),
            self.dtype,
            vec![len],
            Some(id as u64),
            bytes,
            provider,
        )
    }
}

/// The values over `range` of `stretches` (elements of `size` bytes).
fn assemble(
    stretches: &[Stretch],
    range: &Range<usize>,
    size: usize,
) -> Result<Bytes, burn_pack::Error> {
    let mut out = vec![0u8; range.len() * size];
    for s in stretches {
        let (a, b) = (range.start.max(s.range.start), range.end.min(s.range.end));
        if a >= b {
            continue;
        }
        let file;
        let data: &[u8] = match &*s.data {
            Data::File(tensor) => {
                file = tensor.to_bytes()?;
                &file
            }
            Data::Held(bytes) => bytes,
        };
        let (at, to, len) = (
            (a - s.range.start) * size,
            (a - range.start) * size,
            (b - a) * size,
        );
        let window = data.get(at..at + len).ok_or_else(|| {
            burn_pack::Error::TensorBytesSizeMismatch(format!(
                "a stretch of {} bytes over {} values of {size}",
                data.len(),
                s.range.len()
            ))
        })?;
        out[to..to + len].copy_from_slice(window);
    }
    Ok(Bytes::from_bytes_vec(out))
}
