//! The collectives over a segment: the `f32` sum all-reduce, the `f32` broadcast and the
//! `f32` all-gather.
//!
//! **Steps.** Every collective is a sequence of steps, counted over the segment's life
//! (`Segment::steps`, equal on every member): step `j` uses buffer set `j % 2`, one slot
//! per rank. In a step a rank first writes (its own slot of the set, its length word of
//! the set) and enters the barrier; then it reads the set's slots, and may rewrite a range
//! of another rank's slot that it alone touches in this step (its slice of a chunked
//! all-reduce); in the next step only the slot's owner reads the set (its own slot: the
//! chunked all-reduce's copy-out). Why nothing is overwritten while a slower member still
//! reads it: a slot of set `j % 2` is written before barrier `j` only by its owner, after
//! this rank passed barrier `j - 1`, which every member entered after finishing its reads
//! of step `j - 2` (the owner's own reads of step `j - 1` come first in its program order),
//! and after barrier `j` only in ranges nobody else touches until barrier `j + 1`. So
//! collectives of any kind and length follow each other with no barrier between them.
//!
//! **All-reduce, one step** (a buffer of at most [`Segment::one_step_floats`] floats): each rank
//! copies its whole buffer into its slot; barrier; each rank sums every element over
//! all slots in rank order into its buffer. Per rank: 1 barrier; copies `S` in, reads
//! `n S`, writes `S` (`S`: the buffer's bytes) — the fewest synchronisations, paid for with
//! every rank summing the whole buffer, which pays while the barrier is the cost.
//!
//! **All-reduce, chunked** (larger buffers): chunk `k` of `chunk / 4` floats is step
//! `j0 + k`: each rank copies its chunk into its slot (all but its own slice `r`,
//! `[m r / n, m (r + 1) / n)`, which nobody reads); barrier; each rank copies out the
//! result of chunk `k - 1` from its **own** slot (all but its own slice, already in place)
//! and reduces its slice of chunk `k` over all inputs **in rank order**
//! (`((x0 + x1) + x2) + ...`, its own input read from its buffer) into its buffer and back
//! into slice `r` of every other rank's slot, where that rank's copy-out finds it: the
//! result overwrites the input just read, in lines already in this core's cache, and no
//! result slot is needed. On 2 ranks that is one fused pass (`mine = peer = mine + peer`);
//! on more, in L1-sized blocks. A last step with no writes, then the last chunk's copy-out.
//! Per rank, `C` chunks: `C + 1` barriers; copies `(n-1)/n S` in, reads `S` and writes
//! `S` reducing, copies `(n-1)/n S` out: bytes read and written, a copy counted twice,
//! `4 S` on 2 ranks and `5 S` on 4, against `5 S` and `7 S` for one step.
//!
//! Either way every rank ends with the same bits: those of a serial left-to-right `f32`
//! sum in rank order.
//!
//! **Broadcast**: chunk `k` is a step: the root copies it into its slot; barrier; the
//! others copy it out of the root's slot. `C` barriers.
//!
//! **All-gather**: chunk `k` is a step: each rank copies its own part of the chunk (its
//! [`shard`] of the whole buffer, where it falls in the chunk) into the same place of its
//! slot; barrier; each copies every other rank's part out of that rank's slot. `C`
//! barriers; per rank, copies `S / n` in and `(n-1)/n S` out (the ring over TCP sends and
//! receives `(n-1)/n S` through the kernel, with `n - 1` waits).
//!
//! Each rank publishes its buffer's length in its length word of the collective's first
//! set; after the first barrier every rank checks that all lengths agree (a mismatch is a
//! protocol error). The word of that set is next written two steps later, after every
//! member has checked.

use std::sync::atomic::Ordering;

use flotilla_group::{CommError, shard};

use super::mapping::Segment;
use super::sync::Watch;
use crate::reduce;

/// Floats reduced at once (4 KiB: stays in L1 while the slots stream through).
const BLOCK: usize = 1024;

impl Segment {
    fn floats(&self) -> usize {
        self.chunk / 4
    }

    /// Rank `r`'s slot of set `set`, elements `at..at + len`, to read.
    ///
    /// # Safety
    /// The protocol above must give this rank that range to read until the next barrier
    /// (no member writes it meanwhile).
    unsafe fn read(&self, set: usize, r: usize, at: usize, len: usize) -> &[f32] {
        // Checked in release builds too: once per range, not per element.
        assert!(
            at.checked_add(len).is_some_and(|end| end <= self.floats()),
            "segment read of {len} floats at {at} outside a slot of {}",
            self.floats()
        );
        // SAFETY: inside the slot (checked above); the caller guarantees nobody writes it
        // meanwhile.
        unsafe { std::slice::from_raw_parts(self.slot(set, r).add(at), len) }
    }

    /// The same range, to write.
    ///
    /// # Safety
    /// The protocol above must give this rank that range alone (no member reads or writes
    /// it) until the next barrier.
    #[allow(clippy::mut_from_ref)] // the memory is the shared mapping, not `self`
    unsafe fn write(&self, set: usize, r: usize, at: usize, len: usize) -> &mut [f32] {
        assert!(
            at.checked_add(len).is_some_and(|end| end <= self.floats()),
            "segment write of {len} floats at {at} outside a slot of {}",
            self.floats()
        );
        // SAFETY: inside the slot (checked above); the caller guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.slot(set, r).add(at), len) }
    }

