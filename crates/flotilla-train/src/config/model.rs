//! The `model:` section: which model, its initialisation seed, the device it runs on and
//! whether its backward recomputes its forward.

use serde::{Deserialize, Serialize};

/// The model and how it is initialised.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelSection {
    /// A built-in model name (`lenet5`, `mlp`) or a path to a model spec file.
    pub spec: String,
    /// Seed of parameter initialisation and of the per-epoch shuffle.
    pub seed: u64,
    /// Backend: `flex` (pure-Rust CPU), `auto[:N]` (the Vulkan GPU `N` when the build has the
    /// `wgpu` feature and the machine one, else `flex`), `ndarray`, `libtorch` or `wgpu[:N]`
    /// (burn's wgpu backend on Vulkan adapter `N`, default 0), each with the cargo feature of
    /// that name.
    pub device: String,
    /// Recompute each block's forward in backward (activation checkpointing): one block's
    /// activations held at a time instead of all of them, the gradients bit for bit the
    /// same, about one more forward's time. A spec model without dropout or batch norm;
    /// ZeRO stage 3 always recomputes.
    pub recompute: bool,
}

impl Default for ModelSection {
    fn default() -> Self {
        Self {
            spec: "lenet5".into(),
            seed: 42,
            device: "flex".into(),
            recompute: false,
        }
    }
}
