//! [`GlobalOutput`]: the outputs of one step on every rank as the output of the global batch,
//! so that the metrics rank 0 shows (loss, accuracy, ...) are those of every rank's samples.
//!
//! An output crosses the wire as its tensors' values and shapes ([`Piece`]), gathered to every
//! rank ([`ProcessGroup::all_gather_bytes`]); rank 0 rebuilds one output from them: the rows of
//! every rank in rank order, the loss the mean over every sample (each rank's loss weighted by
//! its batch's size).

use burn::prelude::*;
use burn::tensor::TensorData;
use burn::train::{
    ClassificationOutput, MultiLabelClassificationOutput, RegressionOutput, SequenceOutput,
};
use flotilla_group::ProcessGroup;

use crate::error::{DistError, Result};

/// One tensor of a step's output, flat, with its shape.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    /// A float tensor's values (as `f32`).
    Float {
        /// The tensor's shape.
        shape: Vec<usize>,
        /// Its values, row-major.
        values: Vec<f32>,
    },
    /// An integer tensor's values (as `i64`).
    Int {
        /// The tensor's shape.
        shape: Vec<usize>,
        /// Its values, row-major.
        values: Vec<i64>,
    },
}

/// A step's output that the ranks can combine into the output of the global batch (burn's
/// classification, multi-label, regression and sequence outputs; a user's own output type can
/// implement it too).
pub trait GlobalOutput: Sized {
    /// The output's tensors as pieces (in an order of the implementation's choosing).
    fn into_pieces(self) -> Vec<Piece>;

    /// The output of the global batch from every rank's pieces, in rank order (a rank with
    /// no output this step gives none), on `device`.
    fn from_ranks(ranks: Vec<Vec<Piece>>, device: &Device) -> Result<Self>;

    /// The batch's mean loss (what the one stack's run logs for the step).
    fn loss_value(&self) -> f32;
}

/// The output of the global batch on rank 0 (`None` on the other ranks); `mine` is `None` when
/// this rank had no batch (every rank must call it, with or without one: it is collective).
pub fn gather<O: GlobalOutput>(
    group: &dyn ProcessGroup,
    mine: Option<O>,
    device: &Device,
) -> Result<Option<O>> {
    let bytes = mine.map(|o| encode(&o.into_pieces())).unwrap_or_default();
    let all = group.all_gather_bytes(&bytes)?;
    if group.rank() != 0 {
        return Ok(None);
    }
    let ranks: Vec<Vec<Piece>> = all
        .iter()
        .filter(|b| !b.is_empty())
        .map(|b| decode(b))
        .collect::<Result<_>>()?;
    if ranks.is_empty() {
        return Ok(None);
    }
    O::from_ranks(ranks, device).map(Some)
}

/// A float tensor as a piece.
pub fn float_piece<const D: usize>(t: Tensor<D>) -> Piece {
    let shape = t.dims().to_vec();
    let values = t.into_data().try_into_vec_as::<f32>().unwrap_or_default();
    Piece::Float { shape, values }
}

/// An integer tensor as a piece.
pub fn int_piece<const D: usize>(t: Tensor<D, Int>) -> Piece {
    let shape = t.dims().to_vec();
    let values = t.into_data().try_into_vec_as::<i64>().unwrap_or_default();
    Piece::Int { shape, values }
}

fn bad(what: String) -> DistError {
    DistError::Output(what)
}

fn shape_of<const D: usize>(shape: &[usize], rows: usize) -> Result<[usize; D]> {
    let mut out = [0usize; D];
    if shape.len() != D {
        return Err(bad(format!(
            "a piece of rank {} where {D} was expected",
            shape.len()
        )));
    }
    out.copy_from_slice(shape);
    out[0] = rows;
    Ok(out)
}

/// The float pieces at `index` of every rank, rows concatenated in rank order.
pub fn concat_float<const D: usize>(
    ranks: &[Vec<Piece>],
    index: usize,
    device: &Device,
) -> Result<Tensor<D>> {
    let (mut values, mut rows, mut shape) = (Vec::new(), 0, Vec::new());
    for pieces in ranks {
        match pieces.get(index) {
            Some(Piece::Float {
                shape: s,
                values: v,
            }) if !s.is_empty() => {
                rows += s[0];
                shape.clone_from(s);
                values.extend_from_slice(v);
            }
            _ => {
                return Err(bad(format!(
                    "piece {index} is not a float tensor on every rank"
                )));
            }
        }
    }
    let dims = shape_of::<D>(&shape, rows)?;
    check_len(values.len(), &dims)?;
    Ok(Tensor::from_data(TensorData::new(values, dims), device))
}

