//! Parameter-server messages from several peers at once: [`ProcessGroup::recv_any`] on the
//! servers' tag, so a server waits on "whichever child speaks first" with one deadline, and a
//! peer whose connection drops becomes an event rather than a failure of the server.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use flotilla_group::{CommError, ProcessGroup};

use crate::protocol::{PsMessage, TAG};

/// Something that happened on a peer link.
#[derive(Debug)]
pub enum Event {
    /// A well-formed message.
    Message(usize, PsMessage),
    /// The peer sent bytes that are not a valid message (the link stays up).
    Malformed(usize, CommError),
    /// The link to the peer is gone (the peer died or closed it).
    Lost(usize, CommError),
    /// A replacement took the peer's place ([`ProcessGroup::rejoins`]); its loss may not
    /// have been seen first.
    Back(usize),
}

/// Merged messages of a set of peers. Clones share the set of peers not lost yet.
#[derive(Clone)]
pub struct Inbox {
    group: Arc<dyn ProcessGroup>,
    /// Peers not lost yet.
    live: Arc<Mutex<Vec<usize>>>,
    /// Every peer with the rejoin count last seen: a count that grew means a replacement
    /// took the peer's place (whether or not its loss was seen first).
    seen: Arc<Mutex<Vec<(usize, u64)>>>,
}

impl Inbox {
    /// Starts listening to `peers` (group ranks) on the parameter servers' tag.
    pub fn listen(group: &Arc<dyn ProcessGroup>, peers: &[usize]) -> Self {
        Self {
            group: group.clone(),
            live: Arc::new(Mutex::new(peers.to_vec())),
            seen: Arc::new(Mutex::new(
                peers.iter().map(|&p| (p, group.rejoins(p))).collect(),
            )),
        }
    }

    /// A peer replaced since it was last looked at (it rejoined), live again.
    fn came_back(&self) -> Option<usize> {
        let mut seen = self.seen.lock().ok()?;
        let (peer, count) = seen
            .iter_mut()
            .find(|(p, at)| self.group.rejoins(*p) > *at)?;
        *count = self.group.rejoins(*peer);
        let peer = *peer;
        if let Ok(mut l) = self.live.lock()
            && !l.contains(&peer)
        {
            l.push(peer);
        }
        Some(peer)
    }

    /// The next event, or `None` if nothing arrives before `deadline` (at once when every
    /// peer is lost).
    pub fn recv_until(&self, deadline: Instant) -> Option<Event> {
        if let Some(peer) = self.came_back() {
            return Some(Event::Back(peer));
        }
        let live = self.live.lock().map(|l| l.clone()).unwrap_or_default();
        if live.is_empty() {
            return None;
        }
        match self.group.recv_any(&live, TAG, deadline) {
            Ok((peer, bytes)) => Some(match PsMessage::decode(&bytes, peer) {
                Ok(m) => Event::Message(peer, m),
                Err(e) => Event::Malformed(peer, e),
            }),
            Err(CommError::Deadline { .. }) => None,
            Err(e) => {
                let peer = e
                    .blamed_rank()
                    .and_then(|w| self.group.group_rank(w))
                    .filter(|p| live.contains(p))
                    .unwrap_or(live[0]);
                if let Ok(mut l) = self.live.lock() {
                    l.retain(|&p| p != peer);
                }
                Some(Event::Lost(peer, e))
            }
        }
    }
}
