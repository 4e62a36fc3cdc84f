//! Optimizers and their state: the settings turned into burn's optimizers (here), burn's
//! optimizer on one rank's shard for ZeRO ([`shard_optim`]), optimizer state re-cut for other
//! shards ([`reshard`], and one shard's from files, reading only what it needs: [`recut`]) and checked against the parameters' shapes before burn takes it
//! ([`state_check`]).
//!
//! Here, optimizer settings, turned into burn's own optimizers (never hand-written ones).
//!
//! Weight decay applies to every parameter, or with `decay_params: matrices` only to the
//! parameters of two or more dimensions (linear and convolution weights, token and positional
//! embeddings), never to biases nor to the weights and biases of normalizations: the rule of
//! nanoGPT and of PyTorch GPT recipes (`p.dim() >= 2`). It is built with burn's parameter
//! groups (`ModuleOptimizer::with_group`, a `ParamGroup` of the module's matrix parameter
//! ids): the optimizer without decay for every parameter, the same optimizer with decay for
//! the matrices. Parameter ids are positions in flat order (`params::renumber`), so the groups
//! and the saved optimizer state agree across ranks and across a resume.

pub(crate) mod offload;
pub(crate) mod offload_dirs;
pub(crate) mod recut;
mod recut_field;
pub(crate) mod reshard;
pub(crate) mod shard_optim;
pub(crate) mod state_check;

#[cfg(test)]
mod offload_tests;
#[cfg(test)]
mod optim_tests;
#[cfg(test)]
mod recut_tests;
#[cfg(test)]
mod reshard_tests;
#[cfg(test)]
mod shard_optim_tests;

use burn::module::{Module, ModuleVisitor, Param, ParamGroup, ParamId};
use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, AdamWConfig, ModuleOptimizer, Optimizer, SgdConfig};
use burn::prelude::Tensor;
use serde::{Deserialize, Serialize};

use crate::buffers::{Only, Tensors};
use crate::error::{EngineError, Result};

/// Which parameters an optimizer's weight decay applies to.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DecayParams {
    /// Every parameter (PyTorch's default for an optimizer's `weight_decay`).
    #[default]
    All,
    /// Only parameters of two or more dimensions: linear and convolution weights and
    /// embeddings (token and positional) decay; biases and normalizations' weights and biases
    /// do not (nanoGPT's rule).
    Matrices,
}

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
        /// Which parameters `weight_decay` applies to.
        #[serde(default)]
        decay_params: DecayParams,
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
        /// Which parameters `weight_decay` applies to.
        #[serde(default)]
        decay_params: DecayParams,
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
        /// Which parameters `weight_decay` applies to.
        #[serde(default)]
        decay_params: DecayParams,
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
            decay_params: DecayParams::All,
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

    /// The configured weight decay and the parameters it applies to.
    pub fn weight_decay(&self) -> (f32, DecayParams) {
        match self {
            OptimizerSpec::Sgd {
                weight_decay,
                decay_params,
                ..
            }
            | OptimizerSpec::Adam {
                weight_decay,
                decay_params,
                ..
            }
            | OptimizerSpec::Adamw {
                weight_decay,
                decay_params,
                ..
            } => (*weight_decay, *decay_params),
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
        let (weight_decay, decay_params) = self.weight_decay();
        if !(weight_decay.is_finite() && weight_decay >= 0.0) {
            return Err(EngineError::Optimizer(format!(
                "weight_decay must be a number >= 0, got {weight_decay}"
            )));
        }
        if decay_params == DecayParams::Matrices && weight_decay == 0.0 {
            return Err(EngineError::Optimizer(
                "decay_params: matrices chooses the parameters weight decay applies to, \
                 but weight_decay is 0"
                    .to_string(),
            ));
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

    /// Builds burn's optimizer for `module` (the module it will step: its parameter ids
    /// choose the group that decays with `decay_params: matrices`).
    pub fn build<M: Module>(&self, module: &M) -> Result<ModuleOptimizer> {
        self.build_with_matrices(matrix_ids(module))
    }

    /// Builds burn's optimizer for a module whose parameters of two or more dimensions
    /// (those that decay with `decay_params: matrices`) have the ids `matrices`: for a
    /// module that holds pieces of the model's parameters, flattened
    /// ([`crate::ShardOptimizer`]).
    pub(crate) fn build_with_matrices(&self, matrices: Vec<ParamId>) -> Result<ModuleOptimizer> {
        self.validate()?;
        let (weight_decay, decay_params) = self.weight_decay();
        let groups = Groups {
            weight_decay,
            decay_params,
            matrices: match decay_params {
                DecayParams::All => Vec::new(),
                DecayParams::Matrices => matrices,
            },
        };
        Ok(match *self {
            OptimizerSpec::Sgd {
                momentum,
                dampening,
                nesterov,
                ..
            } => groups.build(|w| {
                let momentum = (momentum > 0.0).then(|| {
                    MomentumConfig::new()
                        .with_momentum(momentum)
                        .with_dampening(dampening)
                        .with_nesterov(nesterov)
                });
                SgdConfig::new()
                    .with_momentum(momentum)
                    .with_weight_decay((w > 0.0).then(|| WeightDecayConfig::new(w)))
                    .build()
            }),
            OptimizerSpec::Adam {
                beta1,
                beta2,
                epsilon,
                ..
            } => groups.build(|w| {
                AdamConfig::new()
                    .with_beta_1(beta1)
                    .with_beta_2(beta2)
                    .with_epsilon(epsilon)
                    .with_weight_decay((w > 0.0).then(|| WeightDecayConfig::new(w)))
                    .build()
            }),
            OptimizerSpec::Adamw {
                beta1,
                beta2,
                epsilon,
                ..
            } => groups.build(|w| {
                AdamWConfig::new()
                    .with_beta_1(beta1)
                    .with_beta_2(beta2)
                    .with_epsilon(epsilon)
                    .with_weight_decay(w)
                    .build()
            }),
        })
    }
}

/// The weight decay and the parameter group it applies to.
struct Groups {
    weight_decay: f32,
    decay_params: DecayParams,
    /// The ids of the matrix parameters (with [`DecayParams::Matrices`]).
    matrices: Vec<ParamId>,
}

impl Groups {
    /// One optimizer made by `make` (given a weight decay) for every parameter, or, with
    /// [`DecayParams::Matrices`], one without decay for every parameter and one with it for
    /// the matrices (burn's last matching group wins).
    fn build<O: Optimizer>(self, make: impl Fn(f32) -> O) -> ModuleOptimizer {
        match self.decay_params {
            DecayParams::All => ModuleOptimizer::from(make(self.weight_decay)),
            DecayParams::Matrices => ModuleOptimizer::from(make(0.0)).with_group(
                ParamGroup::from_ids(self.matrices),
                make(self.weight_decay),
                None,
            ),
        }
    }
}

/// The ids of `module`'s parameters of two or more dimensions (not its buffers).
fn matrix_ids<M: Module>(module: &M) -> Vec<ParamId> {
    struct Matrices(Vec<ParamId>);
    impl ModuleVisitor for Matrices {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if D >= 2 {
                self.0.push(param.id);
            }
        }
    }
    let mut found = Matrices(Vec::new());
    module.visit(&mut Only::new(&mut found, Tensors::Params));
    found.0
}
