//! The stall inspector of a group's collectives (sync training): a thread per rank that,
//! a few times per `warning` interval, all-gathers every rank's [`Activity`] in the
//! watched group over a group of its own. A collective that some ranks entered (and are
//! waiting in) and others have not issued is *partial*; past the warning every rank logs
//! it with the missing ranks, again at that interval, and past the shutdown limit every
//! rank aborts its collectives in the same round ([`ProcessGroup::abort`]) with that
//! message, so the training threads fail with it instead of waiting for the deadline.
//!
//! A rank whose watcher cannot answer at all (the process is frozen or gone) is left to
//! the collectives' own deadlines, which name it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{StallPolicy, StallVerdict, StallWatch, Stalled};
use crate::error::CommError;
use crate::group::{Activity, ProcessGroup};

const RUN: u8 = 0;
const STOP: u8 = 1;
const GONE: u8 = 2;

/// One rank's report in a round: flags, issued, oldest open (sequence, age in ms).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Report {
    stop: bool,
    abort: bool,
    activity: Activity,
}

impl Report {
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(26);
        out.push(u8::from(self.stop) | (u8::from(self.abort) << 1));
        out.extend_from_slice(&self.activity.issued.to_le_bytes());
        let (seq, age) = self
            .activity
            .oldest_open
            .map_or((u64::MAX, 0), |(s, a)| (s, a.as_millis() as u64));
        out.extend_from_slice(&seq.to_le_bytes());
        out.extend_from_slice(&age.to_le_bytes());
        out
    }

    fn decode(b: &[u8]) -> Option<Report> {
        if b.len() != 25 {
            return None;
        }
        let word = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(a)
        };
        let (seq, age) = (word(9), word(17));
        Some(Report {
            stop: b[0] & 1 != 0,
            abort: b[0] & 2 != 0,
            activity: Activity {
                issued: word(1),
                oldest_open: (seq != u64::MAX).then(|| (seq, Duration::from_millis(age))),
            },
        })
    }
}

/// Fuzzing hook: decodes a report; when it decodes, encoding it and decoding again must
/// give the same report.
#[cfg(feature = "fuzzing")]
pub(crate) fn fuzz_report(bytes: &[u8]) -> bool {
    let Some(report) = Report::decode(bytes) else {
        return false;
    };
    let again = Report::decode(&report.encode());
    assert_eq!(
        again,
        Some(report),
        "stall report does not survive a round trip"
    );
    true
}

/// The collectives some ranks are in and others have not issued: (sequence number, the
/// ranks that have not issued it), oldest first.
fn partial(reports: &[Activity]) -> Vec<(u64, Vec<usize>)> {
    let mut open: Vec<u64> = reports
        .iter()
        .filter_map(|a| a.oldest_open.map(|(s, _)| s))
        .collect();
    open.sort_unstable();
    open.dedup();
    open.into_iter()
        .filter_map(|seq| {
            let missing: Vec<usize> = (0..reports.len())
                .filter(|&r| reports[r].issued <= seq)
                .collect();
            (!missing.is_empty()).then_some((seq, missing))
        })
        .collect()
}

/// Watches a group's collectives; see the module documentation.
pub struct StallWatcher {
    state: Arc<AtomicU8>,
    thread: Option<JoinHandle<Result<(), CommError>>>,
}

impl std::fmt::Debug for StallWatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StallWatcher").finish_non_exhaustive()
    }
}

impl StallWatcher {
    /// Starts watching `target` (every member must start one); the watcher talks over
    /// `channel`, a group of the same members used for nothing else.
    pub fn start(
        target: Arc<dyn ProcessGroup>,
        channel: Arc<dyn ProcessGroup>,
        policy: StallPolicy,
    ) -> Result<Self, CommError> {
        let state = Arc::new(AtomicU8::new(RUN));
        let shared = state.clone();
        let thread = std::thread::Builder::new()
            .name("flotilla-stall".into())
            .spawn(move || watch(&*target, &*channel, policy, &shared))
            .map_err(|e| CommError::io("cannot start the stall inspector thread", e))?;
        Ok(Self {
            state,
            thread: Some(thread),
        })
    }

    /// Collective stop: returns once every rank asked to stop (or the watcher ended).
    pub fn shutdown(mut self) -> Result<(), CommError> {
        self.state.store(STOP, Ordering::SeqCst);
        self.wake();
        match self.thread.take().map(JoinHandle::join) {
            Some(Ok(r)) => r,
            Some(Err(_)) => Err(CommError::InvalidArgument(
                "the stall inspector thread panicked".into(),
            )),
            None => Ok(()),
        }
    }

    /// Ends the watcher thread's rest between rounds (it sees the new state at once).
    fn wake(&self) {
        if let Some(t) = &self.thread {
            t.thread().unpark();
        }
    }
}

impl Drop for StallWatcher {
    fn drop(&mut self) {
        // Not stopped collectively (the run failed): leave without waiting for anyone.
        if self.thread.is_some() {
            self.state.store(GONE, Ordering::SeqCst);
            self.wake();
        }
    }
}

