//! [`FlatOptimizerState`]: optimizer state taken apart into whole-model flat form, to re-cut
//! it by other shards (a ZeRO checkpoint resumed on another number of ranks, or unsharded,
//! or an unsharded one resumed under ZeRO: DeepSpeed's "universal checkpoint").
//!
//! burn writes a [`burn::optim::ModuleOptimizer`]'s state as a burnpack keyed by parameter
//! id: tensors `"{id}.{field}"` shaped as the parameter (Adam's `moment_1`, `moment_2`,
//! SGD's momentum, whatever the optimizer records hold) and scalars `"{id}.{name}"` (Adam's
//! step count `time`, the state's rank `__rank`). The whole model's state (the
//! [`crate::ModelState`] of zero 0) has one id per parameter tensor, its position in flat
//! order; a [`crate::ShardOptimizer`]'s has one id per piece of its shard, in flat order
//! ([`shard_pieces`]). Gathering reads each field's values into their flat place of each
//! parameter tensor (and each tensor's scalars, which every piece of it shares: they are
//! stepped together); cutting writes them back for any other set of pieces. Values move as
//! bytes, so the state is bitwise the same wherever it is cut. Parameter paths are not
//! carried: Flotilla's parameter groups match ids, never paths.

use std::collections::BTreeMap;
use std::ops::Range;

use burn::store::burn_pack::{self, Bytes, DType, Reader, Scalar, Writer};

use crate::error::{EngineError, Result};
use crate::optim::shard_optim::shard_pieces;
use crate::params::ParamLayout;

/// The scalar under which burn keeps the rank of a parameter's state.
pub(super) const RANK_KEY: &str = "__rank";

/// A state's bytes and the flat ranges it was written over (`None`: the whole model).
pub type StatePart<'a> = (Option<&'a [Range<usize>]>, &'a [u8]);

/// One field of one parameter tensor's state: its element type, bytes over the whole tensor,
/// and how many elements the parts gathered so far filled.
#[derive(Debug, Clone, PartialEq)]
struct Field {
    dtype: DType,
    bytes: Vec<u8>,
    filled: usize,
}

/// One parameter tensor's state.
#[derive(Debug, Clone, Default, PartialEq)]
struct TensorState {
    /// Whether any part held state for the tensor (burn holds none before its first step).
    present: bool,
    fields: BTreeMap<String, Field>,
    scalars: BTreeMap<String, Scalar>,
}

/// An optimizer's state over the whole model's flat parameters, by parameter tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct FlatOptimizerState {
    tensors: Vec<TensorState>,
}

/// A state's ids: each one's flat range, parameter tensor and the shape of its tensors.
#[derive(Clone)]
pub(super) struct Piece {
    pub(super) range: Range<usize>,
    pub(super) param: usize,
    pub(super) shape: Vec<usize>,
}

/// The pieces of a state over `owned` (a shard's flat ranges), or over the whole model
/// (`None`: one per parameter tensor, shaped as it), indexed by id.
pub(super) fn pieces(layout: &ParamLayout, owned: Option<&[Range<usize>]>) -> Result<Vec<Piece>> {
    Ok(match owned {
        None => layout
            .params
            .iter()
            .enumerate()
            .map(|(i, p)| Piece {
                range: p.offset..p.offset + p.len,
                param: i,
                shape: p.shape.clone(),
            })
            .collect(),
        Some(owned) => shard_pieces(layout, owned)?
            .into_iter()
            .map(|p| Piece {
                shape: vec![p.range.len()],
                range: p.range,
                param: p.param,
            })
            .collect(),
    })
}

pub(super) fn bad(message: String) -> EngineError {
    EngineError::Optimizer(format!("re-sharding state: {message}"))
}

/// The bytes `writer` writes, in one buffer of their size (burn's `into_bytes` and a copy
/// to a `Vec` would hold them twice).
pub(super) fn written(writer: Writer) -> Result<Vec<u8>> {
    let size = writer.size().map_err(|e| bad(format!("{e:?}")))?;
    let mut out = vec![0; size];
    writer
        .write_into(&mut out)
        .map_err(|e| bad(format!("{e:?}")))?;
    Ok(out)
}

/// `"{id}.{rest}"` split into the id and the rest.
pub(super) fn split_key(key: &str) -> Option<(usize, &str)> {
    let (id, rest) = key.split_once('.')?;
    Some((id.parse().ok()?, rest))
}

