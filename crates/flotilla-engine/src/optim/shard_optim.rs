//! [`ShardOptimizer`]: burn's optimizer on one rank's shard of the flat parameters (ZeRO
//! stages 1 and 2), with that shard's optimizer state only.
//!
//! The shard is a set of flat ranges; cut at the parameter tensors' boundaries they are the
//! *pieces*, each held as one 1-D burn `Param` of a `Vec` module (parameter id = the piece's
//! position). burn's own optimizer (the configured one, built by
//! [`OptimizerSpec::build_with_matrices`]) steps that module, so per-parameter state and
//! parameter groups apply as for the whole model: a piece of a tensor of two or more
//! dimensions is in the group that decays with `decay_params: matrices`. Every update burn's
//! optimizers make (SGD with momentum, weight decay, Nesterov; Adam; AdamW) is element-wise,
//! so a piece's new values are bit for bit those of the same elements stepped as a whole
//! tensor.
//!
//! A step hands burn a chunk of the pieces at a time ([`STEP_CHUNK_VALUES`]), so that the
//! copies it makes for burn are a chunk's, not the shard's. The state may live in files
//! instead of memory ([`ShardOptimizer::offload_to`], `optim/offload.rs`): a step then
//! streams through the shard in chunks of the files, with the same bits.

use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use burn::module::{Param, ParamId};
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::prelude::*;
use burn::store::burn_pack::Reader;
use burn::tensor::TensorData;

use crate::device::copies;
use crate::device::device_by_name;
use crate::error::{EngineError, Result};
use crate::optim::OptimizerSpec;
use crate::optim::offload::{self, OFFLOAD_CHUNK_VALUES, Offload};
use crate::optim::state_check::{Expected, check_state_shapes};
use crate::params::{ParamLayout, copy_tensor};

/// Parameter values one call of burn's optimizer steps at most (unless one piece alone has
/// more): a step copies a chunk's values and gradients into burn's tensors and back, 8 MiB,
/// instead of the whole shard's (twice the shard: 218 MiB a rank for the 57 M GPT on 2
/// ranks). burn's updates are element-wise, so the chunks' steps are the whole shard's, bit for
/// bit.
const STEP_CHUNK_VALUES: usize = 1 << 20;

/// One contiguous run of a shard inside one parameter tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardPiece {
    /// Flat range of the piece.
    pub range: Range<usize>,
    /// Index of its parameter tensor in the layout.
    pub param: usize,
}

/// The configured burn optimizer over this rank's shard of the flat parameters.
pub struct ShardOptimizer {
    pieces: Vec<ShardPiece>,
    optimizer: ModuleOptimizer,
    /// The settings, for the optimizers of offloaded chunks.
    spec: OptimizerSpec,
    /// The ids of the pieces of tensors of two or more dimensions (the decay group).
    matrices: Vec<ParamId>,
    /// Where the state is when it is not in `optimizer` ([`ShardOptimizer::offload_to`]).
    offload: Option<Offload>,
    /// The device of the gradients (without autodiff, as burn's optimizers take them).
    device: Device,
    /// The device of the pieces (with autodiff, as the model's parameters are).
    autodiff: Device,
    total: usize,
    /// Values a call of burn's optimizer steps at most ([`STEP_CHUNK_VALUES`]).
    step_chunk: usize,
    /// Whether each step keeps the state from before it ([`ShardOptimizer::keep_undo`]).
    keeps_undo: bool,
    /// The state before the last step, while [`ShardOptimizer::keep_undo`] is on: a clone of
    /// burn's records (its tensors' handles, not their values).
    before: Option<ModuleOptimizer>,
    /// The bytes of tensor values in the state as [`ShardOptimizer::save_state`] last wrote
    /// it, read from the file's header, while no step, undo or load changed the state since
    /// ([`UNKNOWN`] otherwise): what [`ShardOptimizer::state_bytes`] gives without
    /// serializing the state again after a checkpoint.
    written_bytes: AtomicU64,
}

/// [`ShardOptimizer`]'s `written_bytes` when the state changed since it was last written.
const UNKNOWN: u64 = u64::MAX;

