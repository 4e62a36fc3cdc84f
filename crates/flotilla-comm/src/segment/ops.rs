//! The collectives over a segment: the `f32` sum all-reduce and the `f32` broadcast.
//!
//! **Steps.** Every collective is a sequence of steps, counted over the segment's life
//! (`Segment::steps`, equal on every member): step `j` uses buffer set `j % 2`. In a step a
//! rank first writes (its own input slot of the set, its length word of the set), enters
//! the barrier, then reads (every input slot of the set, the result slot of the *other* set)
//! and writes its own part of the set's result slot. Why nothing is overwritten while a
//! slower member still reads it: a slot of set `j % 2` is written in step `j` only after
//! this rank passed barrier `j - 1`, which every member entered after finishing its reads
//! of step `j - 2`, the last to read that set (step `j - 1` reads the result slot of set
//! `j % 2`, never written before a barrier). So collectives of any kind and length follow
//! each other with no barrier between them.
//!
//! **All-reduce, one step** (a buffer of at most [`Segment::one_step_floats`] floats): each rank
//! copies its whole buffer into its input slot; barrier; each rank sums every element over
//! all slots in rank order into its buffer. Per rank: 1 barrier; copies `S` in, reads
//! `n S`, writes `S` (`S`: the buffer's bytes) — the fewest synchronisations, paid for with
//! every rank summing the whole buffer, which pays while the barrier is the cost.
//!
//! **All-reduce, chunked** (larger buffers): chunk `k` of `chunk / 4` floats is step
//! `j0 + k`: each rank copies its chunk into its input slot (all but its own slice `r`,
//! `[m r / n, m (r + 1) / n)`, which only it reads); barrier; each rank copies out the
//! result of chunk `k - 1` (all but its own slice, already in place) and reduces its slice
//! of chunk `k` over all inputs **in rank order** (`((x0 + x1) + x2) + ...`, in L1-sized
//! blocks, its own input read from its buffer) into the set's result slot and its buffer.
//! A last step with no writes, then the last chunk's copy-out. Per rank, `C` chunks: `C + 1`
//! barriers; copies `(n-1)/n S` in, reads `S` and writes `2 S / n` reducing, copies
//! `(n-1)/n S` out (`3 S` moved on 2 ranks, `4.5 S` on 4, against `5 S` and `7 S` for one step).
//!
//! Either way every rank ends with the same bits: those of a serial left-to-right `f32`
//! sum in rank order.
//!
//! **Broadcast**: chunk `k` is a step: the root copies it into its input slot; barrier; the
//! others copy it out of the root's slot. `C` barriers.
//!
//! Each rank publishes its buffer's length in its length word of the collective's first
//! set; after the first barrier every rank checks that all lengths agree (a mismatch is a
//! protocol error). The word of that set is next written two steps later, after every
//! member has checked.

use std::sync::atomic::Ordering;

use flotilla_group::CommError;

use super::mapping::Segment;
use super::sync::Watch;
use crate::reduce;

/// Floats reduced at once (4 KiB: stays in L1 while the slots stream through).
const BLOCK: usize = 1024;

impl Segment {
    fn floats(&self) -> usize {
        self.chunk / 4
    }

    /// Input slot `r` (`n`: the result) of set `set`, elements `at..at + len`, to read.
    ///
    /// # Safety
    /// The protocol above must give this rank that range to read until the next barrier
    /// (no member writes it meanwhile).
    unsafe fn read(&self, set: usize, r: usize, at: usize, len: usize) -> &[f32] {
        debug_assert!(at + len <= self.floats());
        // SAFETY: inside the slot; the caller guarantees nobody writes it meanwhile.
        unsafe { std::slice::from_raw_parts(self.slot(set, r).add(at), len) }
    }

    /// The same range, to write.
    ///
    /// # Safety
    /// The protocol above must give this rank that range alone (no member reads or writes
    /// it) until the next barrier.
    #[allow(clippy::mut_from_ref)] // the memory is the shared mapping, not `self`
    unsafe fn write(&self, set: usize, r: usize, at: usize, len: usize) -> &mut [f32] {
        debug_assert!(at + len <= self.floats());
        // SAFETY: inside the slot; the caller guarantees exclusive access.
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
            // SAFETY: this rank's own input slot of this step's set (see the module doc).
            let slot = unsafe { self.write(set, self.me, 0, part.len()) };
            slot[..lo].copy_from_slice(&buf[part.start..part.start + lo]);
            slot[hi..].copy_from_slice(&buf[part.start + hi..part.end]);
            self.step_barrier(set, (k == 0).then_some(len), watch)?;
            if let Some(p) = prev {
                self.copy_out(p, &mut buf[span(k - 1)]);
            }
            self.reduce_slice(set, &mut buf[part]);
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
        // SAFETY: this rank's own input slot of this step's set.
        unsafe { self.write(set, self.me, 0, buf.len()) }.copy_from_slice(buf);
        self.step_barrier(set, Some(buf.len()), watch)?;
        self.sum_range(set, buf, 0, buf.len(), false);
        Ok(())
    }

    /// This rank's slice `[m r / n, m (r + 1) / n)` of a chunk of `m` floats.
    fn own_slice(&self, m: usize) -> (usize, usize) {
        (m * self.me / self.n, m * (self.me + 1) / self.n)
    }

    /// Copies the result of set `set` into `out` (a chunk of the buffer), but for this
    /// rank's own slice, which its reduction already wrote there.
    fn copy_out(&self, set: usize, out: &mut [f32]) {
        let (lo, hi) = self.own_slice(out.len());
        // SAFETY: the result is complete (every rank entered a barrier after reducing its
        // slice, which this rank passed) and is rewritten only after the next barrier,
        // which this rank enters after copying.
        let src = unsafe { self.read(set, self.n, 0, out.len()) };
        out[..lo].copy_from_slice(&src[..lo]);
        out[hi..].copy_from_slice(&src[hi..]);
    }

    /// Reduces this rank's slice of `part` (its chunk in set `set`) over every rank's input
    /// in rank order (its own read from `part`), into the result slot and into `part`.
    fn reduce_slice(&self, set: usize, part: &mut [f32]) {
        let (lo, hi) = self.own_slice(part.len());
        self.sum_range(set, part, lo, hi, true);
    }

    /// Sums `part[lo..hi]` over every rank's input slot of set `set` in rank order (this
    /// rank's own input read from `part`) into `part`, and into the result slot when
    /// `publish`.
    fn sum_range(&self, set: usize, part: &mut [f32], lo: usize, hi: usize, publish: bool) {
        let (n, me) = (self.n, self.me);
        let mut acc = [0.0f32; BLOCK];
        let mut at = lo;
        while at < hi {
            let b = BLOCK.min(hi - at);
            let acc = &mut acc[..b];
            let mine = &mut part[at..at + b];
            // SAFETY: between this step's barrier and the next one every input slot of the
            // set is read-only and this rank's slice of the result is its own.
            let input = |r: usize| unsafe { self.read(set, r, at, b) };
            acc.copy_from_slice(if me == 0 { mine } else { input(0) });
            for r in 1..n {
                reduce::add_assign(acc, if r == me { mine } else { input(r) });
            }
            if publish {
                unsafe { self.write(set, n, at, b) }.copy_from_slice(acc);
            }
            mine.copy_from_slice(acc);
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
                // SAFETY: the root's own input slot of this step's set.
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
