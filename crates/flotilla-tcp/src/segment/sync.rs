//! The segment's barrier: a counter and a generation word in the header, a short spin
//! (adaptive: see `Segment::spin`),
//! then futex waits (`rustix::thread::futex`, shared between processes) in slices, so
//! that every wait is bounded and notices a failed or stalled peer. A rank that fails
//! marks the segment aborted and wakes every waiter. A barrier every member entered has
//! completed whatever a member does next: a waiter whose look at the peers fails looks at
//! the release once more before it reports the failure (a member that ended after its last
//! collective closes its links).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use flotilla_group::CommError;
use rustix::thread::futex;

use super::mapping::{ABORT, COUNT, GENERATION, REASON, REASON_MAX, SLEEPERS, Segment};

/// The abort word while the aborting rank writes its reason.
const CLAIMED: u32 = u32::MAX;

/// The most spins before the first futex wait, when every member has a core of its own.
const SPINS: u32 = 4000;
/// The fewest: enough to see a peer that arrives within a few microseconds (and so to learn
/// that spinning pays again).
const MIN_SPINS: u32 = 64;
/// `yield_now` rounds before sleeping (when ranks share cores they hand the core over).
const YIELDS: u32 = 16;
/// The longest futex sleep between two checks of the peers and the deadline.
const SLICE: Duration = Duration::from_millis(5);

/// What a wait on the segment checks while it sleeps, and how it names a culprit.
pub(crate) trait Watch {
    /// The deadline of one wait.
    fn timeout(&self) -> Duration;
    /// An error when the collective must stop: an abort notice, a lost peer, poisoning.
    fn check(&self) -> Result<(), CommError>;
    /// The error naming group rank `r`, which did not arrive in time.
    fn timed_out(&self, r: usize) -> CommError;
    /// The error naming group rank `r`, which marked the segment aborted for `reason`.
    fn aborted_by(&self, r: usize, reason: String) -> CommError;
    /// A protocol error naming group rank `r`.
    fn protocol(&self, r: usize, detail: String) -> CommError;
}

impl Segment {
    /// Waits until every member has entered this barrier as often as this rank (bounded by
    /// `watch`'s deadline). Everything a member wrote to the segment before entering is
    /// visible to every member after it.
    pub(crate) fn barrier(&self, watch: &dyn Watch) -> Result<(), CommError> {
        let mine = self.progress(self.me);
        mine.store(
            mine.load(Ordering::Relaxed).wrapping_add(1),
            Ordering::Relaxed,
        );
        let generation = self.word(GENERATION);
        let seen = generation.load(Ordering::Acquire);
        if self.word(COUNT).fetch_add(1, Ordering::AcqRel) + 1 == self.n as u32 {
            // The last to arrive releases the others (the reset is ordered before the
            // release, so a released rank entering the next barrier counts from 0).
            self.word(COUNT).store(0, Ordering::Relaxed);
            generation.store(seen.wrapping_add(1), Ordering::SeqCst);
            if self.word(SLEEPERS).load(Ordering::SeqCst) > 0 {
                let _ = futex::wake(generation, futex::Flags::empty(), i32::MAX as u32);
            }
            return Ok(());
        }
        self.wait_release(seen, watch)
    }

