//! A ZeRO checkpoint's optimizer shards on their way into rank 0's checkpoint directory,
//! never whole in memory, and written by every rank at once where they can.
//!
//! Rank 0 makes the checkpoint in progress (a temporary directory, renamed into place once
//! whole: `checkpoint::save_with`) and offers it to every other rank ([`offer`]): its path
//! and the name of a marker file of a random name inside it. A rank that sees the marker
//! at that path shares the directory (the ranks of one host; hosts that mount the same
//! output directory, as PyTorch's distributed checkpoint takes for granted) and writes its
//! shard's state there itself ([`ShardOptimizer::save_state`]: burn's record, tensor by
//! tensor), while rank 0 and the others write theirs; then it says so. A rank that does
//! not see it writes its shard to a scratch file under its own output directory, and rank
//! 0 asks each such rank for its file in turn and takes it over the wire piece by piece
//! into the checkpoint ([`Offer::collect`]). Serialized into one buffer
//! (`ShardOptimizer::state`) a shard's state was held three times at once while a
//! checkpoint was written, over a ZeRO-3 rank's whole need between steps on a 57 M-parameter
//! GPT (BENCHMARKS.md §35).

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use flotilla_engine::ShardOptimizer;
use flotilla_tcp::{CommError, ProcessGroup, Tag, tags};

use crate::checkpoint;
use crate::error::{Result, TrainError};

/// Tag of the optimizer-state shards sent to and from rank 0.
pub(super) const SHARD_TAG: Tag = tags::RESERVED + 0x102;

/// Tag of rank 0's offer of its checkpoint in progress, and of its request for a rank's
/// shard over the wire (an empty offer).
const ASK_TAG: Tag = tags::RESERVED + 0x104;

/// Tag of a rank's answer to the offer ([`WROTE`], [`NOT_SHARED`] or [`FAILED`]).
const ANSWER_TAG: Tag = tags::RESERVED + 0x105;

/// Tag of a rank's first answer to an offer whose weights file the ranks write together
/// ([`SEES`] or [`NOT_SHARED`]), before the parameters are gathered.
const SEES_TAG: Tag = tags::RESERVED + 0x106;

/// Tag of rank 0's list of the ranks that write their part of the weights file.
const WRITERS_TAG: Tag = tags::RESERVED + 0x107;

/// The first answer of a rank that sees the offered directory.
const SEES: u8 = 4;

/// The answer of a rank that wrote its shard into the offered directory.
const WROTE: u8 = 1;
/// The answer of a rank that does not see the offered directory: its shard goes over the wire.
const NOT_SHARED: u8 = 2;
/// The answer of a rank whose write into the offered directory failed (its error follows).
const FAILED: u8 = 3;

/// Rank 0's offer of the checkpoint in progress to the other ranks: its marker file lives
/// as long as the offer (removed before the checkpoint's checksums are taken).
pub(super) struct Offer {
    marker: tempfile::NamedTempFile,
    tmp: PathBuf,
}

/// Offers the checkpoint in progress `tmp` to every other rank (see the module docs).
pub(super) fn offer(comm: &dyn ProcessGroup, tmp: &Path) -> Result<Offer> {
    let marker = tempfile::Builder::new()
        .prefix(".shared-")
        .tempfile_in(tmp)
        .map_err(|e| TrainError::io(tmp, e))?;
    let name = marker.path().file_name().and_then(|n| n.to_str());
    // A path that is not UTF-8 is not offered: every rank's shard goes over the wire.
    let offered = match (tmp.to_str(), name) {
        (Some(dir), Some(name)) => format!("{dir}\n{name}").into_bytes(),
        _ => Vec::new(),
    };
    for r in 1..comm.size() {
        comm.send(r, ASK_TAG, &offered)?;
    }
    Ok(Offer {
        marker,
        tmp: tmp.to_path_buf(),
    })
}

impl Offer {
    /// Rank 0's side of a checkpoint whose weights file every rank that sees the directory
    /// writes a part of: each other rank's first answer ([`Offered::receive`]); every rank
    /// then learns the writers, rank 0 and the ranks that see it, which this returns.
    pub(super) fn writers(&self, comm: &dyn ProcessGroup) -> Result<Vec<usize>> {
        let mut writers = vec![0];
        for r in 1..comm.size() {
            let answer = comm.recv(r, SEES_TAG, Instant::now() + comm.timeout())?;
            if answer == [SEES] {
                writers.push(r);
            }
        }
        let list: Vec<u8> = writers
            .iter()
            .flat_map(|&r| (r as u32).to_le_bytes())
            .collect();
        for r in 1..comm.size() {
            comm.send(r, WRITERS_TAG, &list)?;
        }
        Ok(writers)
    }

