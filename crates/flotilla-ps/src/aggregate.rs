//! Checking and averaging pushes: pure logic, no sockets, so that "a bad push changes
//! nothing" is testable directly.

/// How a server takes pushes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Admission {
    /// Every push must be computed on the current version.
    Sync,
    /// Pushes may be stale, up to `max_staleness` versions behind (unbounded if `None`).
    Async {
        /// Largest accepted staleness.
        max_staleness: Option<u64>,
    },
}

/// Why a push was refused, and whether its sender may retry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// What was wrong with it, for the sender's error and the server's log.
    pub reason: String,
    /// `true` when another push may be taken: this one was stale, or its values (computed
    /// on one batch) were not finite or too large; the sender pulls and pushes again, a
    /// bounded number of times in a row. `false` when every retry would be refused alike (its
    /// length, its kind, the samples it claims, a version the server has not reached): the
    /// sender stops, naming the reason, instead of pulling and pushing without end.
    pub retry: bool,
}

impl Refusal {
    /// A push that a later one may replace: pull and recompute.
    pub fn retry(reason: impl Into<String>) -> Self {
        Self {
            reason: reason.into(),
            retry: true,
        }
    }

    /// A push that no retry can make acceptable.
    pub fn lasting(reason: impl Into<String>) -> Self {
        Self {
            reason: reason.into(),
            retry: false,
        }
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.reason)
    }
}

/// Checks a push against the server's state; `Ok(staleness)` or why it is refused.
pub fn admit(
    admission: Admission,
    current_version: u64,
    expected_len: usize,
    expect_delta: bool,
    version: u64,
    delta: bool,
    values: &[f32],
) -> Result<u64, Refusal> {
    if values.len() != expected_len {
        return Err(Refusal::lasting(format!(
            "push has {} values but the model has {expected_len} parameters",
            values.len()
        )));
    }
    if delta != expect_delta {
        let (got, want) = if delta {
            ("a weight delta", "gradients")
        } else {
            ("a gradient", "weight deltas (model averaging)")
        };
        return Err(Refusal::lasting(format!(
            "push carries {got} but this server takes {want}"
        )));
    }
    if version > current_version {
        return Err(Refusal::lasting(format!(
            "push claims parameter version {version} but the server is only at version {current_version}"
        )));
    }
    let staleness = current_version - version;
    match admission {
        Admission::Sync if staleness != 0 => {
            return Err(Refusal::retry(format!(
                "push computed on version {version} but this sync round is on version {current_version}"
            )));
        }
        Admission::Async {
            max_staleness: Some(max),
        } if staleness > max => {
            return Err(Refusal::retry(format!(
                "push is {staleness} versions stale, more than max_staleness {max}: pull and recompute"
            )));
        }
        _ => {}
    }
    if let Some(i) = values.iter().position(|v| !v.is_finite()) {
        return Err(Refusal::retry(format!(
            "push has a non-finite value at index {i} ({})",
            values[i]
        )));
    }
    Ok(staleness)
}

/// Checks the averaging weight a push claims: at most `max` samples, what its sender can
/// have computed it on (a worker: its batch size times its local steps; a local server: that
/// times its workers). A claim above it would let one push outweigh the others (`u32::MAX`
/// drowns every other push of the round).
pub fn check_samples(samples: u32, max: u64) -> Result<(), Refusal> {
    if u64::from(samples) > max {
        return Err(Refusal::lasting(format!(
            "push claims {samples} samples, more than the {max} its sender can have trained on \
             (batch size x accumulation steps x local steps x workers)"
        )));
    }
    Ok(())
}

/// The largest magnitude a round's weighted sum may reach: half of `f32::MAX`, so that the
/// sum of the pushes in any order, with its rounding, stays finite.
const SUM_LIMIT: f64 = f32::MAX as f64 / 2.0;

/// A sample-weighted sum of admitted pushes. An ordered accumulator (sync rounds) keeps the
/// pushes until [`Accumulator::take`] and sums them in child-rank order, so that a round's
/// result does not depend on the order in which pushes arrived (runs are reproducible); an
/// unordered one (async) sums on arrival.
#[derive(Debug, Clone)]
pub struct Accumulator {
    held: Option<std::collections::BTreeMap<usize, Held>>,
    sum: Vec<f32>,
    samples: u64,
    /// Sample-weighted sum of the versions the pushes were computed from (minus their own
    /// staleness), for the staleness of the mean.
    version_sum: f64,
    loss_sum: f64,
    pushes: usize,
    /// A bound of every element's magnitude in the sum of this round's pushes:
    /// Σ samples × max |value|.
    bound: f64,
}