fn watch(
    target: &dyn ProcessGroup,
    channel: &dyn ProcessGroup,
    policy: StallPolicy,
    state: &AtomicU8,
) -> Result<(), CommError> {
    let period = (policy.warning / 4).clamp(Duration::from_millis(20), Duration::from_secs(1));
    let mut clock = StallWatch::new(policy);
    let mut give_up: Option<String> = None;
    loop {
        let started = Instant::now();
        let mine = match state.load(Ordering::SeqCst) {
            GONE => return Ok(()),
            s => Report {
                stop: s == STOP,
                abort: give_up.is_some(),
                activity: target.activity(),
            },
        };
        let reports = channel
            .all_gather_bytes(&mine.encode())?
            .iter()
            .enumerate()
            .map(|(r, b)| {
                Report::decode(b).ok_or_else(|| CommError::Protocol {
                    peer: channel.world_rank(r),
                    detail: format!("a stall report of {} bytes", b.len()),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let activity: Vec<Activity> = reports.iter().map(|r| r.activity).collect();
        let found = partial(&activity);
        if reports.iter().any(|r| r.abort) {
            // A rank that did not give up itself says the same as those that did: whichever
            // rank's abort reaches a collective first is the error every rank reports.
            let reason = give_up.unwrap_or_else(|| {
                let gave_up: Vec<String> = (reports.iter().enumerate())
                    .filter(|(_, r)| r.abort)
                    .map(|(i, _)| channel.world_rank(i).to_string())
                    .collect();
                let waited = clock.longest(Instant::now()).unwrap_or_default();
                format!(
                    "stalled for {waited:.1?}: {} (rank(s) {} gave up first)",
                    describe(target, &found, &activity),
                    gave_up.join(", ")
                )
            });
            target.abort(&reason);
            return Ok(());
        }
        if reports.iter().all(|r| r.stop) {
            return Ok(());
        }
        let ids: Vec<(u32, Vec<usize>)> = found
            .iter()
            .map(|(seq, missing)| (*seq as u32, missing.clone()))
            .collect();
        match clock.observe(&ids, Instant::now()) {
            StallVerdict::Quiet => {}
            StallVerdict::Warn(_) => {
                let what = describe(target, &found, &activity);
                tracing::warn!(target: "flotilla::stall", "stall: {what}");
            }
            StallVerdict::Abort(s) => {
                let what = describe(target, &found, &activity);
                let waited = s.first().map_or(Duration::ZERO, |s: &Stalled| s.waited);
                tracing::error!(target: "flotilla::stall", "stall: {what}; aborting");
                give_up = Some(format!("stalled for {waited:.1?}: {what}"));
            }
        }
        rest(state, started + period);
    }
}

/// Sleeps until `until`, or less once `state` leaves `RUN`: [`StallWatcher::shutdown`]
/// (and its drop) unpark this thread, so that a run's end does not wait out a period (up to
/// a second) before the last round. An early wake-up only brings the next round forward.
fn rest(state: &AtomicU8, until: Instant) {
    while state.load(Ordering::SeqCst) == RUN {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return;
        }
        std::thread::park_timeout(left);
    }
}

/// One clause per partial collective: who is in it (for how long) and who never issued it.
fn describe(target: &dyn ProcessGroup, found: &[(u64, Vec<usize>)], all: &[Activity]) -> String {
    let ranks = |rs: &[usize]| {
        rs.iter()
            .map(|&r| target.world_rank(r).to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    found
        .iter()
        .map(|(seq, missing)| {
            let inside: Vec<usize> = (0..all.len())
                .filter(|&r| all[r].oldest_open.is_some_and(|(s, _)| s == *seq))
                .collect();
            let age = inside
                .iter()
                .filter_map(|&r| all[r].oldest_open.map(|(_, a)| a))
                .max()
                .unwrap_or_default();
            let behind: Vec<String> = missing
                .iter()
                .map(|&r| format!("rank {} issued {}", target.world_rank(r), all[r].issued))
                .collect();
            format!(
                "collective #{seq} entered by rank(s) {} waits for rank(s) {} ({:.1} s; {})",
                ranks(&inside),
                ranks(missing),
                age.as_secs_f64(),
                behind.join(", ")
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn act(issued: u64, open: Option<u64>) -> Activity {
        Activity {
            issued,
            oldest_open: open.map(|s| (s, Duration::from_secs(3))),
        }
    }

    #[test]
    fn a_collective_entered_by_some_and_not_issued_by_others_is_partial() {
        // Ranks 0 and 2 wait in #7; rank 1 issued only up to #6 (it is computing).
        let all = [act(8, Some(7)), act(7, None), act(8, Some(7))];
        assert_eq!(partial(&all), vec![(7, vec![1])]);
        // Everyone issued #7 (a slow link, not a stall).
        let slow = [act(8, Some(7)), act(8, Some(7)), act(8, None)];
        assert!(partial(&slow).is_empty());
        assert!(partial(&[act(3, None), act(5, None)]).is_empty());
    }

    #[test]
    fn reports_survive_the_wire() {
        for r in [
            Report {
                stop: true,
                abort: false,
                activity: act(9, Some(4)),
            },
            Report {
                stop: false,
                abort: true,
                activity: act(0, None),
            },
        ] {
            assert_eq!(Report::decode(&r.encode()), Some(r));
        }
        assert_eq!(Report::decode(&[0; 24]), None);
    }
}