    fn wait_release(&self, seen: u32, watch: &dyn Watch) -> Result<(), CommError> {
        let generation = self.word(GENERATION);
        let released = || generation.load(Ordering::Acquire) != seen;
        if self.spin(&released) {
            return Ok(());
        }
        for _ in 0..YIELDS {
            if released() {
                return Ok(());
            }
            std::thread::yield_now();
        }
        let deadline = Instant::now() + watch.timeout();
        loop {
            if released() {
                return Ok(());
            }
            if let Err(e) = self.check(watch) {
                // A member released between the two looks, then left (its last collective
                // done, its links closed) or failed later: this barrier still completed.
                return if released() { Ok(()) } else { Err(e) };
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(watch.timed_out(self.laggard()));
            }
            let slice = (deadline - now).min(SLICE);
            let ts = futex::Timespec {
                tv_sec: 0,
                tv_nsec: slice.subsec_nanos().into(),
            };
            self.word(SLEEPERS).fetch_add(1, Ordering::SeqCst);
            // EAGAIN (released meanwhile), EINTR and the timeout all loop back.
            let _ = futex::wait(generation, futex::Flags::empty(), seen, Some(&ts));
            self.word(SLEEPERS).fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Spins while `released` is false, at most this process's spin budget; whether it
    /// became true. The budget adapts as an adaptive mutex's does: doubled (up to [`SPINS`])
    /// when the spin saw the release, halved (down to [`MIN_SPINS`]) when it did not, so a
    /// rank whose peers are descheduled (more runnable threads than cores) stops burning the
    /// core they wait for, while on an idle machine every wait spins. No spin at all when some
    /// member cannot have a core of its own.
    fn spin(&self, released: &dyn Fn() -> bool) -> bool {
        if !self.spare_cores {
            return false;
        }
        let budget = self.spin_budget.load(Ordering::Relaxed).min(SPINS);
        for _ in 0..budget {
            if released() {
                let more = budget.saturating_mul(2).min(SPINS);
                self.spin_budget.store(more, Ordering::Relaxed);
                return true;
            }
            std::hint::spin_loop();
        }
        self.spin_budget
            .store((budget / 2).max(MIN_SPINS), Ordering::Relaxed);
        false
    }

    /// Fails when a member marked the segment aborted or `watch` sees a failure.
    pub(crate) fn check(&self, watch: &dyn Watch) -> Result<(), CommError> {
        watch.check()?;
        match self.word(ABORT).load(Ordering::Acquire) {
            // Not aborted, or the reason is still being written (seen next time).
            0 | CLAIMED => Ok(()),
            r => Err(watch.aborted_by(r as usize - 1, self.reason())),
        }
    }

    /// The reason the aborting rank wrote (after its abort word was published).
    fn reason(&self) -> String {
        let len = (self.word(REASON).load(Ordering::Acquire) as usize).min(REASON_MAX);
        let mut bytes = vec![0u8; len];
        // SAFETY: written once, before the abort word that made us read it.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.header_bytes_at(REASON + 4, len),
                bytes.as_mut_ptr(),
                len,
            );
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The lowest group rank that has entered fewer barriers than this one.
    fn laggard(&self) -> usize {
        let mine = self.progress(self.me).load(Ordering::Relaxed);
        (0..self.n)
            .find(|&r| (mine.wrapping_sub(self.progress(r).load(Ordering::Relaxed)) as i32) > 0)
            .unwrap_or(self.me)
    }

    /// Marks the segment aborted by this rank for `reason` (unless a member did first) and
    /// wakes every waiter.
    pub(crate) fn abort(&self, reason: &str) {
        let abort = self.word(ABORT);
        if abort
            .compare_exchange(0, CLAIMED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            let mut len = reason.len().min(REASON_MAX);
            while !reason.is_char_boundary(len) {
                len -= 1;
            }
            // SAFETY: only the rank that claimed the abort word writes the reason, once.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    reason.as_ptr(),
                    self.header_bytes_at(REASON + 4, len),
                    len,
                );
            }
            self.word(REASON).store(len as u32, Ordering::Release);
            abort.store(self.me as u32 + 1, Ordering::Release);
        }
        let _ = futex::wake(
            self.word(GENERATION),
            futex::Flags::empty(),
            i32::MAX as u32,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A watch whose first look at the peers lets the other member arrive (releasing the
    /// barrier) and then reports it lost, as a member that finished its last collective and
    /// closed its links between the waiter's two looks.
    struct LeavesAfterArriving<'a> {
        other: &'a Segment,
        looks: std::cell::Cell<u32>,
    }

    impl Watch for LeavesAfterArriving<'_> {
        fn timeout(&self) -> Duration {
            Duration::from_secs(5)
        }
        fn check(&self) -> Result<(), CommError> {
            self.looks.set(self.looks.get() + 1);
            self.other.barrier(self)?;
            Err(CommError::PeerLost {
                peer: 1,
                op: "barrier".into(),
                reason: "connection closed by peer".into(),
            })
        }
        fn timed_out(&self, r: usize) -> CommError {
            CommError::Timeout {
                peer: r,
                op: "barrier".into(),
                after: self.timeout(),
            }
        }
        fn aborted_by(&self, r: usize, reason: String) -> CommError {
            CommError::Aborted { by: r, reason }
        }
        fn protocol(&self, r: usize, detail: String) -> CommError {
            CommError::Protocol { peer: r, detail }
        }
    }

    /// A barrier every member entered has completed, whatever a member does after it: a
    /// waiter that sees the release only after a peer has gone is not failed by its going
    /// (the CI of 06d9f4c failed a pipeline's last all-reduce on a replica that had ended).
    #[test]
    fn a_member_that_leaves_after_the_release_does_not_fail_the_barrier() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let layout = crate::segment::Layout::new(2, 4096, 0);
        let path = dir.path().join("seg");
        let seg = Segment::create(&path, &layout, 0).expect("segment");
        let other = Segment::open(&path, &layout, 1).expect("second mapping");
        let watch = LeavesAfterArriving {
            other: &other,
            looks: std::cell::Cell::new(0),
        };
        seg.barrier(&watch).expect("the barrier completed");
        assert_eq!(watch.looks.get(), 1, "the waiter looked at its peers once");
    }

    /// The spin budget halves down to `MIN_SPINS` while spins see no release and doubles
    /// back up to `SPINS` once they do.
    #[test]
    fn the_spin_budget_shrinks_while_spinning_fails_and_grows_back_when_it_pays() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let layout = crate::segment::Layout::new(2, 4096, 0);
        let seg = Segment::create(&dir.path().join("seg"), &layout, 0).expect("segment");
        let budget = || seg.spin_budget.load(Ordering::Relaxed).min(SPINS);
        if !seg.spare_cores {
            assert!(!seg.spin(&|| true), "no spin without a core per member");
            assert_eq!(budget(), SPINS);
            return;
        }
        let mut seen = vec![budget()];
        for _ in 0..8 {
            assert!(!seg.spin(&|| false));
            seen.push(budget());
        }
        assert_eq!(seen, [4000, 2000, 1000, 500, 250, 125, 64, 64, 64]);
        let mut seen = Vec::new();
        for _ in 0..8 {
            assert!(seg.spin(&|| true));
            seen.push(budget());
        }
        assert_eq!(seen, [128, 256, 512, 1024, 2048, 4000, 4000, 4000]);
    }
}
