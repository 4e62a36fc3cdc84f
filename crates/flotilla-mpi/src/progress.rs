//! The progress thread of the process: it drains every group's incoming point-to-point
//! messages into the group's mailbox (so `send` completes even while the receiver computes,
//! as on TCP, and two ranks sending to each other never deadlock), and a few times a
//! second fails collectives past their deadline or after an abort
//! ([`crate::state::GroupState::watch_deadlines`]).
//!
//! It polls (`MPI_Improbe`) rather than blocking in MPI, so that it can stop and watch the
//! clock: right after a message it polls again at once, when idle it backs off to a 1 ms
//! sleep.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use flotilla_comm::CommError;

use crate::runtime::Runtime;
use crate::state::GroupState;
use crate::wire;

/// How often deadlines are checked.
const WATCH_EVERY: Duration = Duration::from_millis(50);
/// The longest idle sleep.
const MAX_IDLE: Duration = Duration::from_millis(1);

/// The thread's loop; ends when [`Runtime::stop`] is set.
pub(crate) fn run(rt: &'static Runtime) {
    let mut idle = Duration::from_micros(20);
    let mut watched = Instant::now();
    while !rt.stop.load(Ordering::SeqCst) {
        let groups = rt.groups();
        let got: usize = groups.iter().map(|g| drain(g)).sum();
        if watched.elapsed() >= WATCH_EVERY {
            groups.iter().for_each(|g| g.watch_deadlines());
            watched = Instant::now();
        }
        // The last handle of a group may be the one held here: the group (and its MPI
        // communicator) is freed on this thread then.
        drop(groups);
        if got > 0 {
            idle = Duration::from_micros(20);
        } else {
            std::thread::sleep(idle);
            idle = (idle * 2).min(MAX_IDLE);
        }
    }
}

/// Moves every waiting message of `g` into its mailbox; how many there were.
fn drain(g: &GroupState) -> usize {
    let mut n = 0;
    while let Some((from, buf)) = g.comm.poll_recv() {
        n += 1;
        g.rt.stats.add_received(buf.len() as u64);
        let len = buf.len();
        match wire::decode(buf) {
            Some((tag, msg)) => g.mailbox.deliver(from, tag, msg),
            None => g.mailbox.fail(
                from,
                CommError::Protocol {
                    peer: g.members.get(from).copied().unwrap_or(from),
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