/// The integer pieces at `index` of every rank, rows concatenated in rank order.
pub fn concat_int<const D: usize>(
    ranks: &[Vec<Piece>],
    index: usize,
    device: &Device,
) -> Result<Tensor<D, Int>> {
    let (mut values, mut rows, mut shape) = (Vec::new(), 0, Vec::new());
    for pieces in ranks {
        match pieces.get(index) {
            Some(Piece::Int {
                shape: s,
                values: v,
            }) if !s.is_empty() => {
                rows += s[0];
                shape.clone_from(s);
                values.extend_from_slice(v);
            }
            _ => {
                return Err(bad(format!(
                    "piece {index} is not an integer tensor on every rank"
                )));
            }
        }
    }
    let dims = shape_of::<D>(&shape, rows)?;
    check_len(values.len(), &dims)?;
    Ok(Tensor::from_data(TensorData::new(values, dims), device))
}

fn check_len(len: usize, dims: &[usize]) -> Result<()> {
    let want: usize = dims.iter().product();
    if len == want {
        Ok(())
    } else {
        Err(bad(format!("{len} values for a tensor of shape {dims:?}")))
    }
}

/// The mean of every rank's one-value loss (piece `loss`) weighted by its batch's rows (the
/// first dimension of piece `rows`): the loss over every sample of the global batch.
pub fn weighted_loss(
    ranks: &[Vec<Piece>],
    loss: usize,
    rows: usize,
    device: &Device,
) -> Result<Tensor<1>> {
    let (mut sum, mut count) = (0.0f64, 0usize);
    for pieces in ranks {
        let value = match pieces.get(loss) {
            Some(Piece::Float { values, .. }) if values.len() == 1 => values[0],
            _ => {
                return Err(bad(format!(
                    "piece {loss} is not a one-value loss on every rank"
                )));
            }
        };
        let n = match pieces.get(rows) {
            Some(Piece::Float { shape, .. } | Piece::Int { shape, .. }) if !shape.is_empty() => {
                shape[0]
            }
            _ => return Err(bad(format!("piece {rows} has no rows on some rank"))),
        };
        sum += f64::from(value) * n as f64;
        count += n;
    }
    let mean = if count == 0 { 0.0 } else { sum / count as f64 };
    Ok(Tensor::from_data(
        TensorData::new(vec![mean as f32], [1]),
        device,
    ))
}

/// `GlobalOutput` for an output of a loss, float rows `output` and `targets` of the piece
/// kind given (integer for burn's classification and multi-label outputs, float for its
/// regression output).
macro_rules! loss_output_targets {
    ($($output:ty: $piece:ident, $concat:ident);*) => {$(
        impl GlobalOutput for $output {
            fn loss_value(&self) -> f32 {
                self.loss.clone().into_scalar::<f32>()
            }

            fn into_pieces(self) -> Vec<Piece> {
                vec![
                    float_piece(self.loss),
                    float_piece(self.output),
                    $piece(self.targets),
                ]
            }

            fn from_ranks(ranks: Vec<Vec<Piece>>, device: &Device) -> Result<Self> {
                Ok(Self {
                    loss: weighted_loss(&ranks, 0, 2, device)?,
                    output: concat_float(&ranks, 1, device)?,
                    targets: $concat(&ranks, 2, device)?,
                })
            }
        }
    )*};
}

loss_output_targets!(
    ClassificationOutput: int_piece, concat_int;
    MultiLabelClassificationOutput: int_piece, concat_int;
    RegressionOutput: float_piece, concat_float
);

impl GlobalOutput for SequenceOutput {
    fn loss_value(&self) -> f32 {
        self.loss.clone().into_scalar::<f32>()
    }

    /// The loss, logits and targets (the predictions, if any, are dropped: the metrics take
    /// the logits' largest then, as burn does without them).
    fn into_pieces(self) -> Vec<Piece> {
        vec![
            float_piece(self.loss),
            float_piece(self.logits),
            int_piece(self.targets),
        ]
    }

    fn from_ranks(ranks: Vec<Vec<Piece>>, device: &Device) -> Result<Self> {
        Ok(Self {
            loss: weighted_loss(&ranks, 0, 2, device)?,
            logits: concat_float(&ranks, 1, device)?,
            predictions: None,
            targets: concat_int(&ranks, 2, device)?,
        })
    }
}

