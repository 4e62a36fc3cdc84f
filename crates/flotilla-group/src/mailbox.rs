//! The tagged point-to-point mailbox shared by every [`crate::ProcessGroup`] implementation
//! (the TCP transport keeps one per process, the MPI backend one per group).
//!
//! Point-to-point messages from every peer land here, kept per (group key, sender, tag) in
//! arrival order until somebody asks for them. Tags never mix: a receiver waiting for tag 7
//! leaves tag 8 queued. [`Mailbox::take`] waits on one or several senders at once with one
//! deadline ("whichever peer speaks first"); a sender whose connection is gone is reported
//! once its queued messages are drained. Waiting is plain blocking (mutex + condvar): the
//! training thread never enters the communication runtime to receive.

use std::collections::{HashMap, VecDeque};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::CommError;

/// Key of one queue: (group key, sender's world rank, tag).
type QueueKey = (u64, usize, u32);

#[derive(Default)]
struct State {
    queues: HashMap<QueueKey, VecDeque<(u64, Vec<u8>)>>,
    /// Why a sender's connection ended (world rank -> error).
    lost: HashMap<usize, CommError>,
    /// Arrival counter: orders messages across queues.
    arrivals: u64,
}

/// What [`Mailbox::take`] found.
#[derive(Debug)]
pub enum Taken {
    /// A message from the sender at this index of the `from` list.
    Message(usize, Vec<u8>),
    /// A sender is gone (or broke the protocol) and has nothing queued (the error names it).
    Lost(CommError),
}

/// Received point-to-point messages, by group, sender and tag. Senders are named by
/// whatever rank space the owner uses (the TCP transport: world ranks; an MPI group: its
/// group ranks), group keys likewise (0 when the mailbox serves one group).
#[derive(Default)]
pub struct Mailbox {
    state: Mutex<State>,
    changed: Condvar,
}

impl Mailbox {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves plain data behind; keep going.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues a message from `from`.
    pub fn deliver(&self, group: u64, from: usize, tag: u32, msg: Vec<u8>) {
        let mut s = self.lock();
        s.arrivals += 1;
        let n = s.arrivals;
        s.queues
            .entry((group, from, tag))
            .or_default()
            .push_back((n, msg));
        drop(s);
        self.changed.notify_all();
    }

    /// Records that nothing more will come from `from` (its connection ended, or it broke
    /// the protocol): receivers get `why` once its queued messages are taken. The first
    /// reason is kept.
    pub fn peer_lost(&self, from: usize, why: CommError) {
        self.lock().lost.entry(from).or_insert(why);
        self.changed.notify_all();
    }

    /// Forgets that `from` was lost: a new connection to it (a rejoined rank) delivers again.
    pub fn peer_back(&self, from: usize) {
        self.lock().lost.remove(&from);
        self.changed.notify_all();
    }

    /// Takes the earliest-arrived message with `tag` in `group` from any of `from`, or reports a sender that is gone, waiting until `deadline`. `None` when the
    /// deadline passed with nothing to report.
    pub fn take(&self, group: u64, from: &[usize], tag: u32, deadline: Instant) -> Option<Taken> {
        let mut s = self.lock();
        loop {
            let earliest = from
                .iter()
                .enumerate()
                .filter_map(|(i, &r)| {
                    let q = s.queues.get(&(group, r, tag))?;
                    q.front().map(|(n, _)| (*n, i, r))
                })
                .min();
            if let Some((_, i, r)) = earliest {
                let q = s.queues.get_mut(&(group, r, tag))?;
                let (_, msg) = q.pop_front()?;
                if q.is_empty() {
                    s.queues.remove(&(group, r, tag));
                }
                return Some(Taken::Message(i, msg));
            }
            if let Some(e) = from.iter().find_map(|r| s.lost.get(r)) {
                return Some(Taken::Lost(e.clone()));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            s = self
                .changed
                .wait_timeout(s, left.min(Duration::from_secs(3600)))
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn soon(ms: u64) -> Instant {
        Instant::now() + Duration::from_millis(ms)
    }

    #[test]
    fn tags_and_groups_never_mix() {
        let m = Mailbox::default();
        m.deliver(0, 1, 7, b"seven".to_vec());
        m.deliver(0, 1, 8, b"eight".to_vec());
        m.deliver(5, 1, 7, b"other group".to_vec());
        match m.take(0, &[1], 8, soon(10)) {
            Some(Taken::Message(0, v)) => assert_eq!(v, b"eight"),
            other => panic!("{other:?}"),
        }
        match m.take(5, &[1], 7, soon(10)) {
            Some(Taken::Message(0, v)) => assert_eq!(v, b"other group"),
            other => panic!("{other:?}"),
        }
        match m.take(0, &[1], 7, soon(10)) {
            Some(Taken::Message(0, v)) => assert_eq!(v, b"seven"),
            other => panic!("{other:?}"),
        }
        assert!(m.take(0, &[1], 7, soon(10)).is_none());
    }

    #[test]
    fn earliest_arrival_wins_and_lost_comes_after_the_queue() {
        let m = Mailbox::default();
        m.deliver(0, 3, 1, vec![3]);
        m.deliver(0, 2, 1, vec![2]);
        m.peer_lost(
            3,
            CommError::PeerLost {
                peer: 3,
                op: "x".into(),
                reason: "gone".into(),
            },
        );
        let order: Vec<String> = (0..3)
            .map(|_| match m.take(0, &[2, 3], 1, soon(10)) {
                Some(Taken::Message(i, v)) => format!("msg {i} {v:?}"),
                Some(Taken::Lost(e)) => format!("lost {:?}", e.blamed_rank()),
                None => "none".into(),
            })
            .collect();
        assert_eq!(order, ["msg 1 [3]", "msg 0 [2]", "lost Some(3)"]);
    }

    #[test]
    fn a_waiting_receiver_wakes_on_delivery() {
        let m = Arc::new(Mailbox::default());
        let m2 = m.clone();
        let t = std::thread::spawn(move || m2.take(0, &[4], 9, soon(5_000)));
        std::thread::sleep(Duration::from_millis(30));
        m.deliver(0, 4, 9, vec![1, 2]);
        match t.join().expect("join") {
            Some(Taken::Message(0, v)) => assert_eq!(v, [1, 2]),
            other => panic!("{other:?}"),
        }
    }
}
