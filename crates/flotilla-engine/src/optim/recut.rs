//! One shard's optimizer state cut from state files written over other shards (or over the
//! whole model), reading only the tensors that overlap it: what a ZeRO resume at another
//! world size needs without any rank holding the whole state. [`crate::FlatOptimizerState`]
//! puts every file together first; this reads each file's header (burn's burnpack reader
//! parses the header alone and reads a tensor's bytes from the file only when asked) and
//! keeps a handle on each state tensor whose flat range meets the shard; the shard's pieces
//! are put together from them one at a time as burn's writer reaches each
//! (`recut_field.rs`). So a cut holds its output, one piece and one source tensor at a time.
//! The bytes are those [`crate::FlatOptimizerState::shard`] writes for the same shard, bit
//! for bit.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::store::burn_pack::{self, Bytes, Reader, Scalar, Writer};

use crate::error::Result;
use crate::optim::recut_field::{Data, PieceField, Stretch};
use crate::optim::reshard::{Piece, RANK_KEY, bad, pieces, split_key, written};
use crate::params::ParamLayout;

/// A state file and the flat ranges it was written over (`None`: the whole model's state).
pub type StateFile = (Option<Vec<Range<usize>>>, PathBuf);

/// A state file's own parameters when they are not the shard's model's: a pipeline stage of
/// another cut, whose parameter `i` is the shard model's parameter `i + shift` (when that is
/// one; the others are not the shard's), the same tensor by name and length.
pub struct Remap<'a> {
    /// The file's parameters.
    pub layout: &'a ParamLayout,
    /// Where they are among the shard model's parameters.
    pub shift: isize,
}

/// One shard's state as it is gathered from state files, one file after another
/// ([`ShardRecut::read_file`], or [`ShardRecut::read_bytes`] for one received whole), then
/// written as burn writes it ([`ShardRecut::finish`]).
pub struct ShardRecut {
    /// The shard's pieces, indexed by id.
    pieces: Vec<Piece>,
    /// Each piece's fields by name.
    fields: Vec<BTreeMap<String, PieceField>>,
    /// How many of each piece's values the files read so far were written over.
    covered: Vec<usize>,
    /// The scalars of each parameter tensor the shard meets that any file holds state for.
    scalars: BTreeMap<usize, BTreeMap<String, Scalar>>,
    /// The model's parameters.
    layout: ParamLayout,
}

/// The state of the shard of flat ranges `owned` over a model of `layout`, as
/// [`crate::ShardOptimizer::load_state`] of that shard takes it, read from `files`.
/// The files' ranges must cover the shard, and every field of a piece be covered completely.
pub fn recut_shard(
    layout: &ParamLayout,
    files: &[StateFile],
    owned: &[Range<usize>],
) -> Result<Vec<u8>> {
    let mut recut = ShardRecut::new(layout, owned)?;
    for (ranges, path) in files {
        recut.read_file(ranges.as_deref(), path)?;
    }
    recut.finish()
}

impl ShardRecut {
    /// The shard of flat ranges `owned` over a model of `layout`, holding nothing yet.
    pub fn new(layout: &ParamLayout, owned: &[Range<usize>]) -> Result<Self> {
        let pieces = pieces(layout, Some(owned))?;
        Ok(Self {
            fields: pieces.iter().map(|_| BTreeMap::new()).collect(),
            covered: vec![0; pieces.len()],
            pieces,
            scalars: BTreeMap::new(),
            layout: layout.clone(),
        })
    }

    /// Takes what the state file at `path`, written over `ranges` (`None`: the whole
    /// model), holds of the shard: its header, then only the tensors that meet the shard.
    pub fn read_file(&mut self, ranges: Option<&[Range<usize>]>, path: &Path) -> Result<()> {
        self.read_file_of(None, ranges, path)
    }

    /// [`ShardRecut::read_file`] of a file written over another model's parameters
    /// (`remap`; `None`: the shard's model), `ranges` of its flat parameters.
    pub fn read_file_of(
        &mut self,
        remap: Option<&Remap<'_>>,
        ranges: Option<&[Range<usize>]>,
        path: &Path,
    ) -> Result<()> {
        let named = |e: burn_pack::Error| bad(format!("{}: {e:?}", path.display()));
        let reader = Reader::from_file_exact(path).map_err(named)?;
        let source = self.sources(remap, ranges)?;
        self.read(&source, (reader, true), &path.display().to_string())
    }