impl std::fmt::Debug for ShardOptimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardOptimizer")
            .field("pieces", &self.pieces.len())
            .field("values", &self.len())
            .finish_non_exhaustive()
    }
}

/// `owned` (flat ranges, in any order, disjoint) cut at the tensors of `layout`, in flat order.
pub fn shard_pieces(layout: &ParamLayout, owned: &[Range<usize>]) -> Result<Vec<ShardPiece>> {
    let mut ranges: Vec<Range<usize>> = owned.iter().filter(|r| !r.is_empty()).cloned().collect();
    ranges.sort_by_key(|r| r.start);
    let mut pieces = Vec::new();
    let mut end = 0;
    for r in ranges {
        if r.start < end || r.end > layout.total {
            return Err(EngineError::FlatLength {
                expected: layout.total,
                got: r.end,
            });
        }
        end = r.end;
        for (i, p) in layout.params.iter().enumerate() {
            let (a, b) = (r.start.max(p.offset), r.end.min(p.offset + p.len));
            if a < b {
                pieces.push(ShardPiece {
                    range: a..b,
                    param: i,
                });
            }
        }
    }
    Ok(pieces)
}

impl ShardOptimizer {
    /// The optimizer of `spec` over the flat ranges `owned` of a model of `layout`, on the
    /// named device.
    pub fn new(
        spec: &OptimizerSpec,
        layout: &ParamLayout,
        owned: &[Range<usize>],
        device_name: &str,
    ) -> Result<Self> {
        let pieces = shard_pieces(layout, owned)?;
        let device = device_by_name(device_name)?;
        let matrices: Vec<ParamId> = pieces
            .iter()
            .enumerate()
            .filter(|(_, p)| layout.params[p.param].shape.len() >= 2)
            .map(|(k, _)| ParamId::from(k as u64))
            .collect();
        Ok(Self {
            optimizer: spec.build_with_matrices(matrices.clone())?,
            spec: spec.clone(),
            matrices,
            offload: None,
            autodiff: device.clone().autodiff(),
            device,
            pieces,
            total: layout.total,
            step_chunk: STEP_CHUNK_VALUES,
            keeps_undo: false,
            before: None,
            written_bytes: AtomicU64::new(UNKNOWN),
        })
    }

    /// Steps in chunks of about `values` values (tests: [`STEP_CHUNK_VALUES`] is larger than
    /// their models).
    #[cfg(test)]
    pub(crate) fn set_step_chunk(&mut self, values: usize) {
        self.step_chunk = values;
    }

    /// Whether each step keeps the state from before it, so that one step can be taken back
    /// ([`ShardOptimizer::state_before`], [`ShardOptimizer::undo`]): an elastic ZeRO run
    /// whose step went through here but not on every member (its all-gather failed) goes on
    /// from the step before it.
    pub fn keep_undo(&mut self, on: bool) {
        self.keeps_undo = on;
        if !on {
            self.before = None;
        }
    }

    /// Moves the optimizer state into files in a new directory under `base` (removed when
    /// the optimizer is dropped): from now on a step reads, steps and writes back one chunk
    /// of the shard at a time (`optim/offload.rs`), with the same bits as in memory.
    /// Refused while [`ShardOptimizer::keep_undo`] is on (the undo keeps the state in memory).
    pub fn offload_to(&mut self, base: &Path) -> Result<()> {
        self.offload_in_chunks(base, OFFLOAD_CHUNK_VALUES)
    }

    /// [`ShardOptimizer::offload_to`] in chunks of about `chunk_values` values.
    pub(crate) fn offload_in_chunks(&mut self, base: &Path, chunk_values: usize) -> Result<()> {
        if self.keeps_undo {
            return Err(EngineError::Optimizer(
                "an optimizer that keeps the state before its step (an elastic job's) keeps \
                 it in memory: it cannot be offloaded"
                    .into(),
            ));
        }
        let state = self.state()?;
        let lens: Vec<usize> = self.pieces.iter().map(|p| p.range.len()).collect();
        let mut offload =
            Offload::new(base, &self.spec, self.matrices.clone(), &lens, chunk_values)?;
        offload.load(burn::tensor::Bytes::from_bytes_vec(state))?;
        self.optimizer = self.spec.build_with_matrices(self.matrices.clone())?;
        self.offload = Some(offload);
        Ok(())
    }

