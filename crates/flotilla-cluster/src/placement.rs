//! Placement of a topology's roles onto hosts: rank `i` runs on host `i`.

use crate::error::{ClusterError, Result};
use crate::inventory::{Host, Inventory};
use crate::role::Role;
use crate::topology::Topology;

/// The loopback address used by [`Placement::local`].
pub const LOCALHOST: &str = "127.0.0.1";

/// A topology whose every rank has a host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    topology: Topology,
    source_name: String,
    hosts: Vec<Host>,
    unused: Vec<Host>,
}

/// Assigns rank `i` to the `i`-th host of `inventory`. Fails before anything starts if the
/// inventory lists fewer hosts than the topology has processes; extra hosts stay unused
/// (see [`Placement::unused`]).
pub fn place(topology: &Topology, inventory: &Inventory) -> Result<Placement> {
    let needed = topology.world_size();
    let available = inventory.len();
    if available < needed {
        return Err(ClusterError::TooFewHosts {
            needed,
            composition: topology.composition(),
            source_name: inventory.source_name().to_owned(),
            available,
        });
    }
    let (hosts, unused) = inventory.hosts().split_at(needed);
    Ok(Placement {
        topology: topology.clone(),
        source_name: inventory.source_name().to_owned(),
        hosts: hosts.to_vec(),
        unused: unused.to_vec(),
    })
}

impl Placement {
    /// Every rank on [`LOCALHOST`], for single-machine runs.
    pub fn local(topology: &Topology) -> Placement {
        Placement {
            topology: topology.clone(),
            source_name: "local".to_owned(),
            hosts: vec![Host::new(LOCALHOST); topology.world_size()],
            unused: Vec::new(),
        }
    }

    /// The placed topology.
    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// The host of `rank`, or `None` if `rank >= world_size()`.
    pub fn host(&self, rank: usize) -> Option<&Host> {
        self.hosts.get(rank)
    }

    /// Where to reach `rank` (its host's [`Host::address`]).
    pub fn address(&self, rank: usize) -> Option<&str> {
        self.host(rank).map(Host::address)
    }

    /// Each role with its host, in rank order.
    pub fn assignments(&self) -> impl Iterator<Item = (&Role, &Host)> {
        self.topology.roles().iter().zip(&self.hosts)
    }

    /// Inventory hosts left without a role, in inventory order.
    pub fn unused(&self) -> &[Host] {
        &self.unused
    }

    /// The inventory's name, or `local` for [`Placement::local`].
    pub fn source_name(&self) -> &str {
        &self.source_name
    }

    /// [`Topology::describe`] with a `host` column, followed by the unused hosts if any.
    pub fn describe(&self) -> String {
        let labels: Vec<String> = self.hosts.iter().map(host_label).collect();
        let mut out = self.topology.describe_with_hosts(Some(&labels));
        if !self.unused.is_empty() {
            let names: Vec<&str> = self.unused.iter().map(Host::name).collect();
            out.push_str(&format!(
                "unused hosts of {} ({}): {}\n",
                self.source_name,
                names.len(),
                names.join(", ")
            ));
        }
        out
    }
}

/// `name`, or `name (address)` when `ansible_host` points elsewhere.
fn host_label(host: &Host) -> String {
    if host.address() == host.name() {
        host.name().to_owned()
    } else {
        format!("{} ({})", host.name(), host.address())
    }
}
