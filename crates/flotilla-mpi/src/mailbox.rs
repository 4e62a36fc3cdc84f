//! The buffered point-to-point messages of one group.
//!
//! Messages drained from MPI by the progress thread land here, kept per (sender, Flotilla
//! tag) in arrival order until a receiver asks for them: a receiver waiting for tag 7
//! leaves tag 8 queued, and messages with the same (sender, tag) are taken in the order they
//! arrived. [`Mailbox::take`] waits on one or several senders with one deadline
//! ("whichever peer speaks first"). A sender that sent something malformed is reported
//! once its good messages are drained. Pure: no MPI here.

use std::collections::{HashMap, VecDeque};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Instant;

use flotilla_comm::{CommError, Tag};

/// The messages of one (sender, tag), each with its arrival number.
type Queue = VecDeque<(u64, Vec<u8>)>;

#[derive(Default)]
struct State {
    /// (sender group rank, tag) -> its messages.
    queues: HashMap<(usize, Tag), Queue>,
    /// Senders whose messages broke the protocol (group rank -> error).
    failed: HashMap<usize, CommError>,
    /// Arrival counter: orders messages across queues.
    arrivals: u64,
}

/// What [`Mailbox::take`] found.
#[derive(Debug)]
pub(crate) enum Taken {
    /// A message from the sender at this index of the `from` list.
    Message(usize, Vec<u8>),
    /// A sender broke the protocol and has nothing good queued (the error names it).
    Failed(CommError),
}

/// Received point-to-point messages of one group, by sender and tag.
#[derive(Default)]
pub(crate) struct Mailbox {
    state: Mutex<State>,
    changed: Condvar,
}

impl Mailbox {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves plain data behind; keep going.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues a message from group rank `from`.
    pub(crate) fn deliver(&self, from: usize, tag: Tag, msg: Vec<u8>) {
        let mut s = self.lock();
        s.arrivals += 1;
        let n = s.arrivals;
        s.queues.entry((from, tag)).or_default().push_back((n, msg));
        drop(s);
        self.changed.notify_all();
    }

    /// Records that `from` sent something that breaks the protocol.
    pub(crate) fn fail(&self, from: usize, why: CommError) {
        self.lock().failed.entry(from).or_insert(why);
        self.changed.notify_all();
    }

    /// Takes the earliest-arrived message with `tag` from any of `from` (group ranks), or
    /// reports a sender that failed, waiting until `deadline`. `None`: the deadline passed
    /// with nothing to report.
    pub(crate) fn take(&self, from: &[usize], tag: Tag, deadline: Instant) -> Option<Taken> {
        let mut s = self.lock();
        loop {
            if let Some(found) = Self::find(&mut s, from, tag) {
                return Some(found);
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            s = self
                .changed
                .wait_timeout(s, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// The earliest queued message of `tag` from `from`, else a failed sender's error.
    fn find(s: &mut State, from: &[usize], tag: Tag) -> Option<Taken> {
        let earliest = from
            .iter()
            .enumerate()
            .filter_map(|(i, &r)| {
                let q = s.queues.get(&(r, tag))?;
                q.front().map(|(n, _)| (*n, i, r))
            })
            .min();
        if let Some((_, i, r)) = earliest {
            let q = s.queues.get_mut(&(r, tag))?;
            let (_, msg) = q.pop_front()?;
            if q.is_empty() {
                s.queues.remove(&(r, tag));
            }
            return Some(Taken::Message(i, msg));
        }
        from.iter()
            .find_map(|r| s.failed.get(r).cloned())
            .map(Taken::Failed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    fn soon() -> Instant {
        Instant::now() + Duration::from_millis(50)
    }

    #[test]
    fn same_sender_and_tag_in_order_and_tags_never_mix() {
        let m = Mailbox::default();
        m.deliver(1, 7, b"a".to_vec());
        m.deliver(1, 8, b"other tag".to_vec());
        m.deliver(1, 7, b"b".to_vec());
        for want in [&b"a"[..], b"b"] {
            match m.take(&[1], 7, soon()) {
                Some(Taken::Message(0, got)) => assert_eq!(got, want),
                other => panic!("{other:?}"),
            }
        }
        assert!(m.take(&[1], 7, soon()).is_none(), "tag 8 must stay queued");
        assert!(matches!(m.take(&[1], 8, soon()), Some(Taken::Message(0, g)) if g == b"other tag"));
    }

    #[test]
    fn earliest_arrival_wins_across_senders_and_the_index_names_it() {
        let m = Mailbox::default();
        m.deliver(3, 1, b"from 3".to_vec());
        m.deliver(2, 1, b"from 2".to_vec());
        assert!(matches!(m.take(&[2, 3], 1, soon()), Some(Taken::Message(1, g)) if g == b"from 3"));
        assert!(matches!(m.take(&[2, 3], 1, soon()), Some(Taken::Message(0, g)) if g == b"from 2"));
        // A sender not asked for is not taken.
        m.deliver(4, 1, b"from 4".to_vec());
        assert!(m.take(&[2, 3], 1, soon()).is_none());
    }

    #[test]
    fn the_deadline_is_honoured_and_a_late_delivery_wakes_the_receiver() {
        let m = Arc::new(Mailbox::default());
        let t = Instant::now();
        assert!(m.take(&[0], 5, t + Duration::from_millis(80)).is_none());
        assert!(
            t.elapsed() >= Duration::from_millis(80),
            "{:?}",
            t.elapsed()
        );
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        let sender = m.clone();
        let h = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            sender.deliver(0, 5, b"late".to_vec());
        });
        let t = Instant::now();
        let got = m.take(&[0], 5, t + Duration::from_secs(10));
        assert!(matches!(got, Some(Taken::Message(0, g)) if g == b"late"));
        assert!(t.elapsed() < Duration::from_secs(5));
        h.join().expect("sender thread");
    }

    #[test]
    fn a_failed_sender_is_reported_after_its_good_messages() {
        let m = Mailbox::default();
        m.deliver(1, 2, b"good".to_vec());
        m.fail(
            1,
            CommError::Protocol {
                peer: 1,
                detail: "short".into(),
            },
        );
        assert!(matches!(
            m.take(&[1], 2, soon()),
            Some(Taken::Message(0, _))
        ));
        match m.take(&[0, 1], 2, soon()) {
            Some(Taken::Failed(e)) => assert_eq!(e.blamed_rank(), Some(1)),
            other => panic!("{other:?}"),
        }
    }
}