    /// Bytes of state tensor values held in memory (none once offloaded).
    #[cfg(test)]
    pub(crate) fn resident_bytes(&self) -> Result<u64> {
        let bytes = module_state(&self.optimizer)?;
        crate::optimizer_state_bytes(&bytes)
    }

    /// The directory of the offloaded state, if [`ShardOptimizer::offload_to`] moved it there.
    pub fn offloaded_to(&self) -> Option<&Path> {
        self.offload.as_ref().map(Offload::dir)
    }

    /// The state from before the last step (as [`ShardOptimizer::state`] writes it), if
    /// [`ShardOptimizer::keep_undo`] kept it.
    pub fn state_before(&self) -> Option<Result<Vec<u8>>> {
        self.before.as_ref().map(module_state)
    }

    /// Takes the last step's state change back; `false` when no state from before it is kept.
    pub fn undo(&mut self) -> bool {
        match self.before.take() {
            Some(before) => {
                self.optimizer = before;
                *self.written_bytes.get_mut() = UNKNOWN;
                true
            }
            None => false,
        }
    }

    /// The pieces, in flat order.
    pub fn pieces(&self) -> &[ShardPiece] {
        &self.pieces
    }

    /// Number of parameter values in the shard.
    pub fn len(&self) -> usize {
        self.pieces.iter().map(|p| p.range.len()).sum()
    }

    /// Whether the shard holds no value (a rank of a world larger than the model).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// One optimizer step at `lr`: the shard's values of `params` (the whole flat
    /// parameters) move by `grads`, the shard's gradient alone: its pieces' values one after
    /// the other in flat order ([`ShardOptimizer::len`] of them, as a ZeRO rank keeps it
    /// after the reduce-scatter). The rest of `params` is left alone.
    pub fn step(&mut self, params: &mut [f32], grads: &[f32], lr: f64) -> Result<()> {
        if params.len() != self.total {
            return Err(EngineError::FlatLength {
                expected: self.total,
                got: params.len(),
            });
        }
        let ranges: Vec<Range<usize>> = self.pieces.iter().map(|p| p.range.clone()).collect();
        self.step_in(params, &ranges, grads, lr)
    }

    /// [`ShardOptimizer::step`] on the shard's values alone (`shard`: its pieces' values one
    /// after the other in flat order, as `grads`), for a rank that holds no other parameter
    /// (ZeRO-3).
    pub fn step_shard(&mut self, shard: &mut [f32], grads: &[f32], lr: f64) -> Result<()> {
        if shard.len() != self.len() {
            return Err(EngineError::FlatLength {
                expected: self.len(),
                got: shard.len(),
            });
        }
        let mut at = 0;
        let ranges: Vec<Range<usize>> = self
            .pieces
            .iter()
            .map(|p| {
                at += p.range.len();
                at - p.range.len()..at
            })
            .collect();
        self.step_in(shard, &ranges, grads, lr)
    }

    /// One step of the pieces whose values are `values[ranges[k]]` (piece `k`'s), of the
    /// state in memory or chunk by chunk of the offloaded one.
    fn step_in(
        &mut self,
        values: &mut [f32],
        ranges: &[Range<usize>],
        grads: &[f32],
        lr: f64,
    ) -> Result<()> {
        if grads.len() != self.len() {
            return Err(EngineError::FlatLength {
                expected: self.len(),
                got: grads.len(),
            });
        }
        if self.pieces.is_empty() {
            return Ok(());
        }
        let _span = tracing::info_span!(target: "flotilla::engine", "optimizer_step").entered();
        *self.written_bytes.get_mut() = UNKNOWN;
        let step = Step {
            device: &self.device,
            autodiff: &self.autodiff,
            ranges,
            grads,
            lr,
        };
        let Some(offload) = self.offload.as_mut() else {
            if self.keeps_undo {
                self.before = Some(self.optimizer.clone());
            }
            // A chunk of pieces at a time: their values and gradients go into burn's tensors
            // for the step, so stepping the shard at once would hold two more copies of it.
            let lens: Vec<usize> = ranges.iter().map(Range::len).collect();
            for chunk in offload::chunks(&lens, self.step_chunk) {
                step.pieces(&mut self.optimizer, chunk, values)?;
            }
            return Ok(());
        };
        if self.keeps_undo {
            return Err(EngineError::Optimizer(
                "an offloaded optimizer state cannot keep the state before its step".into(),
            ));
        }
        for c in 0..offload.chunks().len() {
            let mut optimizer = offload.take(c)?;
            step.pieces(&mut optimizer, offload.chunks()[c].clone(), values)?;
            offload.put(c, &optimizer)?;
        }
        Ok(())
    }