/// The pieces as bytes: per piece its kind (0 float, 1 int), its rank, its dimensions (u64),
/// its values (little-endian).
pub fn encode(pieces: &[Piece]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(pieces.len() as u32).to_le_bytes());
    for piece in pieces {
        let (kind, shape) = match piece {
            Piece::Float { shape, .. } => (0u8, shape),
            Piece::Int { shape, .. } => (1u8, shape),
        };
        out.push(kind);
        out.extend_from_slice(&(shape.len() as u32).to_le_bytes());
        for d in shape {
            out.extend_from_slice(&(*d as u64).to_le_bytes());
        }
        match piece {
            Piece::Float { values, .. } => values
                .iter()
                .for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
            Piece::Int { values, .. } => values
                .iter()
                .for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        }
    }
    out
}

/// Reads what [`encode`] wrote; a short or inconsistent message is an error, never a panic.
pub fn decode(bytes: &[u8]) -> Result<Vec<Piece>> {
    let mut r = Reader { bytes, at: 0 };
    let count = r.u32()? as usize;
    let mut pieces = Vec::with_capacity(count.min(64));
    for _ in 0..count {
        let kind = r.take(1)?[0];
        let ndim = r.u32()? as usize;
        if ndim > 8 {
            return Err(bad(format!("a piece of rank {ndim}")));
        }
        let shape = (0..ndim)
            .map(|_| r.u64().map(|d| d as usize))
            .collect::<Result<Vec<_>>>()?;
        let n = shape
            .iter()
            .try_fold(1usize, |a, d| a.checked_mul(*d))
            .ok_or_else(|| bad(format!("shape {shape:?} overflows")))?;
        let width = n
            .checked_mul(if kind == 0 { 4 } else { 8 })
            .ok_or_else(|| bad(format!("shape {shape:?} overflows")))?;
        let raw = r.take(width)?;
        pieces.push(match kind {
            0 => Piece::Float {
                shape,
                values: raw
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            },
            1 => Piece::Int {
                shape,
                values: raw
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                    .collect(),
            },
            k => return Err(bad(format!("a piece of kind {k}"))),
        });
    }
    if r.at != bytes.len() {
        return Err(bad(format!(
            "{} bytes after the last piece",
            bytes.len() - r.at
        )));
    }
    Ok(pieces)
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.at.checked_add(n).filter(|e| *e <= self.bytes.len());
        let end = end.ok_or_else(|| {
            bad(format!(
                "a message of {} bytes ends early",
                self.bytes.len()
            ))
        })?;
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }

    fn u32(&mut self) -> Result<u32> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Result<u64> {
        let b = self.take(8)?;
        Ok(u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cross_the_wire_unchanged_and_a_cut_message_is_an_error() {
        let pieces = vec![
            Piece::Float {
                shape: vec![2, 3],
                values: vec![1.0, -2.5, 3.0, 0.0, f32::MIN_POSITIVE, 7.0],
            },
            Piece::Int {
                shape: vec![2],
                values: vec![9, -1],
            },
        ];
        let bytes = encode(&pieces);
        assert_eq!(decode(&bytes).ok(), Some(pieces));
        for cut in [0, 3, 5, bytes.len() - 1] {
            assert!(decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(decode(&longer).is_err());
    }

    #[test]
    fn the_global_classification_output_is_every_ranks_rows_with_the_sample_weighted_loss() {
        let device = Device::flex();
        let part = |loss: f32, rows: usize, first: i64| ClassificationOutput {
            loss: Tensor::from_data(TensorData::new(vec![loss], [1]), &device),
            output: Tensor::from_data(
                TensorData::new(vec![first as f32; rows * 2], [rows, 2]),
                &device,
            ),
            targets: Tensor::from_data(TensorData::new(vec![first; rows], [rows]), &device),
        };
        let ranks = vec![part(1.0, 3, 0).into_pieces(), part(3.0, 1, 1).into_pieces()];
        let global = ClassificationOutput::from_ranks(ranks, &device).expect("combines");
        // (1·3 + 3·1) / 4 samples.
        assert_eq!(global.loss.into_scalar::<f32>(), 1.5);
        assert_eq!(global.output.dims(), [4, 2]);
        let targets = global
            .targets
            .into_data()
            .try_into_vec_as::<i64>()
            .unwrap_or_default();
        assert_eq!(targets, vec![0, 0, 0, 1]);
    }
}