/// A push kept by an ordered accumulator: samples, loss, base version, values.
type Held = (u32, f32, f64, Vec<f32>);

/// The sample-weighted mean of the pushes gathered since the last [`Accumulator::take`].
#[derive(Debug, Clone, PartialEq)]
pub struct Mean {
    /// The weighted mean values.
    pub values: Vec<f32>,
    /// Total samples behind it.
    pub samples: u64,
    /// Sample-weighted mean loss.
    pub loss: f32,
    /// Number of pushes.
    pub pushes: usize,
    /// Sample-weighted mean base version of the pushes (each push's version minus the
    /// staleness it already carried).
    pub base_version: f64,
}

impl Accumulator {
    /// An empty accumulator for `len` values that sums pushes in child order at
    /// [`Accumulator::take`] (for sync rounds), or on arrival if `ordered` is false.
    pub fn new(len: usize, ordered: bool) -> Self {
        Self {
            held: ordered.then(Default::default),
            sum: vec![0.0; len],
            samples: 0,
            version_sum: 0.0,
            loss_sum: 0.0,
            pushes: 0,
            bound: 0.0,
        }
    }

    /// Whether nothing has been added since the last take.
    pub fn is_empty(&self) -> bool {
        self.pushes == 0 && self.held.as_ref().is_none_or(|h| h.is_empty())
    }

    /// Adds `child`'s admitted push (its length was checked by [`admit`]) computed from
    /// `base_version` (its version minus the staleness it carried), or refuses it, changing
    /// nothing, when its finite values weighted by `samples` could make the round's sum
    /// overflow to infinity (the mean would then not be finite).
    pub fn add(
        &mut self,
        child: usize,
        samples: u32,
        loss: f32,
        base_version: f64,
        values: Vec<f32>,
    ) -> Result<(), Refusal> {
        let largest = values.iter().fold(0.0f64, |m, v| m.max(f64::from(v.abs())));
        let bound = self.bound + f64::from(samples) * largest;
        if bound > SUM_LIMIT {
            return Err(Refusal::retry(format!(
                "push of values up to {largest:e} weighted by {samples} samples would overflow \
                 the round's sum (its weighted values must stay below {SUM_LIMIT:e} in all)"
            )));
        }
        self.bound = bound;
        match &mut self.held {
            Some(held) => {
                held.insert(child, (samples, loss, base_version, values));
            }
            None => self.sum_in(samples, loss, base_version, &values),
        }
        Ok(())
    }

    fn sum_in(&mut self, samples: u32, loss: f32, base_version: f64, values: &[f32]) {
        self.version_sum += base_version * samples as f64;
        let w = samples as f32;
        for (s, v) in self.sum.iter_mut().zip(values) {
            *s += w * v;
        }
        self.samples += samples as u64;
        self.loss_sum += loss as f64 * samples as f64;
        self.pushes += 1;
    }

