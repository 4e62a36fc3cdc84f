//! The shared-memory transport: the `f32` all-reduce and broadcast of a group whose members
//! all share one host (equal host keys at the rendezvous, [`crate::host`]), and its
//! barrier, go through one shared segment instead of loopback TCP, when
//! [`crate::Transport`] is `auto` (the default) or `shm`. Everything else (byte and integer
//! collectives, all-gather, point-to-point messages) stays on the group's TCP (or
//! in-memory) links, which also carry the segment's setup and the failure notices.
//!
//! * **Segment** ([`crate::segment`]): one file per group, created by the group's rank 0 in its
//!   turn of the first collective that needs it (`flotilla-{session}-{group key}`, so two
//!   jobs or two groups never share one), in [`crate::CommConfig::shm_dir`] or `/dev/shm`
//!   when it has room (`statvfs`), else the system temporary directory (a file-backed
//!   mapping, as in containers whose `/dev/shm` is 64 MiB). Its blocks are reserved with
//!   `fallocate`, so a full file system fails the collective cleanly. Rank 0 sends the
//!   path to the others over TCP, they map it and answer, and rank 0 removes the file:
//!   from then on only the mappings hold it, and nothing is left behind by a crash.
//! * **Synchronisation** (`segment/sync.rs`): a barrier of atomics in the segment, a short spin
//!   (only when every member can have a core) then futex waits in 5 ms slices, each slice
//!   checking the peers' TCP links (a killed rank's connection closes: it is named), abort
//!   notices, and the deadline ([`crate::CommConfig::timeout`]; a stalled rank is named as
//!   the lowest one that has not arrived). A failing rank marks the segment aborted and
//!   wakes every waiter; [`flotilla_group::ProcessGroup::abort`] does the same.
//! * **Collectives** (`segment/ops.rs`): the all-reduce, in one step (one barrier, every rank
//!   sums the whole buffer) up to [`crate::CommConfig::small_all_reduce_bytes`] (and one
//!   slot), else chunked and double-buffered (each rank reduces its slice over the slots,
//!   writing the sum back into the others' slots; `C + 1` barriers for `C` chunks); either way in rank order, so every rank ends
//!   bit-identical, equal to a serial left-to-right sum in rank order. The broadcast (one
//!   barrier per chunk), and the group's barrier (the segment's, no frame sent).
//!
//! The copies run on a blocking section of the communicator's runtime
//! (`tokio::task::block_in_place`: the connection readers go on on another thread), or on
//! the caller's own thread for a blocking collective. `wire_format: bf16` and `lz4` do not
//! apply to shared memory (nothing is sent): its sums are exact `f32`.
//!
//! Why these crates: `memmap2` maps the file (well kept, the mapping alone is what is
//! needed); `rustix` wraps the futex and `statvfs`/`fallocate` syscalls. `shared_memory`
//! adds its own naming and locking over the same `shm_open`/`mmap` with fewer users, and
//! `iceoryx2` is a whole zero-copy publish-subscribe framework with its own daemon-less
//! service discovery: neither gives a reduction or a barrier, which are the work here.
//! Single-copy `process_vm_readv` (CMA) is not used: it would move the same bytes (the
//! kernel copies a peer's slice into a local buffer, where today the peer copies it into
//! its slot), plus a system call and page pinning per peer and chunk, and needs ptrace
//! rights over the peers; not measured.

use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use flotilla_group::CommError;

use crate::frame::Op;
use crate::op::OpCtx;
use crate::segment::{Segment, Watch, segment_bytes};
use crate::world::GroupState;

/// Frame tags of the setup on TCP: the path (rank 0 to each), the answer (each to rank 0).
const TAG_PATH: u32 = 0;
const TAG_MAPPED: u32 = 1;

/// The directory for a new segment of `bytes`: the configured one, else `shm` (`/dev/shm`)
/// when it has room, else the system temporary directory.
fn segment_dir(configured: Option<&Path>, shm: &Path, bytes: usize) -> PathBuf {
    if let Some(d) = configured {
        return d.to_path_buf();
    }
    match rustix::fs::statvfs(shm) {
        Ok(s) if s.f_bavail.saturating_mul(s.f_frsize) >= bytes as u64 => shm.to_path_buf(),
        _ => std::env::temp_dir(),
    }
}

/// Removes the segment's file when dropped (after every member mapped it, or on failure).
struct Unlink(PathBuf);

