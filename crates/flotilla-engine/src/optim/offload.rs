//! [`Offload`]: a [`crate::ShardOptimizer`]'s state kept in files instead of memory, for a
//! shard whose optimizer state does not fit beside the rest of a rank (DeepSpeed's
//! `offload_optimizer: {device: nvme}`, ZeRO-Infinity).
//!
//! The shard's pieces are cut into *chunks* of about [`OFFLOAD_CHUNK_VALUES`] parameter values; each
//! chunk's state is one burnpack file (burn's own record of a [`ModuleOptimizer`] over the
//! chunk's pieces, keyed by the pieces' ids in the whole shard, so the chunks' records
//! together are the resident optimizer's record). A step streams through the chunks: one
//! chunk's state read, stepped by a fresh optimizer of the same settings, written back, and
//! dropped before the next is read, so the process holds one chunk's state at a time, not
//! the shard's. Every update of burn's optimizers is element-wise, so a chunked step is bit
//! for bit the resident one.
//!
//! The files are read and written whole with plain file I/O, not memory-mapped: burn's
//! record is rebuilt into tensors on every load, so a map would not spare that copy; what the
//! disk has not yet taken sits in the kernel's page cache, which the kernel may reclaim and
//! this process's resident memory does not count. They are not synced to disk: they are
//! scratch, rewritten every step (a checkpoint holds the state that survives a crash). The
//! directory is this rank's own (a new one under the configured one, readable by its user
//! only) and is removed when the optimizer is dropped; one that a killed rank left is removed
//! by the next rank that offloads under the same directory on its host ([`offload_dirs`]).

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use burn::module::ParamId;
use burn::optim::ModuleOptimizer;
use burn::store::burn_pack::{self, Bytes, Reader, Scalar, Writer};

use crate::error::{EngineError, Result};
use crate::optim::{OptimizerSpec, offload_dirs};

/// Parameter values a chunk holds at most, unless one piece alone has more: with Adam's two
/// moments a chunk's state is 16 MiB.
pub const OFFLOAD_CHUNK_VALUES: usize = 1 << 21;

/// A shard's optimizer state in files, one per chunk of its pieces.
pub(crate) struct Offload {
    /// This rank's directory (removed on drop).
    dir: tempfile::TempDir,
    /// Each chunk's pieces (indices into the shard's pieces, consecutive).
    chunks: Vec<Range<usize>>,
    /// Whether each chunk's file holds state (burn has none before a piece's first step).
    stored: Vec<bool>,
    spec: OptimizerSpec,
    /// The ids of the pieces of two or more dimensions' tensors (the decay group).
    matrices: Vec<ParamId>,
}

fn bad(message: String) -> EngineError {
    EngineError::Optimizer(format!("offloaded state: {message}"))
}

/// Consecutive pieces (of `lens` values each) cut into chunks of about `chunk_values`.
pub(crate) fn chunks(lens: &[usize], chunk_values: usize) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut held) = (0, 0);
    for (k, len) in lens.iter().enumerate() {
        if held > 0 && held + len > chunk_values {
            out.push(start..k);
            (start, held) = (k, 0);
        }
        held += len;
    }
    if start < lens.len() {
        out.push(start..lens.len());
    }
    out
}

impl Offload {
    /// The state of pieces of `lens` values in a new directory under `base`, in chunks of
    /// about `chunk_values`; empty (as a new optimizer's).
    pub(crate) fn new(
        base: &Path,
        spec: &OptimizerSpec,
        matrices: Vec<ParamId>,
        lens: &[usize],
        chunk_values: usize,
    ) -> Result<Self> {
        std::fs::create_dir_all(base).map_err(|e| EngineError::io(base, e))?;
        offload_dirs::sweep(base);
        let dir = tempfile::Builder::new()
            .prefix(&offload_dirs::prefix())
            .tempdir_in(base)
            .map_err(|e| EngineError::io(base, e))?;
        let chunks = chunks(lens, chunk_values.max(1));
        Ok(Self {
            dir,
            stored: vec![false; chunks.len()],
            chunks,
            spec: spec.clone(),
            matrices,
        })
    }

    /// The directory the chunks' files are in.
    pub(crate) fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Each chunk's pieces.
    pub(crate) fn chunks(&self) -> &[Range<usize>] {
        &self.chunks
    }

    fn path(&self, c: usize) -> PathBuf {
        self.dir.path().join(format!("chunk-{c:05}.bpk"))
    }