    /// Starts the next step: its buffer set.
    fn next_set(&self) -> usize {
        self.steps.fetch_add(1, Ordering::Relaxed) % 2
    }

    /// The step's barrier; on the collective's first step (`first`: its buffer length)
    /// also checks that every member's length equals this rank's.
    fn step_barrier(
        &self,
        set: usize,
        first: Option<usize>,
        watch: &dyn Watch,
    ) -> Result<(), CommError> {
        if let Some(len) = first {
            self.len_word(self.me, set)
                .store(len as u64, Ordering::Relaxed);
        }
        self.barrier(watch)?;
        let Some(len) = first else { return Ok(()) };
        match (0..self.n).find(|&r| self.len_word(r, set).load(Ordering::Relaxed) != len as u64) {
            Some(r) => Err(mismatch(watch, r, len)),
            None => Ok(()),
        }
    }

    /// Sum all-reduce of `buf` over the group (see the module doc): in one step when it
    /// holds at most [`Segment::one_step_floats`] floats, else chunked.
    pub(crate) fn all_reduce(&self, buf: &mut [f32], watch: &dyn Watch) -> Result<(), CommError> {
        if buf.len() <= self.one_step_floats {
            return self.all_reduce_one_step(buf, watch);
        }
        let (c, len) = (self.floats(), buf.len());
        let chunks = len.div_ceil(c);
        let span = |k: usize| k * c..((k + 1) * c).min(len);
        let mut prev = None;
        for k in 0..chunks {
            let (set, part) = (self.next_set(), span(k));
            let (lo, hi) = self.own_slice(part.len());
            // SAFETY: this rank's own slot of this step's set (see the module doc).
            let slot = unsafe { self.write(set, self.me, 0, part.len()) };
            slot[..lo].copy_from_slice(&buf[part.start..part.start + lo]);
            slot[hi..].copy_from_slice(&buf[part.start + hi..part.end]);
            self.step_barrier(set, (k == 0).then_some(len), watch)?;
            if let Some(p) = prev {
                self.copy_out(p, &mut buf[span(k - 1)]);
            }
            let (lo, hi) = self.own_slice(part.len());
            self.sum_range(set, &mut buf[part], lo, hi, true);
            prev = Some(set);
        }
        let set = self.next_set();
        self.barrier(watch)?;
        self.copy_out(1 - set, &mut buf[span(chunks - 1)]);
        Ok(())
    }

    /// The one-step all-reduce (see the module doc).
    fn all_reduce_one_step(&self, buf: &mut [f32], watch: &dyn Watch) -> Result<(), CommError> {
        let set = self.next_set();
        // SAFETY: this rank's own slot of this step's set.
        unsafe { self.write(set, self.me, 0, buf.len()) }.copy_from_slice(buf);
        self.step_barrier(set, Some(buf.len()), watch)?;
        self.sum_range(set, buf, 0, buf.len(), false);
        Ok(())
    }

    /// This rank's slice `[m r / n, m (r + 1) / n)` of a chunk of `m` floats.
    fn own_slice(&self, m: usize) -> (usize, usize) {
        (m * self.me / self.n, m * (self.me + 1) / self.n)
    }

    /// Copies the result of set `set` into `out` (a chunk of the buffer) from this rank's
    /// own slot, where every other rank wrote its slice, but for this rank's own slice,
    /// which its reduction already wrote there.
    fn copy_out(&self, set: usize, out: &mut [f32]) {
        let (lo, hi) = self.own_slice(out.len());
        // SAFETY: the result is complete (every rank entered a barrier after reducing its
        // slice, which this rank passed); only this rank touches its slot of the set until
        // it rewrites it itself, in its next step.
        let src = unsafe { self.read(set, self.me, 0, out.len()) };
        out[..lo].copy_from_slice(&src[..lo]);
        out[hi..].copy_from_slice(&src[hi..]);
    }

    /// Sums `part[lo..hi]` over every rank's input of set `set` in rank order (this rank's
    /// own read from `part`) into `part`, and, when `publish`, into the same range of every
    /// other rank's slot (which held that rank's input).
    fn sum_range(&self, set: usize, part: &mut [f32], lo: usize, hi: usize, publish: bool) {
        let (n, me) = (self.n, self.me);
        if n == 2 && publish {
            // SAFETY: between this step's barrier and the next one this range of the
            // peer's slot is this rank's alone (its slice: see the module doc).
            let peer = unsafe { self.write(set, 1 - me, lo, hi - lo) };
            reduce::add_both(&mut part[lo..hi], peer);
            return;
        }
        let mut acc = [0.0f32; BLOCK];
        let mut at = lo;
        while at < hi {
            let b = BLOCK.min(hi - at);
            let acc = &mut acc[..b];
            let mine = &mut part[at..at + b];
            {
                let own: &[f32] = mine;
                let x = |r: usize| {
                    if r == me {
                        own
                    } else {
                        // SAFETY: between this step's barrier and the next one every slot
                        // of the set is read-only in this range but for this rank's writes
                        // below.
                        unsafe { self.read(set, r, at, b) }
                    }
                };
                match n {
                    1 => acc.copy_from_slice(x(0)),
                    _ => reduce::add_to(acc, x(0), x(1)),
                }
                for r in 2..n {
                    reduce::add_assign(acc, x(r));
                }
            }
            mine.copy_from_slice(acc);
            for p in (0..n).filter(|&p| publish && p != me) {
                // SAFETY: this range of rank `p`'s slot is this rank's slice, its alone
                // until the next barrier; nothing borrowed from it is alive.
                unsafe { self.write(set, p, at, b) }.copy_from_slice(acc);
            }
            at += b;
        }
    }