    /// The shard's optimizer state as bytes (burn's burnpack format, keyed by piece).
    pub fn state(&self) -> Result<Vec<u8>> {
        match &self.offload {
            None => module_state(&self.optimizer),
            Some(offload) => {
                let bytes = offload.writer()?.into_bytes();
                let bytes = bytes.map_err(|e| EngineError::Optimizer(format!("{e:?}")))?;
                Ok(bytes.to_vec())
            }
        }
    }

    /// Bytes of tensor values the shard's optimizer state holds ([`optimizer_state_bytes`] of
    /// [`ShardOptimizer::state`]): read from the header of the file
    /// [`ShardOptimizer::save_state`] wrote when the state has not changed since (a figure
    /// read at the end of a run, after its checkpoint, whose cost is part of the run's peak
    /// memory); otherwise counted from the tensors' lengths in burn's serialized state.
    pub fn state_bytes(&self) -> Result<u64> {
        let written = self.written_bytes.load(Ordering::Relaxed);
        if written != UNKNOWN {
            return Ok(written);
        }
        if let Some(offload) = &self.offload {
            return offload.held_bytes();
        }
        let bytes = self
            .optimizer
            .into_bytes()
            .map_err(|e| EngineError::Optimizer(format!("saving state: {e:?}")))?;
        held_bytes(Reader::from_bytes(bytes))
    }

    /// Writes the shard's optimizer state to the file `path` (the bytes of
    /// [`ShardOptimizer::state`]), tensor by tensor from burn's record: the state is held
    /// twice while it is written (the optimizer's and the record's), not three times (those
    /// and the serialized bytes). burn writes beside `path` and renames the file into place.
    /// An offloaded state is written from its files, one tensor at a time.
    pub fn save_state(&self, path: &std::path::Path) -> Result<()> {
        let saved = match &self.offload {
            None => self.optimizer.save(path).map_err(|e| format!("{e:?}")),
            Some(offload) => offload
                .writer()?
                .write_to_file(path)
                .map_err(|e| format!("{e:?}")),
        };
        saved.map_err(|e| {
            EngineError::Optimizer(format!("saving state to {}: {e}", path.display()))
        })?;
        let held = held_bytes(Reader::from_file_exact(path))?;
        self.written_bytes.store(held, Ordering::Relaxed);
        Ok(())
    }

    /// Restores state written by [`ShardOptimizer::state`] of the same shard. State whose
    /// tensors do not fit this shard's pieces (another model, another shard cut) is refused
    /// with [`EngineError::StateShape`] before burn sees it.
    pub fn load_state(&mut self, bytes: Vec<u8>) -> Result<()> {
        let expected: Vec<Expected> = self
            .pieces
            .iter()
            .enumerate()
            .map(|(k, p)| Expected {
                name: format!(
                    "piece {k} of the shard (flat values {}..{}, of parameter {})",
                    p.range.start, p.range.end, p.param
                ),
                shape: vec![p.range.len()],
            })
            .collect();
        // Shared, so that the check and the load read it without copying it.
        let bytes = burn::tensor::Bytes::from_bytes_vec(bytes).shared();
        check_state_shapes(&bytes, &expected)?;
        self.before = None;
        *self.written_bytes.get_mut() = UNKNOWN;
        if let Some(offload) = self.offload.as_mut() {
            return offload.load(bytes);
        }
        self.optimizer = self
            .optimizer
            .clone()
            .from_bytes(bytes)
            .map_err(|e| EngineError::Optimizer(format!("loading state: {e:?}")))?;
        Ok(())
    }
}