impl Drop for Unlink {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Rank 0's side of the setup: creates the segment (falling back to the temporary
/// directory when `/dev/shm` turns out full), tells every member where it is, removes the
/// file once all mapped it.
async fn create(ctx: &OpCtx<'_>, g: &GroupState) -> Result<Segment, CommError> {
    let cfg = &g.world.cfg;
    let (n, chunk) = (ctx.size(), cfg.shm_chunk_bytes);
    let name = format!("flotilla-{:016x}-{:016x}.shm", g.world.session, g.key);
    let shm = Path::new("/dev/shm");
    let dir = segment_dir(cfg.shm_dir.as_deref(), shm, segment_bytes(n, chunk));
    let mut path = dir.join(&name);
    let mut made = Segment::create(&path, n, 0, chunk);
    if matches!(&made, Err(e) if e.kind() == io::ErrorKind::StorageFull) && cfg.shm_dir.is_none() {
        path = std::env::temp_dir().join(&name);
        made = Segment::create(&path, n, 0, chunk);
    }
    let seg = made
        .map_err(|e| {
            CommError::io(
                format!("cannot create the shared-memory segment {}", path.display()),
                e,
            )
        })?
        .with_one_step_bytes(cfg.small_all_reduce_bytes);
    let _unlink = Unlink(path.clone());
    for p in 1..n {
        ctx.send(p, TAG_PATH, path.as_os_str().as_bytes()).await?;
    }
    for p in 1..n {
        ctx.recv(p, TAG_MAPPED, Some(0)).await?;
    }
    tracing::debug!(path = %path.display(), members = n, "shared-memory segment mapped by all");
    Ok(seg)
}

/// Another member's side of the setup: maps the segment rank 0 names, then answers.
async fn open(ctx: &OpCtx<'_>, g: &GroupState) -> Result<Segment, CommError> {
    let f = ctx.recv(0, TAG_PATH, None).await?;
    let path = PathBuf::from(std::ffi::OsStr::from_bytes(&f.payload));
    let cfg = &g.world.cfg;
    let seg = Segment::open(&path, ctx.size(), ctx.rank(), cfg.shm_chunk_bytes)
        .map_err(|e| {
            CommError::io(
                format!("cannot map the shared-memory segment {}", path.display()),
                e,
            )
        })?
        .with_one_step_bytes(cfg.small_all_reduce_bytes);
    ctx.send(0, TAG_MAPPED, &[]).await?;
    Ok(seg)
}

/// The group's segment, set up in this collective's turn the first time (`op`: the
/// collective's kind, whose frames carry the setup).
pub(crate) async fn segment(
    g: &GroupState,
    ticket: u64,
    op: Op,
) -> Result<Arc<Segment>, CommError> {
    let Some(slot) = g.shm.as_ref() else {
        return Err(CommError::InvalidArgument(
            "this group does not use shared memory".into(),
        ));
    };
    if let Some(s) = slot.get() {
        return Ok(s.clone());
    }
    let ctx = OpCtx::new(g, ticket, op);
    let seg = Arc::new(if ctx.rank() == 0 {
        create(&ctx, g).await?
    } else {
        open(&ctx, g).await?
    });
    g.world.add_segment(&seg);
    // Only this group's turn sets it: nobody else can have set it meanwhile.
    let _ = slot.set(seg.clone());
    Ok(seg)
}

/// What a wait on a group's segment watches: the group's links, abort notices, the
/// process's poisoning, the deadline; and how it names the culprit (by world rank).
pub(crate) struct GroupWatch<'a> {
    pub(crate) g: &'a GroupState,
    pub(crate) op: String,
}

impl Watch for GroupWatch<'_> {
    fn timeout(&self) -> Duration {
        self.g.world.cfg.timeout
    }

    fn check(&self) -> Result<(), CommError> {
        let w = &self.g.world;
        if let Some((by, reason)) = w.ep.abort.borrow().clone() {
            return Err(CommError::Aborted { by, reason });
        }
        if let Some(e) = w.poisoned.lock().ok().and_then(|p| p.clone()) {
            return Err(CommError::Poisoned(Box::new(e)));
        }
        for r in (0..self.g.members.len()).filter(|&r| r != self.g.me()) {
            let peer = self.g.members.world_rank(r);
            if let Ok(c) = w.conn(peer)
                && c.is_lost()
            {
                return Err(c.lost_error(&self.op));
            }
        }
        Ok(())
    }

    fn timed_out(&self, r: usize) -> CommError {
        CommError::Timeout {
            peer: self.g.members.world_rank(r),
            op: self.op.clone(),
            after: self.timeout(),
        }
    }

    fn aborted_by(&self, r: usize, reason: String) -> CommError {
        CommError::Aborted {
            by: self.g.members.world_rank(r),
            reason,
        }
    }

    fn protocol(&self, r: usize, detail: String) -> CommError {
        CommError::Protocol {
            peer: self.g.members.world_rank(r),
            detail: format!("{}: {detail}", self.op),
        }
    }
}

/// Runs `f` (a collective on `seg`) off the runtime's reactor; on failure marks the
/// segment aborted so that every member's wait ends at once.
pub(crate) fn run_blocking<T>(
    seg: &Segment,
    f: impl FnOnce() -> Result<T, CommError>,
) -> Result<T, CommError> {
    let r = tokio::task::block_in_place(f);
    if let Err(e) = &r {
        seg.abort(&e.to_string());
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_directory_falls_back_to_temp_when_dev_shm_is_small_or_missing() {
        let tmp = std::env::temp_dir();
        let configured = Path::new("/somewhere/else");
        assert_eq!(
            segment_dir(Some(configured), Path::new("/dev/shm"), 1),
            configured
        );
        // No file system has room for this segment; a missing /dev/shm has none either.
        assert_eq!(segment_dir(None, Path::new("/dev/shm"), usize::MAX), tmp);
        assert_eq!(segment_dir(None, Path::new("/no/dev/shm"), 1), tmp);
        if Path::new("/dev/shm").is_dir() {
            assert_eq!(
                segment_dir(None, Path::new("/dev/shm"), 4096),
                Path::new("/dev/shm")
            );
        }
    }
}