    /// The weighted mean so far, resetting the accumulator; `None` if empty.
    pub fn take(&mut self) -> Option<Mean> {
        if let Some(held) = self.held.take() {
            for (samples, loss, base, values) in held.values() {
                self.sum_in(*samples, *loss, *base, values);
            }
            self.held = Some(Default::default());
        }
        if self.pushes == 0 || self.samples == 0 {
            return None;
        }
        let scale = 1.0 / self.samples as f32;
        let values = self.sum.iter().map(|s| s * scale).collect();
        self.sum.iter_mut().for_each(|s| *s = 0.0);
        let mean = Mean {
            values,
            samples: self.samples,
            loss: (self.loss_sum / self.samples as f64) as f32,
            pushes: self.pushes,
            base_version: self.version_sum / self.samples as f64,
        };
        self.version_sum = 0.0;
        self.samples = 0;
        self.loss_sum = 0.0;
        self.pushes = 0;
        self.bound = 0.0;
        Some(mean)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SYNC: Admission = Admission::Sync;

    #[test]
    fn wrong_length_version_kind_or_values_are_rejected_with_reasons() {
        let ok = [1.0, 2.0, 3.0];
        assert_eq!(admit(SYNC, 4, 3, false, 4, false, &ok), Ok(0));
        let e = admit(SYNC, 4, 3, false, 4, false, &ok[..2]).expect_err("len");
        assert!(!e.retry, "{e}");
        let e = e.reason;
        assert!(e.contains("2 values") && e.contains("3 parameters"), "{e}");
        let e = admit(SYNC, 4, 3, false, 3, false, &ok).expect_err("stale in sync");
        assert!(e.retry, "{e}");
        let e = e.reason;
        assert!(e.contains("version 3") && e.contains("version 4"), "{e}");
        let e = admit(SYNC, 4, 3, false, 9, false, &ok).expect_err("future");
        assert!(!e.retry, "{e}");
        let e = e.reason;
        assert!(e.contains("only at version 4"), "{e}");
        let e = admit(SYNC, 4, 3, false, 4, true, &ok).expect_err("kind");
        assert!(!e.retry, "{e}");
        let e = e.reason;
        assert!(e.contains("weight delta"), "{e}");
        let e = admit(SYNC, 4, 3, false, 4, false, &[1.0, f32::NAN, 0.0]).expect_err("nan");
        assert!(e.retry, "{e}");
        let e = e.reason;
        assert!(e.contains("index 1"), "{e}");
        let a = Admission::Async {
            max_staleness: Some(2),
        };
        assert_eq!(admit(a, 10, 3, false, 8, false, &ok), Ok(2));
        let e = admit(a, 10, 3, false, 7, false, &ok).expect_err("too stale");
        assert!(e.retry, "{e}");
        let e = e.reason;
        assert!(
            e.contains("3 versions stale") && e.contains("max_staleness 2"),
            "{e}"
        );
        let unbounded = Admission::Async {
            max_staleness: None,
        };
        assert_eq!(admit(unbounded, 10, 3, false, 0, false, &ok), Ok(10));
    }

    #[test]
    fn mean_is_sample_weighted_and_resets() {
        let mut acc = Accumulator::new(2, false);
        assert!(acc.take().is_none());
        acc.add(7, 1, 1.0, 4.0, vec![1.0, 10.0]).expect("add");
        acc.add(3, 3, 2.0, 8.0, vec![5.0, 2.0]).expect("add");
        let m = acc.take().expect("mean");
        assert_eq!(m.values, vec![4.0, 4.0]);
        assert_eq!((m.samples, m.pushes), (4, 2));
        assert!((m.loss - 1.75).abs() < 1e-6);
        assert!((m.base_version - 7.0).abs() < 1e-12);
        assert!(acc.is_empty() && acc.take().is_none());
    }

    /// A claim of more samples than the sender can have is refused; finite values whose
    /// weighted sum overflows are refused before they are summed, and the round goes on with
    /// the others (its mean finite and unchanged by the refused push).
    #[test]
    fn a_huge_claim_or_an_overflowing_push_is_refused_and_changes_nothing() {
        assert!(check_samples(64, 64).is_ok());
        let e = check_samples(u32::MAX, 64).expect_err("u32::MAX samples");
        assert!(!e.retry, "{e}");
        let e = e.reason;
        assert!(e.contains("4294967295 samples") && e.contains("64"), "{e}");
        for ordered in [false, true] {
            let mut acc = Accumulator::new(2, ordered);
            acc.add(1, 2, 0.5, 0.0, vec![1.0, -3.0]).expect("add");
            // Each value finite, their weighted sum not: 3e38 x 2 samples.
            let e = acc
                .add(2, 2, 0.5, 0.0, vec![3e38, 1.0])
                .expect_err("overflow");
            assert!(e.reason.contains("overflow") && e.retry, "{e}");
            let e = acc
                .add(3, u32::MAX, 0.5, 0.0, vec![1e30, 1.0])
                .expect_err("overflow by weight");
            assert!(e.reason.contains("overflow") && e.retry, "{e}");
            let m = acc.take().expect("mean");
            assert_eq!((m.values, m.samples, m.pushes), (vec![1.0, -3.0], 2, 1));
        }
    }

    #[test]
    fn an_ordered_sum_does_not_depend_on_arrival_order() {
        // Values whose f32 sum depends on the order of addition.
        let pushes = [
            (1usize, vec![1e8f32]),
            (2, vec![1.0]),
            (3, vec![-1e8]),
            (4, vec![1.0]),
        ];
        let mut results = Vec::new();
        for order in [[0, 1, 2, 3], [3, 2, 1, 0], [1, 3, 0, 2]] {
            let mut acc = Accumulator::new(1, true);
            for i in order {
                let (child, v) = &pushes[i];
                acc.add(*child, 1, 0.0, 0.0, v.clone()).expect("add");
            }
            results.push(acc.take().expect("mean").values[0].to_bits());
        }
        assert!(results.iter().all(|r| *r == results[0]), "{results:?}");
    }
}
