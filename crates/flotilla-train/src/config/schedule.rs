//! The `schedule:` section: how long to train, the learning-rate schedule, evaluation,
//! checkpoints and stopping.

use serde::{Deserialize, Serialize};

/// How the learning rate changes over the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LrSchedule {
    /// The optimizer's `lr` throughout.
    Constant,
    /// Cosine decay from `lr` to `lr × min_lr_ratio` over the run's steps (after the
    /// warm-up).
    #[default]
    Cosine,
}

impl LrSchedule {
    /// The learning rate at `step` (0-based) of `total` steps, with a linear warm-up over the
    /// first `warmup` steps; a cosine ends at 0.
    pub fn lr_at(self, base: f64, step: u64, total: u64, warmup: u64) -> f64 {
        self.lr_at_floor(base, step, total, warmup, 0.0)
    }

    /// As [`LrSchedule::lr_at`], a cosine ending at `base × min_ratio` at the last step.
    pub fn lr_at_floor(self, base: f64, step: u64, total: u64, warmup: u64, min_ratio: f64) -> f64 {
        if step < warmup {
            return base * (step + 1) as f64 / warmup as f64;
        }
        match self {
            LrSchedule::Constant => base,
            LrSchedule::Cosine => {
                let span = total.saturating_sub(warmup).max(1) as f64;
                let t = (step - warmup) as f64 / span;
                let cosine = 0.5 * (1.0 + (std::f64::consts::PI * t.min(1.0)).cos());
                base * (min_ratio + (1.0 - min_ratio) * cosine)
            }
        }
    }
}

/// How long to train, the learning-rate schedule, evaluation, checkpoints and stopping.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ScheduleSection {
    /// Passes over the training set.
    pub epochs: u32,
    /// Stop after this many steps in total (for quick runs and tests).
    pub max_steps: Option<u64>,
    /// Learning-rate schedule over the run.
    pub lr_schedule: LrSchedule,
    /// Steps of linear learning-rate warm-up.
    pub warmup_steps: u64,
    /// The cosine schedule's last learning rate as a share of `lr` (0: decays to 0).
    pub min_lr_ratio: f64,
    /// Evaluate on the test set every this many epochs (0: only at the end). For parameter
    /// servers: every this many server rounds (default: one epoch's worth of rounds).
    pub eval_every: Option<u32>,
    /// Data-parallel peers: also evaluate every this many steps within an epoch (a text's
    /// epoch is long), checking `target_accuracy` and `target_loss` there.
    pub eval_every_steps: Option<u64>,
    /// Write a checkpoint every this many steps (0: only at the end).
    pub checkpoint_every: u64,
    /// Resume from the newest checkpoint in `telemetry.output` if there is one.
    pub resume: bool,
    /// Parameter servers: stop after this many server rounds (default: `epochs` worth).
    pub num_server_rounds: Option<u64>,
    /// Stop as soon as the test accuracy reaches this (checked by a parameter-server root
    /// every `eval_every` rounds, by peers every `eval_every_steps` steps).
    pub target_accuracy: Option<f64>,
    /// Stop as soon as the test (validation) loss in nats falls to this, where
    /// `target_accuracy` is checked.
    pub target_loss: Option<f64>,
    /// After this many steps (parameter servers: rounds) a run whose test accuracy is at
    /// chance or whose loss is not below its initial value is "not learning" (0: never
    /// check). A NaN or infinite loss is "diverged" at any step. See [`crate::divergence`].
    pub divergence_check_rounds: u64,
    /// What a run that diverged or is not learning does: `true` stops it with an error,
    /// `false` warns and goes on; unset (default) stops on a NaN or infinite loss and warns
    /// when the run is not learning.
    pub abort_on_divergence: Option<bool>,
}

impl Default for ScheduleSection {
    fn default() -> Self {
        Self {
            epochs: 5,
            max_steps: None,
            lr_schedule: LrSchedule::Cosine,
            warmup_steps: 300,
            min_lr_ratio: 0.0,
            eval_every: None,
            eval_every_steps: None,
            checkpoint_every: 0,
            resume: false,
            num_server_rounds: None,
            target_accuracy: None,
            target_loss: None,
            divergence_check_rounds: crate::divergence::DEFAULT_CHECK_ROUNDS,
            abort_on_divergence: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::LrSchedule;

    #[test]
    fn cosine_decays_from_base_to_zero_after_warmup() {
        let s = LrSchedule::Cosine;
        assert!((s.lr_at(0.1, 0, 100, 10) - 0.01).abs() < 1e-12);
        assert!((s.lr_at(0.1, 9, 100, 10) - 0.1).abs() < 1e-12);
        assert!((s.lr_at(0.1, 10, 100, 10) - 0.1).abs() < 1e-12);
        assert!((s.lr_at(0.1, 55, 100, 10) - 0.05).abs() < 1e-12);
        assert!(s.lr_at(0.1, 99, 100, 10) < 0.001);
        assert_eq!(LrSchedule::Constant.lr_at(0.1, 50, 100, 0), 0.1);
    }

    #[test]
    fn cosine_with_a_floor_ends_at_its_share_of_the_peak() {
        let s = LrSchedule::Cosine;
        // Warm-up 100 of 1000 steps, to 10 % of 1e-3.
        assert!((s.lr_at_floor(1e-3, 99, 1000, 100, 0.1) - 1e-3).abs() < 1e-15);
        assert!((s.lr_at_floor(1e-3, 550, 1000, 100, 0.1) - 0.55e-3).abs() < 1e-12);
        assert!((s.lr_at_floor(1e-3, 1000, 1000, 100, 0.1) - 1e-4).abs() < 1e-15);
        assert_eq!(
            s.lr_at_floor(0.1, 37, 100, 10, 0.0),
            s.lr_at(0.1, 37, 100, 10)
        );
    }
}