    /// [`ShardRecut::read_file`] of a state file's bytes.
    pub fn read_bytes(&mut self, ranges: Option<&[Range<usize>]>, bytes: Vec<u8>) -> Result<()> {
        let reader =
            Reader::from_bytes(Bytes::from_bytes_vec(bytes)).map_err(|e| bad(format!("{e:?}")))?;
        let source = self.sources(None, ranges)?;
        self.read(&source, (reader, false), "a state")
    }

    /// The shard's state as burn writes it, in the order of
    /// [`crate::FlatOptimizerState::shard`]; refused when the files read left part of a
    /// piece uncovered (a file of the checkpoint left out, which would otherwise load as a
    /// state never stepped) or a field of a piece incomplete.
    pub fn finish(self) -> Result<Vec<u8>> {
        for ((id, piece), covered) in self.pieces.iter().enumerate().zip(&self.covered) {
            if *covered != piece.range.len() {
                return Err(bad(format!(
                    "the files cover {covered} of the {} values of piece {id} ({:?})",
                    piece.range.len(),
                    piece.range
                )));
            }
        }
        self.write()
    }

    /// The pieces of a file written over `ranges` of `remap`'s parameters (`None`: the
    /// shard's model's), indexed by the file's ids, as pieces of the shard's model (`None`:
    /// a piece of a parameter the shard's model does not hold); what they cover of each
    /// piece of the shard counted.
    fn sources(
        &mut self,
        remap: Option<&Remap<'_>>,
        ranges: Option<&[Range<usize>]>,
    ) -> Result<Vec<Option<Piece>>> {
        let Some(remap) = remap else {
            let source = pieces(&self.layout, ranges)?;
            return Ok(self.covering(source.into_iter().map(Some).collect()));
        };
        let mut source = Vec::new();
        for piece in pieces(remap.layout, ranges)? {
            let from = &remap.layout.params[piece.param];
            let to = (piece.param.checked_add_signed(remap.shift))
                .and_then(|j| Some((j, self.layout.params.get(j)?)));
            let Some((j, to)) = to else {
                source.push(None);
                continue;
            };
            if (&from.name, from.len) != (&to.name, to.len) {
                return Err(bad(format!(
                    "the file's {} ({} values) is the shard model's {} ({})",
                    from.name, from.len, to.name, to.len
                )));
            }
            let at = to.offset + (piece.range.start - from.offset);
            source.push(Some(Piece {
                range: at..at + piece.range.len(),
                param: j,
                shape: piece.shape,
            }));
        }
        Ok(self.covering(source))
    }

    /// Counts what the pieces `source` (of one file) cover of each piece of the shard.
    fn covering(&mut self, source: Vec<Option<Piece>>) -> Vec<Option<Piece>> {
        for (piece, covered) in self.pieces.iter().zip(&mut self.covered) {
            *covered += (source.iter().flatten())
                .map(|r| {
                    r.range
                        .end
                        .min(piece.range.end)
                        .saturating_sub(r.range.start.max(piece.range.start))
                })
                .sum::<usize>();
        }
        source
    }

    /// Whether parameter tensor `param`'s range `range` meets a piece of the shard.
    fn meets(&self, param: usize, range: &Range<usize>) -> bool {
        (self.pieces.iter())
            .any(|p| p.param == param && p.range.start < range.end && range.start < p.range.end)
    }

