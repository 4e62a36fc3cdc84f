//! What the progress thread does for a group ([`Served`]): drain its point-to-point
//! messages into its mailbox, and watch its collectives' deadlines.

use flotilla_group::CommError;

use crate::runtime::Served;
use crate::state::GroupState;
use crate::wire;

impl Served for GroupState {
    fn drain(&self) -> usize {
        let g = self;
        let mut n = 0;
        while let Some((from, buf)) = g.comm.poll_recv() {
            n += 1;
            g.rt.stats.add_received(buf.len() as u64);
            let len = buf.len();
            match wire::decode(buf) {
                Some((tag, msg)) => {
                    // A refusal (the sender passed the mailbox's limit) reaches the receivers.
                    if let Err(e) = g.mailbox.deliver(0, from, tag, msg) {
                        tracing::warn!(error = %e, "point-to-point message refused");
                    }
                }
                None => g.mailbox.peer_lost(
                    from,
                    CommError::Protocol {
                        peer: g.members.world_ranks().get(from).copied().unwrap_or(from),
                        detail: format!(
                            "a point-to-point message of {len} bytes, shorter than its {}-byte tag",
                            wire::TRAILER
                        ),
                    },
                ),
            }
        }
        n
    }

    fn watch_deadlines(&self) {
        GroupState::watch_deadlines(self);
    }
}
