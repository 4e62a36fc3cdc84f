//! A ZeRO checkpoint's optimizer shards on their way into rank 0's checkpoint directory,
//! never whole in memory, and written by every rank at once where they can.
//!
//! Rank 0 offers the checkpoint in progress to every other rank (`crate::checkpoint_offer`).
//! A rank that sees it writes its shard's state there itself
//! ([`ShardOptimizer::save_state`]: burn's record, tensor by tensor), while rank 0 and the
//! others write theirs; then it says so. A rank that does not see it writes its shard to a
//! scratch file under its own output directory, and rank 0 asks each such rank for its
//! file in turn and takes it over the wire piece by piece into the checkpoint
//! ([`collect`]). Serialized into one buffer
//! (`ShardOptimizer::state`) a shard's state was held three times at once while a
//! checkpoint was written, over a ZeRO-3 rank's whole need between steps on a 57 M-parameter
//! GPT (BENCHMARKS.md §35).

use std::path::{Path, PathBuf};

use flotilla_engine::ShardOptimizer;
use flotilla_tcp::{ProcessGroup, Tag, tags};

use crate::checkpoint;
use crate::checkpoint_offer::{self, Offer, ScratchShard};
use crate::error::{Result, TrainError};

/// Tag of the optimizer-state shards sent to and from rank 0.
pub(super) const SHARD_TAG: Tag = tags::RESERVED + 0x102;

/// Writes rank 0's own shard into the offered checkpoint, waits for every other rank's
/// answer, and takes the shards of the ranks that do not share the directory over the
/// wire, one after the other.
pub(super) fn collect(
    offer: Offer,
    comm: &dyn ProcessGroup,
    optimizer: &ShardOptimizer,
) -> Result<()> {
    let own = offer.tmp.join(checkpoint::zero_file(0));
    optimizer.save_state(&own)?;
    checkpoint::sync_part(&own)?;
    let over_wire = offer.answers(comm, checkpoint::zero_file)?;
    let tmp = offer.close()?;
    for r in over_wire {
        receive_shard(comm, r, &tmp)?;
    }
    Ok(())
}

/// A rank's part of a checkpoint (not rank 0's): waits for rank 0's offer and writes its
/// shard's state into the offered directory when it sees it there, else to a scratch file
/// under `output` (the job's output directory on this rank's host, not a temporary
/// directory that may live in memory), sent to rank 0 when it asks.
pub(super) fn send_shard(
    comm: &dyn ProcessGroup,
    optimizer: &ShardOptimizer,
    output: &Path,
) -> Result<()> {
    let dir = checkpoint_offer::receive_dir(comm)?;
    send_shard_to(comm, optimizer, output, (dir, Ok(())))
}

/// [`send_shard`] once the offer is known: `dir` the offered directory when this rank sees
/// it, `before` what this rank's earlier part of the checkpoint met (its part of the
/// weights file), reported to rank 0 with its shard's.
pub(super) fn send_shard_to(
    comm: &dyn ProcessGroup,
    optimizer: &ShardOptimizer,
    output: &Path,
    (dir, before): (Option<PathBuf>, Result<()>),
) -> Result<()> {
    if let Some(dir) = dir {
        let path = dir.join(checkpoint::zero_file(comm.rank()));
        let wrote = before.and_then(|()| {
            optimizer
                .save_state(&path)
                .map_err(TrainError::from)
                .and_then(|()| checkpoint::sync_part(&path))
        });
        return checkpoint_offer::answer(comm, wrote);
    }
    checkpoint_offer::answer_not_shared(comm)?;
    let scratch = ScratchShard::write(optimizer, output)?;
    checkpoint_offer::wait_ask(comm)?;
    scratch.send(comm, SHARD_TAG)
}

/// Asks rank `r` for its shard and writes it into the checkpoint in progress `tmp` piece by
/// piece as it arrives.
fn receive_shard(comm: &dyn ProcessGroup, r: usize, tmp: &Path) -> Result<()> {
    Offer::ask(comm, r)?;
    checkpoint_offer::receive_file(comm, (r, SHARD_TAG), &tmp.join(checkpoint::zero_file(r)))
}

#[cfg(test)]
#[path = "shard_files_tests.rs"]
mod tests;
