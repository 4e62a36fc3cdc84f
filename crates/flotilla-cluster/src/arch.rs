//! The training architecture, on its own so that specs and errors can both name it.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The training architecture: how gradients travel between processes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// Collective all-reduce among peers; no servers. The default when `arch` is absent.
    #[default]
    Allreduce,
    /// One tier of parameter servers (`parameter_server`, optionally sharded by `servers`).
    Flat,
    /// A global server over local servers, each with its own workers (`global_server`).
    Hierarchical,
    /// Model parallel: the model's layers cut into stages, one rank per stage of each of
    /// `data_parallel` replicas; activations and gradients go point to point between stages.
    Pipeline,
}

impl Arch {
    /// The config spelling of the architecture (`allreduce`, `flat`, `hierarchical`, `pipeline`).
    pub fn as_str(self) -> &'static str {
        match self {
            Arch::Allreduce => "allreduce",
            Arch::Flat => "flat",
            Arch::Hierarchical => "hierarchical",
            Arch::Pipeline => "pipeline",
        }
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
