//! The collectives over a segment: the `f32` sum all-reduce and the `f32` broadcast.
//!
//! All-reduce, chunk `k` of `chunk / 4` floats in buffer set `k % 2`: each rank copies its
//! chunk into its input slot; barrier; each rank copies out the result of chunk `k - 1`
//! (the barrier says every rank finished reducing it) and reduces its own slice `r` of
//! chunk `k` (`[m r / n, m (r + 1) / n)`) over all input slots **in rank order**
//! (`((x0 + x1) + x2) + ...`, in L1-sized blocks) into the result slot. A last barrier,
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

use super::segment::Segment;
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
        let (n, c, len) = (self.n, self.floats(), buf.len());
        let chunks = len.div_ceil(c).max(1);
        let span = |k: usize| k * c..((k + 1) * c).min(len);
        self.publish_len(len);
        for k in 0..chunks {
            let (set, part) = (k % 2, span(k));
            // SAFETY: this rank's own input slot of set k % 2: its last readers reduced
            // chunk k - 2 before entering the barrier of chunk k - 1, which we passed.
            unsafe { self.write(set, self.me, 0, part.len()) }.copy_from_slice(&buf[part.clone()]);
            self.barrier(watch)?;
            if k == 0 {
                self.check_lens(len).map_err(|r| mismatch(watch, r, len))?;
            } else {
                let prev = span(k - 1);
                // SAFETY: the result of chunk k - 1 is complete (every rank entered the
                // barrier after reducing it) and is rewritten only after the next barrier.
                let out = unsafe { self.read((k - 1) % 2, n, 0, prev.len()) };
                buf[prev].copy_from_slice(out);
            }
            self.reduce_slice(set, part.len());
        }
        self.barrier(watch)?;
        let last = span(chunks - 1);
        // SAFETY: complete after the last barrier; the next collective writes a result slot
        // only after its own first barrier, which this rank enters after copying.
        let out = unsafe { self.read((chunks - 1) % 2, n, 0, last.len()) };
        buf[last].copy_from_slice(out);
        Ok(())
    }

    /// Reduces this rank's slice of the `m` floats of set `set` over the input slots, in
    /// rank order, into the result slot.
    fn reduce_slice(&self, set: usize, m: usize) {
        let (n, me) = (self.n, self.me);
        let (lo, hi) = (m * me / n, m * (me + 1) / n);
        let mut acc = [0.0f32; BLOCK];
        let mut at = lo;
        while at < hi {
            let b = BLOCK.min(hi - at);
            let acc = &mut acc[..b];
            // SAFETY: between the barrier of this chunk and the next one every input slot
            // of the set is read-only and this rank's slice of the result is its own.
            acc.copy_from_slice(unsafe { self.read(set, 0, at, b) });
            for r in 1..n {
                reduce::add_assign(acc, unsafe { self.read(set, r, at, b) });
            }
            unsafe { self.write(set, n, at, b) }.copy_from_slice(acc);
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
        for k in 0..len.div_ceil(c) {
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
