//! The configuration keys of a topology, exactly as hcddl spells them.
//!
//! ```yaml
//! arch: hierarchical        # flat | hierarchical | allreduce (the default)
//! global_server:
//!   aggr_type: sync         # sync | async
//!   local_servers:
//!     - aggr_type: async    # `type:` is accepted as an alias
//!       num_workers: 2
//!     - aggr_type: async
//!       num_workers: 2
//! # flat instead:
//! # parameter_server: {aggr_type: sync, num_workers: 4}
//! # servers: 2              # shard servers for flat; default 1
//! ```
//!
//! These types only describe what the user wrote; [`crate::Topology::build`] checks that
//! the keys fit together and assigns ranks.

use std::fmt;

use serde::{Deserialize, Serialize};

pub use crate::arch::Arch;
use crate::error::{ClusterError, Result};

/// How a server combines the updates of its children.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Aggregation {
    /// Wait for every child each step, then apply the averaged update.
    Sync,
    /// Apply each child's update as soon as it arrives.
    Async,
}

impl Aggregation {
    /// The config spelling (`sync`, `async`).
    pub fn as_str(self) -> &'static str {
        match self {
            Aggregation::Sync => "sync",
            Aggregation::Async => "async",
        }
    }
}

impl fmt::Display for Aggregation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A server that has workers directly under it: hcddl's `parameter_server` (flat) or one
/// entry of `global_server.local_servers` (hierarchical).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerSpec {
    /// How the server aggregates its workers' updates. Also accepted as `type:`.
    #[serde(alias = "type")]
    pub aggr_type: Aggregation,
    /// Number of workers attached to this server; at least 1.
    pub num_workers: usize,
}

/// hcddl's `global_server`: the top of a hierarchical topology.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GlobalServerSpec {
    /// How the global server aggregates its local servers' updates. Also accepted as `type:`.
    #[serde(alias = "type")]
    pub aggr_type: Aggregation,
    /// The local servers, in rank order; at least one.
    pub local_servers: Vec<ServerSpec>,
}

/// Every topology key of a config, as written.
///
/// The training config fills this from its own top-level keys (do not `#[serde(flatten)]`
/// it: flattening disables `deny_unknown_fields`). It also deserializes on its own, with
/// `arch` defaulting to [`Arch::Allreduce`] and `servers` to 1; see [`TopologySpec::from_yaml`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TopologySpec {
    /// The architecture (`arch`).
    #[serde(default)]
    pub arch: Arch,
    /// `parameter_server`: the single server tier of [`Arch::Flat`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameter_server: Option<ServerSpec>,
    /// `global_server`: the tree of [`Arch::Hierarchical`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub global_server: Option<GlobalServerSpec>,
    /// `servers`: how many shard servers split the parameters in [`Arch::Flat`]; default 1.
    #[serde(default = "default_servers")]
    pub servers: usize,
}

/// The default of [`TopologySpec::servers`]: one server holds all parameters.
pub const DEFAULT_SERVERS: usize = 1;

fn default_servers() -> usize {
    DEFAULT_SERVERS
}

impl Default for TopologySpec {
    fn default() -> Self {
        TopologySpec {
            arch: Arch::default(),
            parameter_server: None,
            global_server: None,
            servers: DEFAULT_SERVERS,
        }
    }
}

impl TopologySpec {
    /// Parses a YAML document holding only topology keys (`arch`, `parameter_server`,
    /// `global_server`, `servers`). Unknown keys are rejected. The result is not yet
    /// validated: pass it to [`crate::Topology::build`] or call [`TopologySpec::validate`].
    pub fn from_yaml(text: &str, source_name: &str) -> Result<TopologySpec> {
        serde_norway::from_str(text).map_err(|source| ClusterError::Yaml {
            source_name: source_name.to_owned(),
            source,
        })
    }

    /// Whether any parameter-server key is set (`parameter_server`, `global_server`, or
    /// `servers` other than 1).
    pub fn has_ps_keys(&self) -> bool {
        self.parameter_server.is_some()
            || self.global_server.is_some()
            || self.servers != DEFAULT_SERVERS
    }
}
