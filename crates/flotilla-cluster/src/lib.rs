//! flotilla-cluster: parameter-server topologies, process roles, host inventories and the
//! placement of roles onto hosts.
//!
//! Flotilla's parameter-server architectures follow the Python systems hcddl / DDLF and
//! BytePS. Every training process joins one world (ranks `0..world_size`) and takes the
//! role of its rank (see [`topology`] for the rank order).
//!
//! * [`TopologySpec`] and friends: the config keys (`arch`, `parameter_server`,
//!   `global_server`, `servers`), spelled as in hcddl.
//! * [`Topology::build`]: validation and rank assignment into [`Role`]s.
//! * [`Inventory`]: hosts from an Ansible-style `[pool]` ini file or a plain list.
//! * [`place`] / [`Placement::local`]: rank `i` on host `i`.
//!
//! ```
//! use flotilla_cluster::{Inventory, RoleKind, Topology, TopologySpec, place};
//!
//! # fn main() -> Result<(), flotilla_cluster::ClusterError> {
//! let spec = TopologySpec::from_yaml(
//!     "arch: flat\nparameter_server: {aggr_type: sync, num_workers: 2}\n",
//!     "example",
//! )?;
//! let topology = Topology::build(&spec)?;
//! assert_eq!(topology.world_size(), 3);
//! assert_eq!(topology.role(0).map(|r| r.kind), Some(RoleKind::ShardServer { shard: 0 }));
//! let inventory = Inventory::parse("[pool]\nhost-a\nhost-b\nhost-c\n", "pool.ini")?;
//! let placement = place(&topology, &inventory)?;
//! assert_eq!(placement.address(2), Some("host-c"));
//! println!("{}", placement.describe());
//! # Ok(())
//! # }
//! ```

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod arch;
mod describe;
pub mod error;
pub mod inventory;
pub mod launcher_env;
pub mod placement;
pub mod role;
pub mod spec;
pub mod ssh;
pub mod topology;
mod validate;

pub use error::{ClusterError, Result};
pub use inventory::{Host, Inventory, InventoryFormat};
pub use launcher_env::LauncherEnv;
pub use placement::{Placement, place};
pub use role::{ROOT_RANK, Role, RoleKind};
pub use spec::{Aggregation, Arch, GlobalServerSpec, ServerSpec, TopologySpec};
pub use ssh::SshTarget;
pub use topology::Topology;
