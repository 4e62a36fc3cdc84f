//! How every parameter server takes its next event: it waits on all of its peers at once
//! (one deadline) and hands the event to the server's state machine. The machines
//! ([`super::shard_server::ShardServer`], [`super::local::LocalServer`]) hold all state and do all
//! the deciding; [`serve_one`] only waits. The run loop calls it once per step.

use std::time::{Duration, Instant};

use flotilla_tcp::CommError;

use super::PsContext;
use crate::error::{Result, TrainError};
use flotilla_ps::{Event, Inbox, PsMessage};

/// A parameter server as a state machine: every input is one method call.
pub trait ServerMachine {
    /// The peers (group ranks) whose messages it takes.
    fn peers(&self) -> Vec<usize>;

    /// Called once before the first event (e.g. a local server's first pull).
    fn on_start(&mut self, cx: &mut PsContext<'_>) -> Result<()> {
        let _ = cx;
        Ok(())
    }

    /// A well-formed message from `from`.
    fn on_message(&mut self, cx: &mut PsContext<'_>, from: usize, msg: PsMessage) -> Result<()>;

    /// `from` sent bytes that are not a message (the link stays up).
    fn on_malformed(&mut self, cx: &mut PsContext<'_>, from: usize, e: TrainError) -> Result<()>;

    /// Whether it goes on without `peer` when that peer fails (an asynchronous server
    /// without a child). By default it does not.
    fn goes_on_without(&self, peer: usize) -> bool {
        let _ = peer;
        false
    }

    /// `from` failed and said so ([`PsMessage::Abort`]): this fails too, naming it (and
    /// through its reason the rank at fault), unless it goes on without `from`, which is
    /// then handled as a lost peer.
    fn on_aborted(&mut self, cx: &mut PsContext<'_>, from: usize, reason: String) -> Result<()> {
        if !self.goes_on_without(from) {
            return Err(super::aborted_by(from, &reason));
        }
        let e = CommError::PeerLost {
            peer: from,
            op: "its work".into(),
            reason: format!("it failed: {reason}"),
        };
        self.on_lost(cx, from, e)
    }

    /// The link to `peer` is gone.
    fn on_lost(&mut self, cx: &mut PsContext<'_>, peer: usize, e: CommError) -> Result<()>;

    /// A lost peer is back (a replaced worker rejoined). By default nothing changes: only
    /// servers whose workers can rejoin take it back.
    fn on_back(&mut self, cx: &mut PsContext<'_>, peer: usize) -> Result<()> {
        let _ = (cx, peer);
        Ok(())
    }

    /// Nothing arrived for `waited`: the error naming who was waited for (a server always
    /// waits for somebody).
    fn on_deadline(&mut self, cx: &mut PsContext<'_>, waited: Duration) -> Result<()>;

    /// Time spent waiting for the last event (for round timings).
    fn note_wait(&mut self, waited: Duration) {
        let _ = waited;
    }

    /// Whether the server has stopped.
    fn done(&self) -> bool;

    /// Sends what was held back for the run loop's decision (the root's reply to a round).
    fn flush(&mut self, cx: &mut PsContext<'_>) -> Result<()> {
        let _ = cx;
        Ok(())
    }
}

/// Waits for the next event on `inbox` (at most `timeout`) and hands it to `machine`.
pub fn serve_one(
    machine: &mut dyn ServerMachine,
    cx: &mut PsContext<'_>,
    inbox: &Inbox,
    timeout: Duration,
) -> Result<()> {
    let t = Instant::now();
    let event = inbox.recv_until(t + timeout);
    machine.note_wait(t.elapsed());
    match event {
        None => machine.on_deadline(cx, t.elapsed()),
        Some(Event::Message(from, PsMessage::Abort { reason })) => {
            machine.on_aborted(cx, from, reason)
        }
        Some(Event::Message(from, msg)) => match machine.on_message(cx, from, msg) {
            // A reply to a peer it goes on without found the link gone (a worker killed
            // between its request and the reply): as if the inbox had reported it lost.
            Err(TrainError::Comm(e @ CommError::PeerLost { peer, .. }))
                if machine.goes_on_without(peer) =>
            {
                machine.on_lost(cx, peer, e)
            }
            r => r,
        },
        Some(Event::Malformed(from, e)) => machine.on_malformed(cx, from, e.into()),
        Some(Event::Lost(peer, e)) => machine.on_lost(cx, peer, e),
        Some(Event::Back(peer)) => machine.on_back(cx, peer),
    }
}
