//! Optimizer settings, turned into burn's own optimizers (never hand-written ones).

use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, AdamWConfig, ModuleOptimizer, SgdConfig};
use serde::{Deserialize, Serialize};

use crate::error::{EngineError, Result};

/// An optimizer and its settings, as written in a config (`{name: sgd, lr: 0.05, momentum: 0.9}`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "name", rename_all = "lowercase", deny_unknown_fields)]
pub enum OptimizerSpec {
    /// Stochastic gradient descent, optionally with momentum (PyTorch semantics: dampening 0
    /// unless set) and L2 weight decay.
    Sgd {
        /// Learning rate.
        lr: f64,
        /// Momentum factor; 0 turns momentum off.
        #[serde(default)]
        momentum: f64,
        /// Momentum dampening (PyTorch's default 0).
        #[serde(default)]
        dampening: f64,
        /// Nesterov momentum.
        #[serde(default)]
        nesterov: bool,
        /// L2 penalty; 0 turns it off.
        #[serde(default)]
        weight_decay: f32,
    },
    /// Adam.
    Adam {
        /// Learning rate.
        lr: f64,
        /// First-moment decay.
        #[serde(default = "beta1")]
        beta1: f32,
        /// Second-moment decay.
        #[serde(default = "beta2")]
        beta2: f32,
        /// Numerical epsilon.
        #[serde(default = "eps")]
        epsilon: f32,
        /// L2 penalty added to the gradient; 0 turns it off.
        #[serde(default)]
        weight_decay: f32,
    },
    /// AdamW (decoupled weight decay).
    Adamw {
        /// Learning rate.
        lr: f64,
        /// First-moment decay.
        #[serde(default = "beta1")]
        beta1: f32,
        /// Second-moment decay.
        #[serde(default = "beta2")]
        beta2: f32,
        /// Numerical epsilon.
        #[serde(default = "eps")]
        epsilon: f32,
        /// Decoupled weight decay.
        #[serde(default = "adamw_decay")]
        weight_decay: f32,
    },
}

fn beta1() -> f32 {
    0.9
}
fn beta2() -> f32 {
    0.999
}
fn eps() -> f32 {
    1e-8
}
fn adamw_decay() -> f32 {
    1e-2
}

impl Default for OptimizerSpec {
    fn default() -> Self {
        OptimizerSpec::Sgd {
            lr: 0.04,
            momentum: 0.9,
            dampening: 0.0,
            nesterov: false,
            weight_decay: 5e-4,
        }
    }
}

impl OptimizerSpec {
    /// Values of optimizer state kept per parameter (momentum: 1, Adam's moments: 2).
    pub fn state_slots(&self) -> u64 {
        match self {
            OptimizerSpec::Sgd { momentum, .. } => u64::from(*momentum > 0.0),
            OptimizerSpec::Adam { .. } | OptimizerSpec::Adamw { .. } => 2,
        }
    }

    /// The configured learning rate.
    pub fn lr(&self) -> f64 {
        match self {
            OptimizerSpec::Sgd { lr, .. }
            | OptimizerSpec::Adam { lr, .. }
            | OptimizerSpec::Adamw { lr, .. } => *lr,
        }
    }

    /// How much of one update carries into the next: SGD's momentum (0 without), Adam's and
    /// AdamW's first-moment decay. An async peer's weight prediction extrapolates with it.
    pub fn momentum(&self) -> f32 {
        match self {
            OptimizerSpec::Sgd { momentum, .. } => *momentum as f32,
            OptimizerSpec::Adam { beta1, .. } | OptimizerSpec::Adamw { beta1, .. } => *beta1,
        }
    }

    /// Checks the settings' ranges.
    pub fn validate(&self) -> Result<()> {
        let lr = self.lr();
        if !(lr.is_finite() && lr > 0.0) {
            return Err(EngineError::Optimizer(format!(
                "lr must be a positive number, got {lr}"
            )));
        }
        if let OptimizerSpec::Sgd {
            momentum,
            dampening,
            ..
        } = self
            && (!(0.0..1.0).contains(momentum) || !(0.0..=1.0).contains(dampening))
        {
            return Err(EngineError::Optimizer(format!(
                "sgd momentum must be in [0, 1) and dampening in [0, 1], got {momentum} and {dampening}"
            )));
        }
        Ok(())
    }

    /// Builds burn's optimizer for a whole module.
    pub fn build(&self) -> Result<ModuleOptimizer> {
        self.validate()?;
        let decay = |w: f32| (w > 0.0).then(|| WeightDecayConfig::new(w));
        Ok(match *self {
            OptimizerSpec::Sgd {
                momentum,
                dampening,
                nesterov,
                weight_decay,
                ..
            } => {
                let momentum = (momentum > 0.0).then(|| {
                    MomentumConfig::new()
                        .with_momentum(momentum)
                        .with_dampening(dampening)
                        .with_nesterov(nesterov)
                });
                SgdConfig::new()
                    .with_momentum(momentum)
                    .with_weight_decay(decay(weight_decay))
                    .init()
            }
            OptimizerSpec::Adam {
                beta1,
                beta2,
                epsilon,
                weight_decay,
                ..
            } => AdamConfig::new()
                .with_beta_1(beta1)
                .with_beta_2(beta2)
                .with_epsilon(epsilon)
                .with_weight_decay(decay(weight_decay))
                .init(),
            OptimizerSpec::Adamw {
                beta1,
                beta2,
                epsilon,
                weight_decay,
                ..
            } => AdamWConfig::new()
                .with_beta_1(beta1)
                .with_beta_2(beta2)
                .with_epsilon(epsilon)
                .with_weight_decay(weight_decay)
                .init(),
        })
    }
}