    /// Chunk `c`'s optimizer, its state read from its file (none before its first step).
    pub(crate) fn take(&self, c: usize) -> Result<ModuleOptimizer> {
        let optimizer = self.spec.build_with_matrices(self.matrices.clone())?;
        if !self.stored[c] {
            return Ok(optimizer);
        }
        let path = self.path(c);
        let bytes = std::fs::read(&path).map_err(|e| EngineError::io(&path, e))?;
        optimizer
            .from_bytes(Bytes::from_bytes_vec(bytes))
            .map_err(|e| bad(format!("reading {}: {e:?}", path.display())))
    }

    /// Writes chunk `c`'s state back from its optimizer.
    pub(crate) fn put(&mut self, c: usize, optimizer: &ModuleOptimizer) -> Result<()> {
        let bytes = optimizer
            .into_bytes()
            .map_err(|e| bad(format!("saving chunk {c}: {e:?}")))?;
        let path = self.path(c);
        std::fs::write(&path, &bytes[..]).map_err(|e| EngineError::io(&path, e))?;
        self.stored[c] = true;
        Ok(())
    }

    /// The readers of the chunks that hold state, file-backed (a tensor's bytes are read
    /// only when taken).
    fn readers(&self) -> Result<Vec<Reader>> {
        (0..self.chunks.len())
            .filter(|&c| self.stored[c])
            .map(|c| {
                let path = self.path(c);
                Reader::from_file_exact(&path)
                    .map_err(|e| bad(format!("reading {}: {e:?}", path.display())))
            })
            .collect()
    }

    /// The whole shard's state as one burnpack writer (what the resident optimizer's record
    /// would write), its tensors read from the files as the writer reaches them.
    pub(crate) fn writer(&self) -> Result<Writer> {
        let mut tensors = Vec::new();
        let mut scalars = BTreeMap::new();
        let mut metadata = BTreeMap::new();
        for reader in self.readers()? {
            scalars.extend(reader.scalars().clone());
            metadata.extend(reader.metadata().clone());
            tensors.extend(reader.into_tensors().map_err(|e| bad(format!("{e:?}")))?);
        }
        let mut writer = Writer::new(tensors);
        for (key, value) in &scalars {
            writer = writer.with_scalar(key, *value);
        }
        for (key, value) in &metadata {
            writer = writer.with_metadata(key, value);
        }
        Ok(writer)
    }

    /// Bytes of tensor values in the files (what a resident optimizer would hold).
    pub(crate) fn held_bytes(&self) -> Result<u64> {
        let mut total = 0;
        for reader in self.readers()? {
            let tensors = reader.into_tensors().map_err(|e| bad(format!("{e:?}")))?;
            total += tensors.iter().map(|t| t.byte_len() as u64).sum::<u64>();
        }
        Ok(total)
    }

    /// Replaces the files by the whole shard's state `bytes` (burn's record, keyed by piece
    /// id, already checked against the pieces' shapes), cut into the chunks.
    pub(crate) fn load(&mut self, bytes: Bytes) -> Result<()> {
        let reader = Reader::from_bytes(bytes).map_err(|e| bad(format!("{e:?}")))?;
        let chunk_of = |key: &str| -> Result<usize> {
            key.split('.')
                .next()
                .and_then(|id| id.parse::<usize>().ok())
                .and_then(|id| self.chunks.iter().position(|c| c.contains(&id)))
                .ok_or_else(|| bad(format!("{key} names no piece of the shard")))
        };
        let n = self.chunks.len();
        let mut scalars: Vec<Vec<(String, Scalar)>> = vec![Vec::new(); n];
        for (key, value) in reader.scalars() {
            scalars[chunk_of(key)?].push((key.clone(), *value));
        }
        let mut metadata: Vec<Vec<(String, String)>> = vec![Vec::new(); n];
        for (key, value) in reader.metadata() {
            metadata[chunk_of(key)?].push((key.clone(), value.clone()));
        }
        let mut tensors: Vec<Vec<burn_pack::Tensor>> = vec![Vec::new(); n];
        for tensor in reader.into_tensors().map_err(|e| bad(format!("{e:?}")))? {
            tensors[chunk_of(&tensor.name)?].push(tensor);
        }
        let parts = tensors.into_iter().zip(scalars).zip(metadata);
        for (c, ((tensors, scalars), metadata)) in parts.enumerate() {
            let path = self.path(c);
            self.stored[c] = !(tensors.is_empty() && scalars.is_empty());
            if !self.stored[c] {
                std::fs::remove_file(&path).ok();
                continue;
            }
            let mut writer = Writer::new(tensors);
            for (key, value) in &scalars {
                writer = writer.with_scalar(key, *value);
            }
            for (key, value) in &metadata {
                writer = writer.with_metadata(key, value);
            }
            let bytes = writer.into_bytes().map_err(|e| bad(format!("{e:?}")))?;
            std::fs::write(&path, &bytes[..]).map_err(|e| EngineError::io(&path, e))?;
        }
        Ok(())
    }
}
