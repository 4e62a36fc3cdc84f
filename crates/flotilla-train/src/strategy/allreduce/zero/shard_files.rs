//! A ZeRO checkpoint's optimizer shards on their way into rank 0's checkpoint directory,
//! never whole in memory: each rank writes its shard's state to a file of its own
//! ([`ShardOptimizer::save_state`]: burn's record, tensor by tensor), rank 0 asks each rank
//! for its file in turn, and the file crosses the wire piece by piece into the checkpoint.
//! Serialized into one buffer (`ShardOptimizer::state`) a shard's state was held three times
//! at once while a checkpoint was written, over a ZeRO-3 rank's whole need between steps on
//! a 57 M-parameter GPT (BENCHMARKS.md §35).

use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::time::Instant;

use flotilla_engine::ShardOptimizer;
use flotilla_tcp::{CommError, ProcessGroup, Tag, tags};

use crate::checkpoint;
use crate::error::{Result, TrainError};

/// Tag of the optimizer-state shards sent to and from rank 0.
pub(super) const SHARD_TAG: Tag = tags::RESERVED + 0x102;

/// Tag of rank 0's request for a rank's optimizer shard ([`receive_shards`]).
const ASK_TAG: Tag = tags::RESERVED + 0x104;

/// Writes `optimizer`'s state as rank 0's part of the checkpoint in progress `tmp`.
pub(super) fn write_own(optimizer: &ShardOptimizer, tmp: &Path) -> Result<()> {
    let path = tmp.join(checkpoint::zero_file(0));
    optimizer.save_state(&path)?;
    checkpoint::sync_part(&path)
}

/// A rank's part of a checkpoint (not rank 0's): its shard's state written to a scratch file
/// under `output` (the job's output directory on this rank's host, not a temporary
/// directory that may live in memory), sent to rank 0 when it asks ([`receive_shards`]).
pub(super) fn send_shard(
    comm: &dyn ProcessGroup,
    optimizer: &ShardOptimizer,
    output: &Path,
) -> Result<()> {
    std::fs::create_dir_all(output).map_err(|e| TrainError::io(output, e))?;
    let scratch = tempfile::Builder::new()
        .prefix(".optimizer-shard-")
        .tempdir_in(output)
        .map_err(|e| TrainError::io(output, e))?;
    let path = scratch.path().join("shard.bpk");
    optimizer.save_state(&path)?;
    let mut file = File::open(&path).map_err(|e| TrainError::io(&path, e))?;
    let len = file.metadata().map_err(|e| TrainError::io(&path, e))?.len();
    comm.recv(0, ASK_TAG, Instant::now() + comm.timeout())?;
    comm.send_large_from(0, SHARD_TAG, &mut file, len)?;
    Ok(())
}

/// Rank 0's part of [`send_shard`]: asks each rank for its shard in turn and writes it into
/// the checkpoint directory `tmp` piece by piece as it arrives.
pub(super) fn receive_shards(comm: &dyn ProcessGroup, tmp: &Path) -> Result<()> {
    for r in 1..comm.size() {
        let path = tmp.join(checkpoint::zero_file(r));
        let mut file = File::create(&path).map_err(|e| TrainError::io(&path, e))?;
        comm.send(r, ASK_TAG, &[])?;
        let deadline = Instant::now() + comm.timeout();
        comm.recv_large_with(r, SHARD_TAG, deadline, &mut |piece| {
            file.write_all(piece)
                .map_err(|e| CommError::io(format!("writing {}", path.display()), e))
        })?;
        file.sync_all().map_err(|e| TrainError::io(&path, e))?;
    }
    Ok(())
}
