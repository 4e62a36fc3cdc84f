//! [`Pending`]: the result of a collective running in the background, and the one-shot
//! [`PendingSender`] that completes it. Plain blocking (a mutex and a condvar): waiting
//! needs no async runtime, whichever thread or runtime computes the result.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::error::CommError;

/// The result slot shared by a [`Pending`] and its [`PendingSender`].
struct Slot<T> {
    state: Mutex<State<T>>,
    changed: Condvar,
}

struct State<T> {
    /// The result, once sent and until taken.
    result: Option<Result<T, CommError>>,
    /// The sender is gone (after sending, or dropped without).
    closed: bool,
}

impl<T> Slot<T> {
    fn lock(&self) -> MutexGuard<'_, State<T>> {
        // A panic while holding the lock leaves plain data behind; keep going.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Completes one [`Pending`]; dropping it unsent makes [`Pending::wait`] return
/// [`CommError::Shutdown`].
pub struct PendingSender<T> {
    slot: Arc<Slot<T>>,
}

impl<T> std::fmt::Debug for PendingSender<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingSender").finish_non_exhaustive()
    }
}

impl<T> PendingSender<T> {
    /// Hands `result` to the [`Pending`] (kept until waited for, or dropped with it).
    pub fn send(self, result: Result<T, CommError>) {
        self.slot.lock().result = Some(result);
    }
}

impl<T> Drop for PendingSender<T> {
    fn drop(&mut self) {
        self.slot.lock().closed = true;
        self.slot.changed.notify_all();
    }
}

/// A collective running in the background; [`Pending::wait`] blocks for its result.
#[must_use = "a pending collective must be waited for"]
pub struct Pending<T> {
    slot: Arc<Slot<T>>,
    seq: u64,
}

impl<T> std::fmt::Debug for Pending<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pending").field("seq", &self.seq).finish()
    }
}

impl<T> Pending<T> {
    /// A pending result and the sender that completes it.
    pub fn channel(seq: u64) -> (PendingSender<T>, Pending<T>) {
        let slot = Arc::new(Slot {
            state: Mutex::new(State {
                result: None,
                closed: false,
            }),
            changed: Condvar::new(),
        });
        (PendingSender { slot: slot.clone() }, Pending { slot, seq })
    }

    /// An already finished operation.
    pub fn ready(seq: u64, result: Result<T, CommError>) -> Pending<T> {
        let (tx, p) = Self::channel(seq);
        tx.send(result);
        p
    }

    /// Blocks until the operation finished. Must not be called from inside an async runtime
    /// (it would block one of the runtime's threads).
    pub fn wait(self) -> Result<T, CommError> {
        let mut s = self.slot.lock();
        loop {
            if let Some(r) = s.result.take() {
                return r;
            }
            if s.closed {
                return Err(CommError::Shutdown);
            }
            s = self.slot.changed.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Whether [`Pending::wait`] would return at once.
    pub fn is_finished(&self) -> bool {
        let s = self.slot.lock();
        s.result.is_some() || s.closed
    }

    /// The operation's sequence number in its group.
    pub fn seq(&self) -> u64 {
        self.seq
    }
}

/// The all-reduce handle returned by [`crate::ProcessGroup::all_reduce_start`].
pub type PendingAllReduce = Pending<Vec<f32>>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_result_sent_from_another_thread_is_waited_for() {
        let (tx, p) = Pending::<u32>::channel(4);
        assert!(!p.is_finished());
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            tx.send(Ok(7));
        });
        assert_eq!(p.seq(), 4);
        assert_eq!(p.wait().expect("sent"), 7);
        t.join().expect("join");
        let ready = Pending::ready(0, Ok(1u8));
        assert!(ready.is_finished());
        assert_eq!(ready.wait().expect("ready"), 1);
    }

    #[test]
    fn a_sender_dropped_unsent_is_a_shutdown() {
        let (tx, p) = Pending::<()>::channel(0);
        drop(tx);
        assert!(p.is_finished());
        assert!(matches!(p.wait(), Err(CommError::Shutdown)));
    }
}
