//! The tagged point-to-point mailbox shared by every [`crate::ProcessGroup`] implementation
//! (the TCP transport keeps one per process, the MPI backend one per group).
//!
//! Point-to-point messages from every peer land here, kept per (group key, sender, tag) in
//! arrival order until somebody asks for them. Tags never mix: a receiver waiting for tag 7
//! leaves tag 8 queued. [`Mailbox::take`] waits on one or several senders at once with one
//! deadline ("whichever peer speaks first"); a sender whose connection is gone is reported
//! once its queued messages are drained. Waiting is plain blocking (mutex + condvar): the
//! training thread never enters the communication runtime to receive.
//!
//! What a sender has queued in a group (all tags, counted with [`MESSAGE_OVERHEAD`] each, so
//! a flood of tiny messages on fresh tags is bounded too) may not exceed the mailbox's
//! limit: the message that would pass it is refused, the sender's queued messages in that
//! group are dropped, and its later ones there too; receivers waiting on it in that group
//! get the error naming it and the group.

use std::collections::{HashMap, VecDeque};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::CommError;

/// Key of one queue: (group key, sender's world rank, tag).
type QueueKey = (u64, usize, u32);

/// Default of the most bytes one sender may have queued in one group: 1 GiB (the TCP
/// transport's `CommConfig::max_queued_bytes`).
pub const DEFAULT_MAX_QUEUED_BYTES: usize = 1 << 30;

/// What a queued message counts for besides its bytes (its queue entry, the queue of a fresh
/// tag): a peer sending empty messages on ever new tags fills the limit too.
pub const MESSAGE_OVERHEAD: usize = 128;

#[derive(Default)]
struct State {
    queues: HashMap<QueueKey, VecDeque<(u64, Vec<u8>)>>,
    /// Bytes (and [`MESSAGE_OVERHEAD`]s) queued by (group key, sender).
    queued: HashMap<(u64, usize), usize>,
    /// Senders refused in a group for passing the limit (the error names them and it).
    refused: HashMap<(u64, usize), CommError>,
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
/// group ranks, with [`Mailbox::naming`] for its errors), group keys likewise (0 when the
/// mailbox serves one group).
pub struct Mailbox {
    state: Mutex<State>,
    changed: Condvar,
    /// The most bytes one sender may have queued in one group.
    limit: usize,
    /// The world rank of each sender, for errors (`None`: senders are world ranks).
    world: Option<Vec<usize>>,
}

impl Default for Mailbox {
    fn default() -> Self {
        Self::with_limit(DEFAULT_MAX_QUEUED_BYTES)
    }
}

impl Mailbox {
    /// A mailbox in which one sender may have at most `limit` bytes queued per group.
    pub fn with_limit(limit: usize) -> Self {
        Self {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            limit,
            world: None,
        }
    }

    /// Names sender `i` as world rank `world[i]` in errors (senders are group ranks).
    pub fn naming(mut self, world: Vec<usize>) -> Self {
        self.world = Some(world);
        self
    }

