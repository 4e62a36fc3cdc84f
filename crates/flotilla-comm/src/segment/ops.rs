//! The collectives over a segment: the `f32` sum all-reduce and the `f32` broadcast.
//!
//! All-reduce, chunk `k` of `chunk / 4` floats in buffer set `k % 2`: each rank copies its
//! chunk into its input slot (all but its own slice `r`, `[m r / n, m (r + 1) / n)`,
//! which only it reads); barrier; each rank copies out the result of chunk `k - 1` (the
//! barrier says every rank finished reducing it; all but its own slice, already in place)
//! and reduces its slice of chunk `k` over all inputs **in rank order**
//! (`((x0 + x1) + x2) + ...`, in L1-sized blocks, its own input read from its buffer) into
//! the result slot and its buffer. A last barrier,
//! then the last chunk's copy-out. One barrier per chunk: the two sets keep a slot from
//! being overwritten while a slower rank still reads it (chunk `k + 2` is written only
//! after the barrier of `k + 1`, which that rank enters after reading chunk `k`). Every
//! rank ends with the same bits: those of a serial left-to-right `f32` sum in rank order.
//!
//! Broadcast: a barrier (the previous collective's readers are done), then per chunk the
//! root copies into the result slot of set `k % 2`, barrier, the others copy out.
//!
//! Each rank also publishes the buffer's length next to its progress word; after the first
//! barrier every rank checks that all lengths agree (a mismatch is a protocol error).

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

    /// Publishes this rank's buffer length (before its first barrier of a collective).
    fn publish_len(&self, len: usize) {
        self.len_word(self.me)
            .store(len as u64, std::sync::atomic::Ordering::Relaxed);
    }

    /// After the first barrier: every member's length equals `len`.
    fn check_lens(&self, len: usize) -> Result<usize, usize> {
        match (0..self.n)
            .find(|&r| self.len_word(r).load(std::sync::atomic::Ordering::Relaxed) != len as u64)
        {
            Some(r) => Err(r),
            None => Ok(len),
        }
    }

    /// Sum all-reduce of `buf` over the group (see the module doc).
    pub(crate) fn all_reduce(&self, buf: &mut [f32], watch: &dyn Watch) -> Result<(), CommError> {
        let (c, len) = (self.floats(), buf.len());
        let chunks = len.div_ceil(c).max(1);
        let span = |k: usize| k * c..((k + 1) * c).min(len);
        self.publish_len(len);
        for k in 0..chunks {
            let (set, part) = (k % 2, span(k));
            let (lo, hi) = self.own_slice(part.len());
            // SAFETY: this rank's own input slot of set k % 2: its last readers reduced
            // chunk k - 2 before entering the barrier of chunk k - 1, which we passed.
            let slot = unsafe { self.write(set, self.me, 0, part.len()) };
            slot[..lo].copy_from_slice(&buf[part.start..part.start + lo]);
            slot[hi..].copy_from_slice(&buf[part.start + hi..part.end]);
            self.barrier(watch)?;
            if k == 0 {
                self.check_lens(len).map_err(|r| mismatch(watch, r, len))?;
            } else {
                self.copy_out((k - 1) % 2, &mut buf[span(k - 1)]);
            }
            self.reduce_slice(set, &mut buf[part]);
        }
        self.barrier(watch)?;
        self.copy_out((chunks - 1) % 2, &mut buf[span(chunks - 1)]);
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
        let (n, me) = (self.n, self.me);
        let (lo, hi) = self.own_slice(part.len());
        let mut acc = [0.0f32; BLOCK];
        let mut at = lo;
        while at < hi {
            let b = BLOCK.min(hi - at);
            let acc = &mut acc[..b];
            let mine = &mut part[at..at + b];
            // SAFETY: between the barrier of this chunk and the next one every input slot
            // of the set is read-only and this rank's slice of the result is its own.
            let input = |r: usize| unsafe { self.read(set, r, at, b) };
            acc.copy_from_slice(if me == 0 { mine } else { input(0) });
            for r in 1..n {
                reduce::add_assign(acc, if r == me { mine } else { input(r) });
            }
            unsafe { self.write(set, n, at, b) }.copy_from_slice(acc);
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
        let (n, c, len) = (self.n, self.floats(), buf.len());
        self.publish_len(len);
        self.barrier(watch)?;
        self.check_lens(len).map_err(|r| mismatch(watch, r, len))?;
        // At least one chunk, so that no rank publishes its next length before every rank
        // has checked this one (which a single barrier would allow).
        for k in 0..len.div_ceil(c).max(1) {
            let (set, part) = (k % 2, k * c..((k + 1) * c).min(len));
            if self.me == root {
                // SAFETY: the readers of this set's result (chunk k - 2, or the previous
                // collective) finished before entering a barrier this rank passed.
                let dst = unsafe { self.write(set, n, 0, part.len()) };
                dst.copy_from_slice(&buf[part.clone()]);
            }
            self.barrier(watch)?;
            if self.me != root {
                // SAFETY: written by the root before the barrier, rewritten only after the
                // next one.
                let src = unsafe { self.read(set, n, 0, part.len()) };
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