    /// Writes rank 0's own shard, waits for every other rank's answer, and takes the shards
    /// of the ranks that do not share the directory over the wire, one after the other.
    pub(super) fn collect(self, comm: &dyn ProcessGroup, optimizer: &ShardOptimizer) -> Result<()> {
        let own = self.tmp.join(checkpoint::zero_file(0));
        optimizer.save_state(&own)?;
        checkpoint::sync_part(&own)?;
        let mut over_wire = Vec::new();
        for r in 1..comm.size() {
            let answer = comm.recv(r, ANSWER_TAG, Instant::now() + comm.timeout())?;
            match answer.split_first() {
                Some((&WROTE, _)) => {}
                Some((&NOT_SHARED, _)) => over_wire.push(r),
                Some((_, why)) => {
                    let path = self.tmp.join(checkpoint::zero_file(r));
                    return Err(TrainError::Checkpoint {
                        path,
                        message: format!("rank {r}: {}", String::from_utf8_lossy(why)),
                    });
                }
                None => {
                    let detail = "an empty answer to the checkpoint's offer".to_string();
                    return Err(CommError::Protocol { peer: r, detail }.into());
                }
            }
        }
        self.marker
            .close()
            .map_err(|e| TrainError::io(&self.tmp, e))?;
        for r in over_wire {
            receive_shard(comm, r, &self.tmp)?;
        }
        Ok(())
    }
}

/// A rank's view of rank 0's offer (not rank 0's): the offered directory when this rank
/// sees it, and the ranks that write their part of the weights file.
pub(super) struct Offered {
    /// The checkpoint in progress, when this rank sees it.
    pub(super) dir: Option<PathBuf>,
    /// The ranks writing their part of the weights file (rank 0 and those that see it).
    pub(super) writers: Vec<usize>,
}

impl Offered {
    /// Waits for rank 0's offer of a checkpoint whose weights file the ranks write together,
    /// says whether this rank sees it, and learns the writers ([`Offer::writers`]).
    pub(super) fn receive(comm: &dyn ProcessGroup) -> Result<Self> {
        let offered = comm.recv(0, ASK_TAG, Instant::now() + comm.timeout())?;
        let dir = shared_dir(&offered);
        comm.send(
            0,
            SEES_TAG,
            &[if dir.is_some() { SEES } else { NOT_SHARED }],
        )?;
        let list = comm.recv(0, WRITERS_TAG, Instant::now() + comm.timeout())?;
        let writers = list
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
            .collect();
        Ok(Self { dir, writers })
    }
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
    let offered = comm.recv(0, ASK_TAG, Instant::now() + comm.timeout())?;
    send_shard_to(comm, optimizer, output, (shared_dir(&offered), Ok(())))
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
        let answer = match &wrote {
            Ok(()) => vec![WROTE],
            Err(e) => [&[FAILED][..], e.to_string().as_bytes()].concat(),
        };
        comm.send(0, ANSWER_TAG, &answer)?;
        return wrote;
    }
    comm.send(0, ANSWER_TAG, &[NOT_SHARED])?;
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

/// The directory of rank 0's offer when its marker is there for this rank to see.
fn shared_dir(offered: &[u8]) -> Option<PathBuf> {
    let text = std::str::from_utf8(offered).ok()?;
    let (dir, marker) = text.split_once('\n')?;
    let dir = PathBuf::from(dir);
    dir.join(marker).is_file().then_some(dir)
}

/// Asks rank `r` for its shard and writes it into the checkpoint in progress `tmp` piece by
/// piece as it arrives.
fn receive_shard(comm: &dyn ProcessGroup, r: usize, tmp: &Path) -> Result<()> {
    let path = tmp.join(checkpoint::zero_file(r));
    let mut file = File::create(&path).map_err(|e| TrainError::io(&path, e))?;
    comm.send(r, ASK_TAG, &[])?;
    let deadline = Instant::now() + comm.timeout();
    comm.recv_large_with(r, SHARD_TAG, deadline, &mut |piece| {
        file.write_all(piece)
            .map_err(|e| CommError::io(format!("writing {}", path.display()), e))
    })?;
    file.sync_all().map_err(|e| TrainError::io(&path, e))
}

#[cfg(test)]
#[path = "shard_files_tests.rs"]
mod tests;
