//! Is the run learning? A pure check fed by the run loop with every training loss and test
//! accuracy of the rank that judges the run (a peer, a pipeline stage, a parameter-server
//! root), so that a run that diverges or stays at chance says so instead of ending quietly
//! with a useless model.
//!
//! - **Diverged**: a loss that is NaN or infinite.
//! - **Not learning**: after `check_after` steps or rounds, a test accuracy at chance
//!   (at most `1/classes + CHANCE_MARGIN`), or a recent mean loss not clearly below the
//!   initial one (above `NOT_BELOW` of it). The initial loss is the larger of the first
//!   losses seen and `ln(classes)` (an untrained model's cross-entropy), so that a resumed
//!   run, whose first losses are already low, is not judged against them.
//!
//! Each kind of verdict is given once; the caller warns or stops (`abort_on_divergence`).

/// Accuracy above chance (`1 / classes`) that still counts as chance.
pub const CHANCE_MARGIN: f64 = 0.05;

/// A recent mean loss above this fraction of the initial mean loss is "not below it".
pub const NOT_BELOW: f64 = 0.9;

/// Losses averaged for the initial and for the recent loss.
pub const WINDOW: usize = 20;

/// Default of `schedule.divergence_check_rounds`: steps (or server rounds) after which a run
/// still at chance is "not learning". LeNet-5 and the MLP pass 90 % on MNIST within about
/// 200 steps at any learning rate that trains; 500 leaves room for warm-up (300 steps by
/// default) and is about one epoch of the default 2-rank run (469 steps).
pub const DEFAULT_CHECK_ROUNDS: u64 = 500;

/// What the check found.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// The loss is NaN or infinite.
    Diverged {
        /// The step or round.
        step: u64,
        /// The loss.
        loss: f32,
    },
    /// Past the check, the run is no better than chance.
    NotLearning {
        /// The step or round.
        step: u64,
        /// What shows it (the accuracy, or the losses).
        evidence: String,
    },
}

impl Verdict {
    /// Whether the loss went non-finite (rather than staying at chance).
    pub fn is_nan(&self) -> bool {
        matches!(self, Verdict::Diverged { .. })
    }
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Verdict::Diverged { step, loss } => {
                write!(f, "training diverged: loss is {loss} at step {step}")
            }
            Verdict::NotLearning { step, evidence } => {
                write!(f, "training is not learning after {step} steps: {evidence}")
            }
        }
    }
}

/// The running check of one rank.
#[derive(Debug, Clone)]
pub struct DivergenceCheck {
    check_after: u64,
    chance: f64,
    chance_loss: f64,
    initial: Vec<f64>,
    recent: std::collections::VecDeque<f64>,
    nan_told: bool,
    stuck_told: bool,
}

impl DivergenceCheck {
    /// A check that judges "not learning" from step `check_after` on (0: never), for a
    /// model of `classes` classes.
    pub fn new(check_after: u64, classes: usize) -> Self {
        Self {
            check_after,
            chance: 1.0 / classes.max(1) as f64,
            chance_loss: (classes.max(1) as f64).ln(),
            initial: Vec::with_capacity(WINDOW),
            recent: std::collections::VecDeque::with_capacity(WINDOW),
            nan_told: false,
            stuck_told: false,
        }
    }

    /// A training loss at `step`; a verdict the first time one is due.
    pub fn loss(&mut self, step: u64, loss: f32) -> Option<Verdict> {
        if !loss.is_finite() {
            if self.nan_told {
                return None;
            }
            self.nan_told = true;
            return Some(Verdict::Diverged { step, loss });
        }
        let l = f64::from(loss);
        if self.initial.len() < WINDOW {
            self.initial.push(l);
        }
        if self.recent.len() == WINDOW {
            self.recent.pop_front();
        }
        self.recent.push_back(l);
        if !self.due(step) || self.recent.len() < WINDOW {
            return None;
        }
        let first = mean(self.initial.iter()).max(self.chance_loss);
        let last = mean(self.recent.iter());
        if last > NOT_BELOW * first {
            return self.stuck(
                step,
                format!(
                    "mean training loss {last:.4} over the last {WINDOW} steps is not below {:.0}% of the initial {first:.4}",
                    NOT_BELOW * 100.0
                ),
            );
        }
        None
    }

    /// A test accuracy at `step`; a verdict if it is at chance past the check.
    pub fn accuracy(&mut self, step: u64, accuracy: f64) -> Option<Verdict> {
        if !self.due(step) || accuracy > self.chance + CHANCE_MARGIN {
            return None;
        }
        self.stuck(
            step,
            format!(
                "test accuracy {accuracy:.4} is at chance ({:.2} for {} classes)",
                self.chance,
                (1.0 / self.chance).round()
            ),
        )
    }

    fn due(&self, step: u64) -> bool {
        self.check_after > 0 && step >= self.check_after && !self.stuck_told
    }