    /// Takes what `reader`'s file (written over `ranges`, named `what`) holds of the shard:
    /// its tensors that meet it, kept as the file's (`lazy`: read when the shard is written)
    /// or copied (the stretches that meet the shard alone).
    fn read(
        &mut self,
        source: &[Option<Piece>],
        (reader, lazy): (Reader, bool),
        what: &str,
    ) -> Result<()> {
        let named = |e: burn_pack::Error| bad(format!("{what}: {e:?}"));
        for (key, value) in reader.scalars() {
            let (piece, name) = split_key(key)
                .and_then(|(id, name)| Some((source.get(id)?, name)))
                .ok_or_else(|| bad(format!("scalar {key} names no piece")))?;
            let Some(piece) = piece.as_ref().filter(|p| self.meets(p.param, &p.range)) else {
                continue;
            };
            let scalars = self.scalars.entry(piece.param).or_default();
            if name == RANK_KEY {
                continue;
            }
            match scalars.insert(name.to_owned(), *value) {
                Some(old) if old != *value => {
                    return Err(bad(format!(
                        "{key} is {value:?} but another piece has {old:?}"
                    )));
                }
                _ => {}
            }
        }
        for tensor in reader.into_tensors().map_err(named)? {
            let (id, field) =
                split_key(&tensor.name).ok_or_else(|| bad(format!("tensor {}", tensor.name)))?;
            let piece = (tensor.param_id)
                .and_then(|id| usize::try_from(id).ok())
                .filter(|i| *i == id)
                .and_then(|id| source.get(id))
                .ok_or_else(|| bad(format!("tensor {} names no piece", tensor.name)))?;
            let Some(piece) = piece.as_ref().filter(|p| self.meets(p.param, &p.range)) else {
                continue;
            };
            let size = tensor.dtype.size();
            if tensor.byte_len() != piece.range.len() * size {
                return Err(bad(format!(
                    "{} of a piece of {} values has {} bytes of {size}",
                    tensor.name,
                    piece.range.len(),
                    tensor.byte_len()
                )));
            }
            let (field, dtype) = (field.to_owned(), tensor.dtype);
            let data = match lazy {
                true => Data::File(tensor),
                false => Data::Held(tensor.into_bytes().map_err(named)?.to_vec()),
            };
            self.take(piece, &field, dtype, Arc::new(data))?;
        }
        Ok(())
    }

    /// Adds `data`, the values of field `name` of source piece `from`, to the shard's pieces
    /// it meets (held values: a copy of each piece's part alone).
    fn take(
        &mut self,
        from: &Piece,
        name: &str,
        dtype: burn_pack::DType,
        data: Arc<Data>,
    ) -> Result<()> {
        let size = dtype.size();
        for (piece, fields) in self.pieces.iter().zip(&mut self.fields) {
            let (a, b) = (
                piece.range.start.max(from.range.start),
                piece.range.end.min(from.range.end),
            );
            if piece.param != from.param || a >= b {
                continue;
            }
            let field = fields.entry(name.to_owned()).or_insert_with(|| PieceField {
                dtype,
                filled: 0,
                stretches: Vec::new(),
            });
            if field.dtype != dtype {
                return Err(bad(format!(
                    "{name} is {dtype:?}, another piece {:?}",
                    field.dtype
                )));
            }
            field.filled += b - a;
            let stretch = match &*data {
                Data::File(_) => Stretch {
                    range: from.range.clone(),
                    data: data.clone(),
                },
                Data::Held(bytes) => Stretch {
                    range: a..b,
                    data: Arc::new(Data::Held(
                        bytes[(a - from.range.start) * size..(b - from.range.start) * size]
                            .to_vec(),
                    )),
                },
            };
            field.stretches.push(stretch);
        }
        Ok(())
    }

    /// The shard's state as burn writes it, in the order of
    /// [`crate::FlatOptimizerState::shard`], each piece's fields put together as the writer
    /// reaches them.
    fn write(self) -> Result<Vec<u8>> {
        let mut records = Vec::new();
        let mut scalars = Vec::new();
        for (id, (piece, fields)) in self.pieces.iter().zip(self.fields).enumerate() {
            let Some(own) = self.scalars.get(&piece.param) else {
                if let Some(name) = fields.keys().next() {
                    return Err(bad(format!("{name} of piece {id} without its scalars")));
                }
                continue;
            };
            scalars.push((format!("{id}.{RANK_KEY}"), Scalar::from(piece.shape.len())));
            for (name, value) in own {
                scalars.push((format!("{id}.{name}"), *value));
            }
            for (name, field) in fields {
                if field.filled != piece.range.len() {
                    return Err(bad(format!(
                        "{name} of piece {id} covers {} of its {} values",
                        field.filled,
                        piece.range.len()
                    )));
                }
                records.push(field.tensor(id, &name, piece.range.clone()));
            }
        }
        let mut writer = Writer::new(records);
        for (key, value) in scalars {
            writer = writer.with_scalar(&key, value);
        }
        written(writer)
    }
}
