//! Which ranks of a job may be replaced while it runs, and whether this process is such a
//! replacement.
//!
//! A worker of an asynchronous flat parameter server with one server (rank 0) can be
//! restarted alone (`flotilla launch --max-restarts`): the new process, started with
//! [`REJOIN_ENV`]` = 1`, takes the lost worker's place on its link to rank 0, pulls the
//! current parameters and trains on; the server admits it back. Every other role, and every
//! other topology, restarts the whole job from its checkpoint instead: a sync server waits
//! for every worker each round, and a worker under a local server or several shard servers
//! would need links that only the full rendezvous builds.

use flotilla_cluster::{Aggregation, Arch, RoleKind, Topology};
use flotilla_comm::Rejoin;

use crate::error::{Result, TrainError};

/// Set to `1` by the launcher on a worker it restarts alone.
pub const REJOIN_ENV: &str = "FLOTILLA_REJOIN";

/// Whether a lost worker of `topology` may be replaced while the job runs: flat, one server,
/// asynchronous.
pub fn workers_can_rejoin(topology: &Topology) -> bool {
    topology.arch() == Arch::Flat
        && topology.num_shards() == 1
        && topology
            .role(topology.root())
            .is_some_and(|r| r.aggregation == Some(Aggregation::Async))
}

/// How rank `rank` of `topology` takes part in rejoins: rank 0 of a topology whose workers
/// can rejoin accepts them; a process started with [`REJOIN_ENV`] joins (an error if its
/// rank cannot); everyone else is [`Rejoin::Off`].
pub fn mode(topology: &Topology, rank: Option<usize>) -> Result<Rejoin> {
    let asked = std::env::var(REJOIN_ENV).is_ok_and(|v| v.trim() == "1");
    let can = workers_can_rejoin(topology);
    if !asked {
        let root = rank == Some(topology.root());
        return Ok(if can && root {
            Rejoin::Accept
        } else {
            Rejoin::Off
        });
    }
    let worker = rank
        .and_then(|r| topology.role(r))
        .is_some_and(|r| matches!(r.kind, RoleKind::Worker { .. }));
    if can && worker {
        return Ok(Rejoin::Join);
    }
    Err(TrainError::config(
        REJOIN_ENV,
        format!(
            "only a worker (with RANK set) of an asynchronous flat parameter server with one \
             server can rejoin a running job; this is rank {} of a {} topology ({})",
            rank.map_or("?".to_string(), |r| r.to_string()),
            topology.arch(),
            topology.composition()
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_cluster::TopologySpec;

    fn topology(yaml: &str) -> Topology {
        let spec = TopologySpec::from_yaml(yaml, "t.yaml").expect("spec");
        Topology::build(&spec).expect("topology")
    }

    #[test]
    fn only_async_flat_single_server_workers_rejoin() {
        let flat_async =
            topology("arch: flat\nparameter_server: {aggr_type: async, num_workers: 2}\n");
        assert!(workers_can_rejoin(&flat_async));
        assert_eq!(mode(&flat_async, Some(0)).expect("root"), Rejoin::Accept);
        assert_eq!(mode(&flat_async, Some(1)).expect("worker"), Rejoin::Off);
        for no in [
            "arch: flat\nparameter_server: {aggr_type: sync, num_workers: 2}\n",
            "arch: flat\nservers: 2\nparameter_server: {aggr_type: async, num_workers: 2}\n",
            "arch: hierarchical\nglobal_server:\n  aggr_type: async\n  local_servers:\n    - {aggr_type: async, num_workers: 2}\n",
        ] {
            let t = topology(no);
            assert!(!workers_can_rejoin(&t), "{no}");
            assert_eq!(mode(&t, Some(0)).expect("root"), Rejoin::Off, "{no}");
        }
    }
}
