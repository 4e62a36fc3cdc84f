//! One queue of parameter-server messages from several peers: a receiving thread per peer
//! feeds a channel, so a server waits on "whichever child speaks first" with one deadline,
//! and a peer whose connection drops becomes an event rather than a failure of the server.

use std::sync::Arc;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::thread;
use std::time::Instant;

use flotilla_comm::{CommError, Communicator};

use super::protocol::PsMessage;
use crate::error::TrainError;

/// Something that happened on a peer link.
#[derive(Debug)]
pub enum Event {
    /// A well-formed message.
    Message(usize, PsMessage),
    /// The peer sent bytes that are not a valid message (the link stays up).
    Malformed(usize, TrainError),
    /// The link to the peer is gone (the peer died or closed it).
    Lost(usize, CommError),
}

/// Merged messages of a set of peers.
pub struct Inbox {
    rx: Receiver<Event>,
}

impl Inbox {
    /// Starts listening to `peers` (point-to-point channel of `comm`).
    pub fn listen(comm: &Arc<Communicator>, peers: &[usize]) -> Self {
        let (tx, rx) = mpsc::channel();
        for &peer in peers {
            let comm = comm.clone();
            let thread_tx = tx.clone();
            let spawned = thread::Builder::new()
                .name(format!("ps-inbox-{peer}"))
                .spawn(move || {
                    loop {
                        let event = match comm.recv_from(peer) {
                            Ok(bytes) => match PsMessage::decode(&bytes, peer) {
                                Ok(m) => Event::Message(peer, m),
                                Err(e) => Event::Malformed(peer, e),
                            },
                            // A quiet peer is the server's call (it owns the deadlines).
                            Err(CommError::Timeout { .. }) => continue,
                            Err(e) => {
                                let _ = thread_tx.send(Event::Lost(peer, e));
                                return;
                            }
                        };
                        if thread_tx.send(event).is_err() {
                            return;
                        }
                    }
                });
            if let Err(e) = spawned {
                // Without a thread the peer can never be heard: report it as lost.
                let _ = tx.send(Event::Lost(
                    peer,
                    CommError::Config(format!("cannot start a receiver thread: {e}")),
                ));
            }
        }
        Self { rx }
    }

    /// The next event, or `None` if nothing arrives before `deadline`.
    pub fn recv_until(&self, deadline: Instant) -> Option<Event> {
        let left = deadline.saturating_duration_since(Instant::now());
        match self.rx.recv_timeout(left) {
            Ok(e) => Some(e),
            Err(RecvTimeoutError::Timeout) | Err(RecvTimeoutError::Disconnected) => None,
        }
    }
}