impl FlatOptimizerState {
    /// Gathers states written over a model of `layout`: each part is a state's bytes and the
    /// flat ranges it was written over (`None`: the whole model's state, as
    /// [`crate::ModelState::optimizer_state`] writes it; else a [`crate::ShardOptimizer`]'s
    /// over those ranges). Every field of a tensor must be covered completely.
    pub fn gather(layout: &ParamLayout, parts: &[StatePart<'_>]) -> Result<Self> {
        let mut tensors = vec![TensorState::default(); layout.params.len()];
        for (owned, bytes) in parts {
            let pieces = pieces(layout, *owned)?;
            let reader = Reader::from_bytes(Bytes::from_bytes_vec(bytes.to_vec()))
                .map_err(|e| bad(format!("{e:?}")))?;
            for (key, value) in reader.scalars() {
                let piece = split_key(key)
                    .and_then(|(id, name)| Some((pieces.get(id)?, name)))
                    .ok_or_else(|| bad(format!("scalar {key} names no piece")))?;
                let state = &mut tensors[piece.0.param];
                state.present = true;
                if piece.1 == RANK_KEY {
                    continue;
                }
                match state.scalars.insert(piece.1.to_owned(), *value) {
                    Some(old) if old != *value => {
                        return Err(bad(format!(
                            "{key} is {value:?} but another piece has {old:?}"
                        )));
                    }
                    _ => {}
                }
            }
            let records = reader.into_tensors().map_err(|e| bad(format!("{e:?}")))?;
            for record in records {
                let (name, dtype, _, id, data) =
                    record.into_parts().map_err(|e| bad(format!("{e:?}")))?;
                gather_tensor(layout, &pieces, &mut tensors, &name, id, dtype, &data)?;
            }
        }
        for (i, state) in tensors.iter().enumerate() {
            for (name, field) in &state.fields {
                if field.filled != layout.params[i].len {
                    return Err(bad(format!(
                        "{name} of parameter {i} covers {} of its {} values",
                        field.filled, layout.params[i].len
                    )));
                }
            }
        }
        Ok(Self { tensors })
    }

    /// The states of consecutive parts of a model (a pipeline's stages, each gathered over
    /// its own layout) as one state over their tensors in order.
    pub fn concat(parts: Vec<Self>) -> Self {
        Self {
            tensors: parts.into_iter().flat_map(|p| p.tensors).collect(),
        }
    }

    /// The state of parameter tensors `params` alone (a pipeline stage of them), over a
    /// layout of those tensors; `None` when the state has fewer.
    pub fn select(&self, params: Range<usize>) -> Option<Self> {
        Some(Self {
            tensors: self.tensors.get(params)?.to_vec(),
        })
    }

    /// How many parameter tensors the state is over.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether the state is over no parameter tensor.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// The state of the whole model, as [`crate::ModelState::load_optimizer_state`] takes it.
    pub fn whole(&self, layout: &ParamLayout) -> Result<Vec<u8>> {
        self.cut(layout, None)
    }

    /// The state of the shard of flat ranges `owned`, as [`crate::ShardOptimizer::load_state`]
    /// of that shard takes it.
    pub fn shard(&self, layout: &ParamLayout, owned: &[Range<usize>]) -> Result<Vec<u8>> {
        self.cut(layout, Some(owned))
    }

    /// The values of the state's field `name` (e.g. `moment_1`) over the whole flat
    /// parameters, as `f32`; `None` unless every parameter tensor has it in `f32`.
    pub fn field_values(&self, layout: &ParamLayout, name: &str) -> Option<Vec<f32>> {
        let mut out = Vec::with_capacity(layout.total);
        for state in &self.tensors {
            let field = state.fields.get(name).filter(|f| f.dtype == DType::F32)?;
            out.extend(
                field
                    .bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            );
        }
        Some(out)
    }

    /// The names of the state's fields (e.g. `moment_1`) over any parameter tensor, sorted.
    pub fn field_names(&self) -> Vec<String> {
        let names: std::collections::BTreeSet<&String> =
            self.tensors.iter().flat_map(|s| s.fields.keys()).collect();
        names.into_iter().cloned().collect()
    }

    /// The scalars of parameter tensor `i`'s state (e.g. Adam's `time`), by name.
    pub fn scalars(&self, i: usize) -> Option<&BTreeMap<String, Scalar>> {
        self.tensors.get(i).map(|s| &s.scalars)
    }

    fn cut(&self, layout: &ParamLayout, owned: Option<&[Range<usize>]>) -> Result<Vec<u8>> {
        let mut records = Vec::new();
        let mut scalars = Vec::new();
        for (id, piece) in pieces(layout, owned)?.into_iter().enumerate() {
            let state = &self.tensors[piece.param];
            if !state.present {
                continue;
            }
            scalars.push((format!("{id}.{RANK_KEY}"), Scalar::from(piece.shape.len())));
            for (name, value) in &state.scalars {
                scalars.push((format!("{id}.{name}"), *value));
            }
            let at = piece.range.start - layout.params[piece.param].offset;
            for (name, field) in &state.fields {
                let size = field.dtype.size();
                let bytes = field.bytes[at * size..(at + piece.range.len()) * size].to_vec();
                records.push(burn_pack::Tensor::new(
                    format!("{id}.{name}"),
                    field.dtype,
                    piece.shape.clone(),
                    Some(id as u64),
                    Bytes::from_bytes_vec(bytes),
                ));
            }
        }
        let mut writer = Writer::new(records);
        for (key, value) in scalars {
            writer = writer.with_scalar(&key, value);
        }
        written(writer)
    }
}

/// Copies one state tensor (`name`, of piece `id`) into its tensor's field.
fn gather_tensor(
    layout: &ParamLayout,
    pieces: &[Piece],
    tensors: &mut [TensorState],
    name: &str,
    id: Option<u64>,
    dtype: DType,
    data: &[u8],
) -> Result<()> {
    let (key_id, field_name) = split_key(name).ok_or_else(|| bad(format!("tensor {name}")))?;
    let piece = id
        .and_then(|id| usize::try_from(id).ok())
        .filter(|id| *id == key_id)
        .and_then(|id| pieces.get(id))
        .ok_or_else(|| bad(format!("tensor {name} names no piece")))?;
    let size = dtype.size();
    if data.len() != piece.range.len() * size {
        return Err(bad(format!(
            "tensor {name} has {} bytes, its piece {} values of {size}",
            data.len(),
            piece.range.len()
        )));
    }
    let param = &layout.params[piece.param];
    let state = &mut tensors[piece.param];
    state.present = true;
    let field = state
        .fields
        .entry(field_name.to_owned())
        .or_insert_with(|| Field {
            dtype,
            bytes: vec![0; param.len * size],
            filled: 0,
        });
    if field.dtype != dtype {
        return Err(bad(format!(
            "tensor {name} is {dtype:?}, another piece {:?}",
            field.dtype
        )));
    }
    let at = (piece.range.start - param.offset) * size;
    field.bytes[at..at + data.len()].copy_from_slice(data);
    field.filled += piece.range.len();
    Ok(())
}
