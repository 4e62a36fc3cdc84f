//! Micro-batch schedules: the order in which one stage runs the forward and backward passes
//! of the M micro-batches of a batch.
//!
//! - **GPipe**: every forward, then every backward (in micro-batch order). A stage holds the
//!   activations of all M micro-batches at the end of the forwards.
//! - **1F1B** (PipeDream-flush): stage `s` of `S` first runs `min(S - s - 1, M)` warm-up
//!   forwards, then alternates one forward and one backward, then drains the remaining
//!   backwards. At most `S - s` micro-batches are in flight on stage `s` (never more than S),
//!   so activation memory is bounded by the depth of the pipeline, not by M.
//!
//! Both orders are deadlock-free with buffered point-to-point sends: every stage runs the
//! forwards and the backwards each in micro-batch order, a forward of micro-batch `i` on
//! stage `s` needs only forwards of `i` upstream, and a backward only backwards of `i`
//! downstream, which every schedule above runs before anything that waits on stage `s`.

use serde::{Deserialize, Serialize};

/// Which micro-batch schedule a pipeline runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Schedule {
    /// All forwards, then all backwards.
    #[serde(rename = "gpipe")]
    GPipe,
    /// Warm-up forwards, then one forward and one backward, then the remaining backwards.
    #[default]
    #[serde(rename = "1f1b")]
    OneFOneB,
}

impl std::fmt::Display for Schedule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Schedule::GPipe => "gpipe",
            Schedule::OneFOneB => "1f1b",
        })
    }
}

/// One step of a stage's schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Forward of a micro-batch.
    Forward(usize),
    /// Backward of a micro-batch.
    Backward(usize),
}

impl Schedule {
    /// The actions of stage `stage` of `stages` for `micro_batches` micro-batches.
    pub fn actions(self, stages: usize, stage: usize, micro_batches: usize) -> Vec<Action> {
        let m = micro_batches;
        let mut out = Vec::with_capacity(2 * m);
        match self {
            Schedule::GPipe => {
                out.extend((0..m).map(Action::Forward));
                out.extend((0..m).map(Action::Backward));
            }
            Schedule::OneFOneB => {
                let warmup = stages.saturating_sub(stage + 1).min(m);
                out.extend((0..warmup).map(Action::Forward));
                for (f, b) in (warmup..m).zip(0..) {
                    out.push(Action::Forward(f));
                    out.push(Action::Backward(b));
                }
                out.extend((m - warmup..m).map(Action::Backward));
            }
        }
        out
    }

    /// The most micro-batches in flight at once on stage `stage` (the activation memory the
    /// schedule needs, in micro-batches).
    pub fn peak_in_flight(self, stages: usize, stage: usize, micro_batches: usize) -> usize {
        let mut live = 0usize;
        let mut peak = 0;
        for a in self.actions(stages, stage, micro_batches) {
            match a {
                Action::Forward(_) => live += 1,
                Action::Backward(_) => live = live.saturating_sub(1),
            }
            peak = peak.max(live);
        }
        peak
    }
}

/// Cuts `n` samples into `m` contiguous micro-batches whose sizes differ by at most one.
pub fn micro_batches(n: usize, m: usize) -> Vec<std::ops::Range<usize>> {
    let m = m.max(1);
    let mut start = 0;
    (0..m)
        .map(|i| {
            let len = n / m + usize::from(i < n % m);
            let r = start..start + len;
            start += len;
            r
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use Action::{Backward as B, Forward as F};

    #[test]
    fn micro_batches_cover_the_batch_in_near_equal_parts() {
        assert_eq!(micro_batches(10, 4), vec![0..3, 3..6, 6..8, 8..10]);
        assert_eq!(micro_batches(4, 1), vec![0..4]);
        assert_eq!(micro_batches(2, 0), vec![0..2]);
    }

    #[test]
    fn gpipe_runs_every_forward_then_every_backward() {
        assert_eq!(
            Schedule::GPipe.actions(3, 1, 3),
            vec![F(0), F(1), F(2), B(0), B(1), B(2)]
        );
        assert_eq!(Schedule::GPipe.peak_in_flight(3, 0, 8), 8);
    }

    #[test]
    fn one_f_one_b_warms_up_by_depth_and_bounds_activations() {
        // Four stages, six micro-batches: stage 0 warms up with three forwards.
        assert_eq!(
            Schedule::OneFOneB.actions(4, 0, 6),
            vec![
                F(0),
                F(1),
                F(2),
                F(3),
                B(0),
                F(4),
                B(1),
                F(5),
                B(2),
                B(3),
                B(4),
                B(5)
            ]
        );
        // The last stage alternates from the start.
        assert_eq!(
            Schedule::OneFOneB.actions(4, 3, 3),
            vec![F(0), B(0), F(1), B(1), F(2), B(2)]
        );
        // Fewer micro-batches than stages: all forwards, then all backwards.
        assert_eq!(
            Schedule::OneFOneB.actions(4, 0, 2),
            vec![F(0), F(1), B(0), B(1)]
        );
        for s in 0..4 {
            assert_eq!(Schedule::OneFOneB.peak_in_flight(4, s, 16), 4 - s);
        }
    }

    #[test]
    fn every_schedule_runs_each_micro_batch_once_each_way_in_order() {
        for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
            for stages in 1..5 {
                for stage in 0..stages {
                    for m in 1..7 {
                        let acts = schedule.actions(stages, stage, m);
                        let fw: Vec<usize> = acts
                            .iter()
                            .filter_map(|a| match a {
                                F(i) => Some(*i),
                                B(_) => None,
                            })
                            .collect();
                        let bw: Vec<usize> = acts
                            .iter()
                            .filter_map(|a| match a {
                                B(i) => Some(*i),
                                F(_) => None,
                            })
                            .collect();
                        let order: Vec<usize> = (0..m).collect();
                        assert_eq!((&fw, &bw), (&order, &order), "{schedule} {stage}/{stages}");
                        // A backward never precedes its own forward.
                        for (i, a) in acts.iter().enumerate() {
                            if let B(k) = a {
                                assert!(acts[..i].contains(&F(*k)));
                            }
                        }
                    }
                }
            }
        }
    }
}
