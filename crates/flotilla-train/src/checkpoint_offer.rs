//! Rank 0's offer of a checkpoint in progress to the ranks that hold parts of it, so that
//! every rank that sees the directory writes its part there itself, at once, and only the
//! others send theirs over the wire.
//!
//! Rank 0 makes the checkpoint in progress (a temporary directory, renamed into place once
//! whole: `checkpoint::save_with`) and offers it to its peers ([`offer_to`]): its path and
//! the name of a marker file of a random name inside it. A rank that sees the marker at
//! that path shares the directory (the ranks of one host; hosts that mount the same output
//! directory, as PyTorch's distributed checkpoint takes for granted) and writes its part
//! there, then answers [`answer`]; one that does not answers [`answer_not_shared`] and
//! sends its part when rank 0 asks ([`Offer::ask`], [`wait_ask`]). Used by a ZeRO run's
//! optimizer shards and weights file (`strategy/allreduce/zero/shard_files.rs`) and by a
//! pipeline's stages (`strategy/pipeline/state.rs`).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use flotilla_engine::ShardOptimizer;

use flotilla_tcp::{CommError, ProcessGroup, Tag, tags};

use crate::checkpoint::CHECKSUMS;
use crate::error::{Result, TrainError};

/// Tag of rank 0's offer of its checkpoint in progress, and of its request for a rank's
/// part over the wire (an empty offer).
pub(crate) const ASK_TAG: Tag = tags::RESERVED + 0x104;

/// Tag of a rank's answer to the offer ([`WROTE`], [`NOT_SHARED`] or [`FAILED`]).
const ANSWER_TAG: Tag = tags::RESERVED + 0x105;

/// Tag of a rank's first answer to an offer whose files the ranks write together
/// ([`SEES`] or [`NOT_SHARED`]), before they write.
const SEES_TAG: Tag = tags::RESERVED + 0x106;

/// Tag of rank 0's list of the ranks that write their parts into the directory.
const WRITERS_TAG: Tag = tags::RESERVED + 0x107;

/// The first answer of a rank that sees the offered directory.
const SEES: u8 = 4;
/// The answer of a rank that wrote its part into the offered directory.
const WROTE: u8 = 1;
/// The answer of a rank that does not see the offered directory: its part goes over the wire.
const NOT_SHARED: u8 = 2;
/// The answer of a rank whose write into the offered directory failed (its error follows).
const FAILED: u8 = 3;