/// What one step of the shard takes, for any optimizer over some of its pieces.
struct Step<'a> {
    /// The device of the gradients.
    device: &'a Device,
    /// The device of the pieces.
    autodiff: &'a Device,
    /// Piece `k`'s values are `values[ranges[k]]`.
    ranges: &'a [Range<usize>],
    /// The pieces' gradients, one after the other.
    grads: &'a [f32],
    lr: f64,
}

impl Step<'_> {
    /// Steps pieces `ks` with `optimizer`, writing their new values back into `values`.
    fn pieces(
        &self,
        optimizer: &mut ModuleOptimizer,
        ks: Range<usize>,
        values: &mut [f32],
    ) -> Result<()> {
        let mut at: usize = self.ranges[..ks.start].iter().map(|r| r.len()).sum();
        let ranges = &self.ranges[ks.clone()];
        let count: usize = ranges.iter().map(|r| r.len()).sum();
        let mut gp = GradientsParams::new();
        let mut module: Vec<Param<Tensor<1>>> = Vec::with_capacity(ranges.len());
        let upload = copies::to_device("shard", 2 * count);
        for (k, range) in ks.zip(ranges) {
            let id = ParamId::from(k as u64);
            let tensor = |v: &[f32], device: &Device| {
                Tensor::<1>::from_data(TensorData::new(v.to_vec(), [v.len()]), device)
            };
            let len = range.len();
            gp.register(id, tensor(&self.grads[at..at + len], self.device));
            at += len;
            let value = tensor(&values[range.clone()], self.autodiff);
            module.push(Param::initialized(id, value));
        }
        drop(upload);
        let module = optimizer.step(self.lr, module, gp);
        let _read = copies::to_host("shard", count);
        for (range, param) in ranges.iter().zip(module) {
            copy_tensor(param.val(), &mut values[range.clone()])?;
        }
        Ok(())
    }
}

/// `optimizer`'s state as bytes (burn's burnpack format).
fn module_state(optimizer: &ModuleOptimizer) -> Result<Vec<u8>> {
    let bytes = optimizer
        .into_bytes()
        .map_err(|e| EngineError::Optimizer(format!("saving state: {e:?}")))?;
    Ok(bytes.to_vec())
}

/// The most bytes an optimizer state of a model of `layout` takes in burn's burnpack format
/// (what [`crate::ModelState::optimizer_state`] writes): per parameter tensor, up to four
/// state tensors of its `f32` values (Adam keeps two moments), each with its 256-byte
/// alignment and metadata, plus the file's own. A receiver bounds a broadcast state by it,
/// so that a peer's word cannot make it allocate more.
pub fn optimizer_state_bound(layout: &crate::ParamLayout) -> usize {
    const STATES_PER_PARAM: usize = 4;
    const PER_TENSOR: usize = 1024;
    const FILE: usize = 1 << 20;
    layout.params.iter().fold(FILE, |total, p| {
        total.saturating_add(STATES_PER_PARAM.saturating_mul(p.len.saturating_mul(4) + PER_TENSOR))
    })
}

/// Bytes of tensor values held in an optimizer state written by
/// [`crate::ModelState::optimizer_state`] or [`ShardOptimizer::state`] (momenta, moments;
/// not the format's headers): what the optimizer keeps in memory.
pub fn optimizer_state_bytes(state: &[u8]) -> Result<u64> {
    held_bytes(Reader::from_bytes(burn::tensor::Bytes::from_bytes_vec(
        state.to_vec(),
    )))
}

/// The bytes of the tensors `reader` holds, from their lengths (burn-pack's tensors are
/// windows into the reader's buffer or file: nothing is copied or read).
fn held_bytes(reader: std::result::Result<Reader, burn::store::burn_pack::Error>) -> Result<u64> {
    let tensors = reader
        .and_then(Reader::into_tensors)
        .map_err(|e| EngineError::Optimizer(format!("reading state: {e:?}")))?;
    Ok(tensors.iter().map(|t| t.byte_len() as u64).sum())
}
