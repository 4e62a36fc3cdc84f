//! Consistency checks of a [`TopologySpec`]: which keys each architecture needs and forbids.

use crate::error::{ClusterError, Result};
use crate::spec::{Arch, DEFAULT_SERVERS, TopologySpec};
use crate::topology::{MAX_LINKS, check_world_size};

const PARAMETER_SERVER_HINT: &str = "e.g. `parameter_server: {aggr_type: sync, num_workers: 4}`";
const GLOBAL_SERVER_HINT: &str = "e.g. `global_server: {aggr_type: sync, local_servers: \
                                  [{aggr_type: async, num_workers: 2}]}`";

impl TopologySpec {
    /// Checks that the keys fit together for `arch`, for every architecture including
    /// [`Arch::Allreduce`] (where it rejects parameter-server keys). Config loaders call this
    /// at load time; [`crate::Topology::build`] calls it too.
    pub fn validate(&self) -> Result<()> {
        validate(self)
    }
}

/// Checks `spec`; see [`TopologySpec::validate`].
fn validate(spec: &TopologySpec) -> Result<()> {
    if spec.servers == 0 {
        return Err(ClusterError::ZeroServers);
    }
    match spec.arch {
        Arch::Allreduce | Arch::Pipeline => validate_no_servers(spec),
        Arch::Flat => validate_flat(spec),
        Arch::Hierarchical => validate_hierarchical(spec),
    }
}

fn validate_no_servers(spec: &TopologySpec) -> Result<()> {
    let stray = if spec.parameter_server.is_some() {
        Some(("parameter_server", Arch::Flat))
    } else if spec.global_server.is_some() {
        Some(("global_server", Arch::Hierarchical))
    } else if spec.servers != DEFAULT_SERVERS {
        Some(("servers", Arch::Flat))
    } else {
        None
    };
    match stray {
        Some((key, suggested)) => Err(ClusterError::PsKeyWithAllreduce {
            arch: spec.arch,
            key,
            suggested,
        }),
        None => Ok(()),
    }
}

fn validate_flat(spec: &TopologySpec) -> Result<()> {
    if spec.global_server.is_some() {
        return Err(ClusterError::ForeignKey {
            arch: Arch::Flat,
            key: "global_server",
            belongs_to: Arch::Hierarchical,
        });
    }
    let ps = spec
        .parameter_server
        .as_ref()
        .ok_or(ClusterError::MissingKey {
            arch: Arch::Flat,
            key: "parameter_server",
            hint: PARAMETER_SERVER_HINT,
        })?;
    if ps.num_workers == 0 {
        return Err(ClusterError::ZeroWorkers {
            key: "parameter_server.num_workers".to_owned(),
        });
    }
    check_world_size(spec.servers.saturating_add(ps.num_workers))?;
    let links = spec.servers.saturating_mul(ps.num_workers);
    if links > MAX_LINKS {
        return Err(ClusterError::TooLarge {
            what: "server-worker links (servers × parameter_server.num_workers)",
            count: links,
            max: MAX_LINKS,
        });
    }
    Ok(())
}

fn validate_hierarchical(spec: &TopologySpec) -> Result<()> {
    if spec.parameter_server.is_some() {
        return Err(ClusterError::ForeignKey {
            arch: Arch::Hierarchical,
            key: "parameter_server",
            belongs_to: Arch::Flat,
        });
    }
    let global = spec
        .global_server
        .as_ref()
        .ok_or(ClusterError::MissingKey {
            arch: Arch::Hierarchical,
            key: "global_server",
            hint: GLOBAL_SERVER_HINT,
        })?;
    if spec.servers != DEFAULT_SERVERS {
        return Err(ClusterError::ShardedHierarchical {
            servers: spec.servers,
        });
    }
    if global.local_servers.is_empty() {
        return Err(ClusterError::NoLocalServers);
    }
    if let Some(i) = global.local_servers.iter().position(|l| l.num_workers == 0) {
        return Err(ClusterError::ZeroWorkers {
            key: format!("global_server.local_servers[{i}].num_workers"),
        });
    }
    let processes = global.local_servers.iter().fold(1usize, |n, l| {
        n.saturating_add(1).saturating_add(l.num_workers)
    });
    check_world_size(processes)
}