#[cfg(test)]
thread_local! {
    /// Tests only: this thread's rank sees no offered directory, as on another host.
    pub(crate) static BLIND: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Rank 0's offer of the checkpoint in progress to its peers: its marker file lives as long
/// as the offer (removed before the checkpoint's checksums are taken, [`Offer::close`]).
pub(crate) struct Offer {
    pub(crate) marker: tempfile::NamedTempFile,
    pub(crate) tmp: PathBuf,
    /// The ranks offered to.
    pub(crate) peers: Vec<usize>,
}

/// Offers the checkpoint in progress `tmp` to every other rank.
pub(crate) fn offer(comm: &dyn ProcessGroup, tmp: &Path) -> Result<Offer> {
    offer_to(comm, tmp, (1..comm.size()).collect())
}

/// Offers the checkpoint in progress `tmp` to `peers` (see the module docs).
pub(crate) fn offer_to(comm: &dyn ProcessGroup, tmp: &Path, peers: Vec<usize>) -> Result<Offer> {
    let marker = tempfile::Builder::new()
        .prefix(".shared-")
        .tempfile_in(tmp)
        .map_err(|e| TrainError::io(tmp, e))?;
    let name = marker.path().file_name().and_then(|n| n.to_str());
    // A path that is not UTF-8 is not offered: every part goes over the wire.
    let offered = match (tmp.to_str(), name) {
        (Some(dir), Some(name)) => format!("{dir}\n{name}").into_bytes(),
        _ => Vec::new(),
    };
    for &r in &peers {
        comm.send(r, ASK_TAG, &offered)?;
    }
    Ok(Offer {
        marker,
        tmp: tmp.to_path_buf(),
        peers,
    })
}

impl Offer {
    /// Each peer's first answer ([`Offered::receive`]); every peer then learns the writers,
    /// rank 0 and the peers that see the directory, which this returns.
    pub(crate) fn writers(&self, comm: &dyn ProcessGroup) -> Result<Vec<usize>> {
        let mut writers = vec![0];
        for &r in &self.peers {
            let answer = comm.recv(r, SEES_TAG, Instant::now() + comm.timeout())?;
            if answer == [SEES] {
                writers.push(r);
            }
        }
        let list: Vec<u8> = writers
            .iter()
            .flat_map(|&r| (r as u32).to_le_bytes())
            .collect();
        for &r in &self.peers {
            comm.send(r, WRITERS_TAG, &list)?;
        }
        Ok(writers)
    }

    /// Waits for every peer's answer ([`answer`], [`answer_not_shared`]) and returns the
    /// peers whose part comes over the wire; a peer's failed write is this checkpoint's
    /// error, `part(r)` naming the file it was writing.
    pub(crate) fn answers(
        &self,
        comm: &dyn ProcessGroup,
        part: impl Fn(usize) -> String,
    ) -> Result<Vec<usize>> {
        let mut over_wire = Vec::new();
        for &r in &self.peers {
            let answer = comm.recv(r, ANSWER_TAG, Instant::now() + comm.timeout())?;
            match answer.split_first() {
                Some((&WROTE, _)) => {}
                Some((&NOT_SHARED, _)) => over_wire.push(r),
                Some((_, why)) => {
                    return Err(TrainError::Checkpoint {
                        path: self.tmp.join(part(r)),
                        message: format!("rank {r}: {}", String::from_utf8_lossy(why)),
                    });
                }
                None => {
                    let detail = "an empty answer to the checkpoint's offer".to_string();
                    return Err(CommError::Protocol { peer: r, detail }.into());
                }
            }
        }
        Ok(over_wire)
    }

    /// Asks peer `r` (one that does not share the directory) for its part.
    pub(crate) fn ask(comm: &dyn ProcessGroup, r: usize) -> Result<()> {
        comm.send(r, ASK_TAG, &[])?;
        Ok(())
    }

    /// Ends the offer: its marker removed, the checkpoint in progress returned.
    pub(crate) fn close(self) -> Result<PathBuf> {
        self.marker
            .close()
            .map_err(|e| TrainError::io(&self.tmp, e))?;
        Ok(self.tmp)
    }
}

/// A peer's view of rank 0's offer: the offered directory when this rank sees it, and the
/// ranks that write their parts there.
pub(crate) struct Offered {
    /// The checkpoint in progress, when this rank sees it.
    pub(crate) dir: Option<PathBuf>,
    /// The ranks writing their parts into the directory (rank 0 and those that see it).
    pub(crate) writers: Vec<usize>,
}

impl Offered {
    /// Waits for rank 0's offer of a checkpoint whose files the ranks write together, says
    /// whether this rank sees it, and learns the writers ([`Offer::writers`]).
    pub(crate) fn receive(comm: &dyn ProcessGroup) -> Result<Self> {
        let dir = receive_dir(comm)?;
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

/// Waits for rank 0's offer: the offered directory when this rank sees it.
pub(crate) fn receive_dir(comm: &dyn ProcessGroup) -> Result<Option<PathBuf>> {
    let offered = comm.recv(0, ASK_TAG, Instant::now() + comm.timeout())?;
    Ok(shared_dir(&offered))
}

/// Tells rank 0 how this rank's write into the offered directory went (returned as given).
pub(crate) fn answer(comm: &dyn ProcessGroup, wrote: Result<()>) -> Result<()> {
    let answer = match &wrote {
        Ok(()) => vec![WROTE],
        Err(e) => [&[FAILED][..], e.to_string().as_bytes()].concat(),
    };
    comm.send(0, ANSWER_TAG, &answer)?;
    wrote
}

/// Tells rank 0 that this rank does not see the offered directory: its part comes over
/// the wire when asked ([`wait_ask`]).
pub(crate) fn answer_not_shared(comm: &dyn ProcessGroup) -> Result<()> {
    comm.send(0, ANSWER_TAG, &[NOT_SHARED])?;
    Ok(())
}

/// Waits for rank 0 to ask for this rank's part ([`Offer::ask`]).
pub(crate) fn wait_ask(comm: &dyn ProcessGroup) -> Result<()> {
    comm.recv(0, ASK_TAG, Instant::now() + comm.timeout())?;
    Ok(())
}

/// An optimizer's state (a shard's) in a scratch file under the job's output directory on
/// this rank's host (not a temporary directory that may live in memory), for a rank that
/// does not see the offered directory: sent to rank 0 from the file piece by piece, never
/// whole in memory ([`ScratchShard::send`], taken by [`receive_file`]).
pub(crate) struct ScratchShard {
    dir: tempfile::TempDir,
}

impl ScratchShard {
    /// Writes `optimizer`'s state to a scratch file under `output`.
    pub(crate) fn write(optimizer: &ShardOptimizer, output: &Path) -> Result<Self> {
        let dir = scratch_dir(output, ".optimizer-shard-")?;
        optimizer.save_state(&dir.path().join("shard.bpk"))?;
        Ok(Self { dir })
    }

    /// Sends the file to rank 0 under `tag` (once rank 0 asked for it: [`wait_ask`]) and
    /// removes it.
    pub(crate) fn send(self, comm: &dyn ProcessGroup, tag: Tag) -> Result<()> {
        send_file(comm, (0, tag), &self.dir.path().join("shard.bpk"))
    }
}

/// Sends the file `path` to rank `r` under `tag` as one large message read from the file
/// piece by piece, never whole in memory (taken by [`receive_file`] or as one message).
pub(crate) fn send_file(
    comm: &dyn ProcessGroup,
    (r, tag): (usize, Tag),
    path: &Path,
) -> Result<()> {
    let mut file = File::open(path).map_err(|e| TrainError::io(path, e))?;
    let len = file.metadata().map_err(|e| TrainError::io(path, e))?.len();
    comm.send_large_from(r, tag, &mut file, len)?;
    Ok(())
}

/// A scratch directory of this rank's under the job's output directory `output` on its host
/// (not a temporary directory that may live in memory), removed when dropped: where a file
/// too large to hold whole is spooled as it arrives ([`receive_file`]).
pub(crate) fn scratch_dir(output: &Path, prefix: &str) -> Result<tempfile::TempDir> {
    std::fs::create_dir_all(output).map_err(|e| TrainError::io(output, e))?;
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in(output)
        .map_err(|e| TrainError::io(output, e))
}

/// Takes rank `r`'s part under `tag` (sent by [`send_shard`] or as one large message) into
/// the file `path` of the checkpoint in progress, piece by piece as it arrives.
pub(crate) fn receive_file(
    comm: &dyn ProcessGroup,
    (r, tag): (usize, Tag),
    path: &Path,
) -> Result<()> {
    let mut file = File::create(path).map_err(|e| TrainError::io(path, e))?;
    let deadline = Instant::now() + comm.timeout();
    comm.recv_large_with(r, tag, deadline, &mut |piece| {
        file.write_all(piece)
            .map_err(|e| CommError::io(format!("writing {}", path.display()), e))
    })?;
    file.sync_all().map_err(|e| TrainError::io(path, e))
}

/// The directory of rank 0's offer when its marker is there for this rank to see.
fn shared_dir(offered: &[u8]) -> Option<PathBuf> {
    #[cfg(test)]
    if BLIND.with(std::cell::Cell::get) {
        return None;
    }
    let text = std::str::from_utf8(offered).ok()?;
    let (dir, marker) = text.split_once('\n')?;
    let dir = PathBuf::from(dir);
    dir.join(marker).is_file().then_some(dir)
}

/// Rank 0's offer of checkpoint `dir`: its path and the bytes of its `checksums.json`
/// (empty for a path that is not UTF-8, or a checkpoint from before checksums: everything
/// then goes over the wire).
pub(crate) fn offer_of(dir: &Path) -> Result<Vec<u8>> {
    let sums_path = dir.join(CHECKSUMS);
    let sums = match std::fs::read(&sums_path) {
        Ok(sums) => sums,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(TrainError::io(&sums_path, e)),
    };
    Ok(match dir.to_str() {
        Some(path) => [path.as_bytes(), b"\n", &sums].concat(),
        None => Vec::new(),
    })
}

/// The checkpoint rank 0 offered and its checksums, when this rank sees the same checkpoint
/// at that path (a `checksums.json` of the same bytes).
pub(crate) fn offered_dir(offer: &[u8]) -> Option<(PathBuf, BTreeMap<String, String>)> {
    #[cfg(test)]
    if BLIND.with(std::cell::Cell::get) {
        return None;
    }
    let split = offer.iter().position(|&b| b == b'\n')?;
    let dir = PathBuf::from(std::str::from_utf8(&offer[..split]).ok()?);
    let sums = &offer[split + 1..];
    if std::fs::read(dir.join(CHECKSUMS)).ok()? != sums {
        return None;
    }
    Some((dir, serde_json::from_slice(sums).ok()?))
}

/// Whether every file `names` of the offered checkpoint `dir` has the checksum `sums`
/// (its `checksums.json`) lists, each read streaming, never whole.
pub(crate) fn all_listed<'a>(
    dir: &Path,
    sums: &BTreeMap<String, String>,
    mut names: impl Iterator<Item = &'a String>,
) -> bool {
    names.all(|name| {
        let sum = crate::checkpoint::file_checksum(&dir.join(name)).ok();
        sum.is_some() && sums.get(name) == sum.as_ref()
    })
}