    /// Broadcast of `buf` from group rank `root` (see the module doc).
    pub(crate) fn broadcast(
        &self,
        buf: &mut [f32],
        root: usize,
        watch: &dyn Watch,
    ) -> Result<(), CommError> {
        let (c, len) = (self.floats(), buf.len());
        // At least one step, so that lengths are checked even for an empty buffer.
        for k in 0..len.div_ceil(c).max(1) {
            let (set, part) = (self.next_set(), k * c..((k + 1) * c).min(len));
            if self.me == root {
                // SAFETY: the root's own slot of this step's set.
                let dst = unsafe { self.write(set, root, 0, part.len()) };
                dst.copy_from_slice(&buf[part.clone()]);
            }
            self.step_barrier(set, (k == 0).then_some(len), watch)?;
            if self.me != root {
                // SAFETY: written by the root before this step's barrier, rewritten only
                // two steps later, after the next barrier.
                let src = unsafe { self.read(set, root, 0, part.len()) };
                buf[part].copy_from_slice(src);
            }
        }
        Ok(())
    }

    /// All-gather of `buf` (see the module doc): each rank's [`shard`] of it filled from
    /// that rank's.
    pub(crate) fn all_gather(&self, buf: &mut [f32], watch: &dyn Watch) -> Result<(), CommError> {
        let (c, len) = (self.floats(), buf.len());
        // At least one step, so that lengths are checked even for an empty buffer.
        for k in 0..len.div_ceil(c).max(1) {
            let (set, part) = (self.next_set(), k * c..((k + 1) * c).min(len));
            // Rank `r`'s part of this chunk (empty when its shard lies elsewhere).
            let part_of = |r: usize| {
                let s = shard(len, self.n, r);
                let lo = s.start.max(part.start);
                lo..s.end.min(part.end).max(lo)
            };
            let mine = part_of(self.me);
            if !mine.is_empty() {
                // SAFETY: this rank's own slot of this step's set.
                let dst = unsafe { self.write(set, self.me, mine.start - part.start, mine.len()) };
                dst.copy_from_slice(&buf[mine]);
            }
            self.step_barrier(set, (k == 0).then_some(len), watch)?;
            for r in (0..self.n).filter(|&r| r != self.me) {
                let theirs = part_of(r);
                if theirs.is_empty() {
                    continue;
                }
                // SAFETY: written by its owner before this step's barrier, rewritten only
                // two steps later, after the next barrier.
                let src = unsafe { self.read(set, r, theirs.start - part.start, theirs.len()) };
                buf[theirs].copy_from_slice(src);
            }
        }
        Ok(())
    }
}

/// The error for group rank `r`, whose buffer length differs from this rank's `len`.
fn mismatch(watch: &dyn Watch, r: usize, len: usize) -> CommError {
    watch.protocol(
        r,
        format!(
            "buffer lengths differ ({len} floats here); ranks issued collectives in \
             different orders or with different sizes"
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn segment() -> (tempfile::TempDir, Segment) {
        let dir = tempfile::tempdir().expect("temporary directory");
        let layout = crate::segment::Layout::new(2, 4096, 0);
        let seg = Segment::create(&dir.path().join("seg"), &layout, 0).expect("segment");
        (dir, seg)
    }

    /// A range past the end of its slot stops at the check, in release builds too (the
    /// float after slot 0 is still inside the mapping: nothing else would stop it).
    #[test]
    #[should_panic(expected = "outside a slot")]
    fn a_range_past_its_slot_stops_in_release_too() {
        let (_dir, seg) = segment();
        // SAFETY: no other process maps the segment; the check stops the read first.
        let _ = unsafe { seg.read(0, 0, seg.floats(), 1) };
    }

    /// A slot of a rank past the group's stops at the check, in release builds too.
    #[test]
    #[should_panic(expected = "outside a segment of 2 ranks")]
    fn a_slot_past_the_ranks_stops_in_release_too() {
        let (_dir, seg) = segment();
        let _ = seg.slot(1, 2);
    }

    /// A header word past the header stops at the check, in release builds too.
    #[test]
    #[should_panic(expected = "outside the header")]
    fn a_word_past_the_header_stops_in_release_too() {
        let (_dir, seg) = segment();
        let _ = seg.progress(64);
    }
}
