//! The stall inspector: names what some ranks wait for and other ranks never started.
//!
//! [`StallWatch`] is its clock: which partially submitted tensors (or collectives) have
//! waited too long, when to warn again and when to give up. Pure: the caller feeds it what
//! each round found partial and the time. Two callers: the asynchronous all-reduce's cycle
//! (`flotilla-train`'s `CycleReducer`: tensors some ranks submitted) and [`StallWatcher`] (collectives
//! some ranks entered, for sync training).

mod watcher;

pub use watcher::StallWatcher;
#[cfg(feature = "fuzzing")]
pub(crate) use watcher::fuzz_report;

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// When to warn and when to abort.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StallPolicy {
    /// Warn (and warn again at this interval) once something waited this long.
    pub warning: Duration,
    /// Abort once something waited this long; `None`: never.
    pub shutdown: Option<Duration>,
}

impl Default for StallPolicy {
    fn default() -> Self {
        Self {
            warning: Duration::from_secs(60),
            shutdown: None,
        }
    }
}

/// One entry that some ranks hold and others do not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stalled {
    /// The entry's id.
    pub id: u32,
    /// The (group) ranks that have not submitted it.
    pub missing: Vec<usize>,
    /// How long it has been partial.
    pub waited: Duration,
}

/// What to do after a cycle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StallVerdict {
    /// Nothing waited too long (or the last warning is recent).
    Quiet,
    /// Log these (oldest first).
    Warn(Vec<Stalled>),
    /// Give up: these waited past the shutdown limit (oldest first).
    Abort(Vec<Stalled>),
}

/// Tracks since when each partial entry has been partial.
#[derive(Debug, Clone, Default)]
pub struct StallWatch {
    policy: StallPolicy,
    since: HashMap<u32, Instant>,
    last_warning: Option<Instant>,
}

impl StallWatch {
    /// A watch with `policy`.
    pub fn new(policy: StallPolicy) -> Self {
        Self {
            policy,
            ..Self::default()
        }
    }

    /// How long the oldest entry still partial at the last [`Self::observe`] has been
    /// partial at `now`.
    pub fn longest(&self, now: Instant) -> Option<Duration> {
        let oldest = self.since.values().min()?;
        Some(now.saturating_duration_since(*oldest))
    }

    /// Records the entries found partial at `now` (id, missing ranks); entries no longer
    /// partial are forgotten.
    pub fn observe(&mut self, partial: &[(u32, Vec<usize>)], now: Instant) -> StallVerdict {
        self.since
            .retain(|id, _| partial.iter().any(|(p, _)| p == id));
        let mut stalled: Vec<Stalled> = partial
            .iter()
            .map(|(id, missing)| {
                let since = *self.since.entry(*id).or_insert(now);
                Stalled {
                    id: *id,
                    missing: missing.clone(),
                    waited: now.saturating_duration_since(since),
                }
            })
            .filter(|s| s.waited >= self.policy.warning)
            .collect();
        if stalled.is_empty() {
            self.last_warning = None;
            return StallVerdict::Quiet;
        }
        stalled.sort_by(|a, b| b.waited.cmp(&a.waited).then(a.id.cmp(&b.id)));
        if let Some(limit) = self.policy.shutdown
            && stalled[0].waited >= limit
        {
            return StallVerdict::Abort(stalled);
        }
        match self.last_warning {
            Some(t) if now.saturating_duration_since(t) < self.policy.warning => {
                StallVerdict::Quiet
            }
            _ => {
                self.last_warning = Some(now);
                StallVerdict::Warn(stalled)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longest_is_the_oldest_partial_entrys_wait() {
        let mut w = StallWatch::new(StallPolicy::default());
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        assert_eq!(w.longest(at(0)), None);
        w.observe(&[(7, vec![1])], at(1));
        w.observe(&[(7, vec![1]), (8, vec![1])], at(3));
        assert_eq!(w.longest(at(5)), Some(Duration::from_secs(4)));
        w.observe(&[(8, vec![1])], at(6));
        assert_eq!(w.longest(at(6)), Some(Duration::from_secs(3)));
    }

    #[test]
    fn warns_at_the_interval_then_aborts_and_forgets_what_completed() {
        let mut w = StallWatch::new(StallPolicy {
            warning: Duration::from_secs(10),
            shutdown: Some(Duration::from_secs(25)),
        });
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let partial = vec![(7, vec![1]), (2, vec![0, 3])];
        assert_eq!(w.observe(&partial, at(0)), StallVerdict::Quiet);
        assert_eq!(w.observe(&partial[..1], at(5)), StallVerdict::Quiet);
        // id 2 completed at 5 s and is partial again from 6 s: its clock restarts.
        assert_eq!(w.observe(&partial, at(6)), StallVerdict::Quiet);
        let StallVerdict::Warn(s) = w.observe(&partial, at(10)) else {
            panic!("a warning at 10 s")
        };
        assert_eq!(
            s,
            vec![Stalled {
                id: 7,
                missing: vec![1],
                waited: Duration::from_secs(10)
            }]
        );
        assert_eq!(w.observe(&partial, at(19)), StallVerdict::Quiet);
        let StallVerdict::Warn(s) = w.observe(&partial, at(20)) else {
            panic!("again at 20 s")
        };
        assert_eq!(s.iter().map(|s| s.id).collect::<Vec<_>>(), vec![7, 2]);
        let StallVerdict::Abort(s) = w.observe(&partial, at(25)) else {
            panic!("abort at 25 s")
        };
        assert_eq!(s[0].waited, Duration::from_secs(25));
        assert_eq!(w.observe(&[], at(26)), StallVerdict::Quiet);
    }

    #[test]
    fn without_a_shutdown_limit_it_only_warns() {
        let mut w = StallWatch::new(StallPolicy {
            warning: Duration::from_secs(1),
            shutdown: None,
        });
        let t0 = Instant::now();
        let p = vec![(0, vec![0])];
        w.observe(&p, t0);
        for s in 1..100 {
            let v = w.observe(&p, t0 + Duration::from_secs(s));
            assert!(matches!(v, StallVerdict::Warn(_)), "{v:?}");
        }
    }
}