    fn world_rank(&self, from: usize) -> usize {
        self.world
            .as_ref()
            .and_then(|w| w.get(from).copied())
            .unwrap_or(from)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves plain data behind; keep going.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues a message from `from`. Fails (and drops it) when `from` is refused in `group`:
    /// this message would pass the limit (then its queued messages there are dropped and
    /// receivers get the error), or an earlier one did.
    pub fn deliver(
        &self,
        group: u64,
        from: usize,
        tag: u32,
        msg: Vec<u8>,
    ) -> Result<(), CommError> {
        let mut s = self.lock();
        if let Some(e) = s.refused.get(&(group, from)) {
            return Err(e.clone());
        }
        let cost = msg.len().saturating_add(MESSAGE_OVERHEAD);
        let queued = s.queued.entry((group, from)).or_default();
        if queued.saturating_add(cost) > self.limit {
            let e = self.overflow(group, from);
            s.queued.remove(&(group, from));
            s.queues.retain(|&(g, r, _), _| (g, r) != (group, from));
            s.refused.insert((group, from), e.clone());
            drop(s);
            self.changed.notify_all();
            return Err(e);
        }
        *queued += cost;
        s.arrivals += 1;
        let n = s.arrivals;
        s.queues
            .entry((group, from, tag))
            .or_default()
            .push_back((n, msg));
        drop(s);
        self.changed.notify_all();
        Ok(())
    }

    /// The error of a sender that passed the limit in `group`.
    fn overflow(&self, group: u64, from: usize) -> CommError {
        let place = if group == 0 {
            String::new()
        } else {
            format!(" in group {group:016x}")
        };
        CommError::Protocol {
            peer: self.world_rank(from),
            detail: format!(
                "queued more than {} bytes of point-to-point messages{place} that nobody \
                 received; its messages there are refused (the limit is \
                 CommConfig::max_queued_bytes)",
                self.limit
            ),
        }
    }

    /// Records that nothing more will come from `from` (its connection ended, or it broke
    /// the protocol): receivers get `why` once its queued messages are taken. The first
    /// reason is kept.
    pub fn peer_lost(&self, from: usize, why: CommError) {
        self.lock().lost.entry(from).or_insert(why);
        self.changed.notify_all();
    }

    /// Forgets that `from` was lost (and refused): a new connection to it (a rejoined rank)
    /// delivers again.
    pub fn peer_back(&self, from: usize) {
        let mut s = self.lock();
        s.lost.remove(&from);
        s.refused.retain(|&(_, r), _| r != from);
        drop(s);
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
                if let Some(queued) = s.queued.get_mut(&(group, r)) {
                    *queued = queued.saturating_sub(msg.len().saturating_add(MESSAGE_OVERHEAD));
                    if *queued == 0 {
                        s.queued.remove(&(group, r));
                    }
                }
                return Some(Taken::Message(i, msg));
            }
            let gone = |r: &usize| s.refused.get(&(group, *r)).or_else(|| s.lost.get(r));
            if let Some(e) = from.iter().find_map(gone) {
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
        m.deliver(0, 1, 7, b"seven".to_vec()).expect("deliver");
        m.deliver(0, 1, 8, b"eight".to_vec()).expect("deliver");
        m.deliver(5, 1, 7, b"other group".to_vec())
            .expect("deliver");
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
        m.deliver(0, 3, 1, vec![3]).expect("deliver");
        m.deliver(0, 2, 1, vec![2]).expect("deliver");
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

    /// A sender flooding fresh tags of a group: what the mailbox holds stays under the
    /// limit, the message that would pass it is refused and so are the sender's later ones
    /// there, and a receiver waiting on it in that group gets the error naming it (by world
    /// rank) and the group; its other group and another sender go on.
    #[test]
    fn a_flood_on_fresh_tags_stays_bounded_and_fails_the_senders_group() {
        let limit = 64 << 10;
        let m = Mailbox::with_limit(limit).naming(vec![10, 11, 12]);
        m.deliver(0, 2, 1, b"kept".to_vec())
            .expect("another sender");
        m.deliver(9, 1, 1, b"other group".to_vec())
            .expect("another group");
        let (mut most, mut refused) = (0, 0);
        for tag in 0..10_000u32 {
            refused += usize::from(m.deliver(5, 1, tag, vec![7; 1000]).is_err());
            most = most.max(m.lock().queues.values().map(VecDeque::len).sum::<usize>());
        }
        let fit = limit / (1000 + MESSAGE_OVERHEAD);
        assert!(
            most <= fit + 2,
            "held {most} messages, the limit fits {fit}"
        );
        assert_eq!(refused, 10_000 - fit);
        match m.take(5, &[1], 3, soon(10)) {
            Some(Taken::Lost(e)) => {
                assert_eq!(e.blamed_rank(), Some(11), "{e}");
                assert!(e.to_string().contains("group 0000000000000005"), "{e}");
            }
            other => panic!("{other:?}"),
        }
        match m.take(9, &[1], 1, soon(10)) {
            Some(Taken::Message(0, v)) => assert_eq!(v, b"other group"),
            other => panic!("{other:?}"),
        }
        match m.take(0, &[2], 1, soon(10)) {
            Some(Taken::Message(0, v)) => assert_eq!(v, b"kept"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_waiting_receiver_wakes_on_delivery() {
        let m = Arc::new(Mailbox::default());
        let m2 = m.clone();
        let t = std::thread::spawn(move || m2.take(0, &[4], 9, soon(5_000)));
        std::thread::sleep(Duration::from_millis(30));
        m.deliver(0, 4, 9, vec![1, 2]).expect("deliver");
        match t.join().expect("join") {
            Some(Taken::Message(0, v)) => assert_eq!(v, [1, 2]),
            other => panic!("{other:?}"),
        }
    }
}
