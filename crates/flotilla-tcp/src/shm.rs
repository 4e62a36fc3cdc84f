//! The shared-memory transport: the `f32` all-reduce and broadcast of a group whose members
//! all share one segment directory (equal host keys at the rendezvous, [`crate::host`]),
//! and its barrier, go through one shared segment instead of loopback TCP, when
//! [`crate::Transport`] is `auto` (the default) or `shm`. Everything else (byte and integer
//! collectives, all-gather, point-to-point messages) stays on the group's TCP (or
//! in-memory) links, which also carry the segment's setup and the failure notices.
//!
//! * **Segment** ([`crate::segment`]): one file per group, created by the group's rank 0 in its
//!   turn of the first collective that needs it (`flotilla-{pid}-{pid namespace}-{session}-{group key}.shm`,
//!   so two jobs or two groups never share one, and a file a killed creator left is
//!   swept by the next creation in its directory), in [`crate::CommConfig::shm_dir`] or `/dev/shm`
//!   when it has room (`statvfs`), else the system temporary directory (a file-backed
//!   mapping, as in containers whose `/dev/shm` is 64 MiB). Its blocks are reserved with
//!   `fallocate`, so a full file system fails the creation cleanly. Rank 0 sends the
//!   path to the others over TCP, they map it (no symbolic link; every layout parameter of
//!   the header checked) and answer, rank 0 sends the verdict all follow (the segment, or
//!   TCP for the group when a member cannot reach it, warned) and removes the file
//!   (`shm/setup.rs`): from then on only the mappings hold it.
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

use std::sync::Arc;
use std::time::Duration;

use flotilla_group::CommError;

use crate::frame::Op;
use crate::segment::{Segment, Watch};
use crate::world::GroupState;

mod setup;

/// The group's segment, set up in this collective's turn the first time (`op`: the
/// collective's kind, whose frames carry the setup); `None`: the group's members could not
/// share one and its `f32` collectives go over TCP (`setup.rs`).
pub(crate) async fn segment(
    g: &GroupState,
    ticket: u64,
    op: Op,
) -> Result<Option<Arc<Segment>>, CommError> {
    let Some(slot) = g.shm.as_ref() else {
        return Err(CommError::InvalidArgument(
            "this group does not use shared memory".into(),
        ));
    };
    if let Some(s) = slot.get() {
        return Ok(s.clone());
    }
    let seg = setup::set_up(g, ticket, op).await?.map(Arc::new);
    if let Some(seg) = &seg {
        g.world.add_segment(seg);
    }
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