    fn stuck(&mut self, step: u64, evidence: String) -> Option<Verdict> {
        self.stuck_told = true;
        Some(Verdict::NotLearning { step, evidence })
    }
}

/// What to change, for the message of a verdict: the learning rate (`lr`), and for a
/// parameter server with async levels (`async_momentum`: the momentum its root runs and the
/// one suggested for its staleness) the async settings; then how to check later or only
/// warn.
pub fn advice(verdict: &Verdict, lr: f64, async_momentum: Option<(f64, f64)>) -> String {
    let mut out = format!("lower the learning rate (optimizer.lr, now {lr})");
    if let Some((now, suggested)) = async_momentum {
        out.push_str(&format!(
            ", or for async servers keep topology.staleness_lr on and lower the server's momentum (now {now:.2}; topology.async_momentum: {suggested:.2} makes up for the momentum that staleness adds)"
        ));
    }
    if !verdict.is_nan() {
        out.push_str(
            "; schedule.divergence_check_rounds checks later, abort_on_divergence: false only warns",
        );
    }
    out
}

/// Whether a verdict stops the run: `abort` is `schedule.abort_on_divergence` (unset: stop
/// on a NaN or infinite loss, warn when not learning).
pub fn aborts(verdict: &Verdict, abort: Option<bool>) -> bool {
    abort.unwrap_or(verdict.is_nan())
}

fn mean<'a>(values: impl Iterator<Item = &'a f64>) -> f64 {
    let (sum, n) = values.fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    sum / n.max(1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nan_or_infinite_loss_is_divergence_told_once() {
        let mut c = DivergenceCheck::new(500, 10);
        assert_eq!(c.loss(1, 2.3), None);
        let v = c.loss(7, f32::NAN).expect("nan");
        assert!(v.is_nan() && v.to_string().contains("NaN at step 7"), "{v}");
        assert_eq!(c.loss(8, f32::INFINITY), None);
        let mut c = DivergenceCheck::new(0, 10);
        assert!(c.loss(1, f32::NEG_INFINITY).expect("inf").is_nan());
    }

    #[test]
    fn a_loss_that_stays_up_is_not_learning_only_after_the_check() {
        let mut c = DivergenceCheck::new(100, 10);
        for step in 1..100 {
            assert_eq!(c.loss(step, 2.30), None, "step {step}");
        }
        let v = c.loss(100, 2.29).expect("stuck");
        assert!(!v.is_nan());
        assert!(
            v.to_string().contains("not learning after 100 steps"),
            "{v}"
        );
        // Told once.
        assert_eq!(c.loss(101, 2.3), None);
        assert_eq!(c.accuracy(102, 0.1), None);
    }

    #[test]
    fn a_falling_loss_and_a_good_accuracy_pass() {
        let mut c = DivergenceCheck::new(100, 10);
        for step in 1..=300 {
            let loss = 2.3 * (-(step as f32) / 50.0).exp() + 0.05;
            assert_eq!(c.loss(step, loss), None, "step {step}");
        }
        assert_eq!(c.accuracy(300, 0.97), None);
        // A collapse later is still seen.
        let v = c.accuracy(400, 0.1135).expect("chance");
        assert!(v.to_string().contains("0.1135") && v.to_string().contains("chance"));
    }

    #[test]
    fn advice_names_what_to_change_and_abort_defaults_to_nan_only() {
        let nan = Verdict::Diverged {
            step: 3,
            loss: f32::NAN,
        };
        let stuck = Verdict::NotLearning {
            step: 500,
            evidence: "x".into(),
        };
        let a = advice(&nan, 10.0, None);
        assert!(a.contains("now 10") && !a.contains("async"), "{a}");
        let a = advice(&stuck, 0.04, Some((0.9, 0.6)));
        assert!(
            a.contains("(now 0.90; topology.async_momentum: 0.60")
                && a.contains("staleness_lr")
                && a.contains("divergence_check_rounds"),
            "{a}"
        );
        assert!(aborts(&nan, None) && !aborts(&stuck, None));
        assert!(aborts(&stuck, Some(true)) && !aborts(&nan, Some(false)));
    }

    #[test]
    fn chance_accuracy_counts_only_from_the_check_and_never_when_off() {
        let mut c = DivergenceCheck::new(500, 10);
        assert_eq!(c.accuracy(250, 0.1), None);
        assert_eq!(c.accuracy(500, 0.16), None);
        assert!(c.accuracy(750, 0.15).is_some());
        // A resumed run starts low and stays low: that is learning.
        let mut resumed = DivergenceCheck::new(100, 10);
        for step in 1000..1300 {
            let loss = if step % 2 == 0 { 0.04 } else { 0.07 };
            assert_eq!(resumed.loss(step, loss), None, "step {step}");
        }
        let mut off = DivergenceCheck::new(0, 10);
        assert_eq!(off.accuracy(10_000, 0.1), None);
        for step in 1..1000 {
            assert_eq!(off.loss(step, 2.3), None);
        }
    }
}
