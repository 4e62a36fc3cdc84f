//! Which ranks of a job may be replaced while it runs, and whether this process is such a
//! replacement.
//!
//! A worker whose parameter servers are all asynchronous (flat, sharded, or under an async
//! local server) can be restarted alone (`flotilla launch --max-restarts`): the new process,
//! started with [`REJOIN_ENV`]` = 1`, takes the lost worker's place on its links to rank 0
//! and to its servers, pulls the current parameters and trains on; the servers admit it
//! back. So can every worker of an elastic parameter server, flat or hierarchical (`-n MIN:MAX`,
//! [`Elasticity::ServerWorkers`]), sync ones too: its server leaves a lost worker out of
//! the rounds and takes the replacement back. Every other rank restarts the whole job from
//! its checkpoint instead: a fixed-size sync server waits for every worker each round, and a
//! server's or peer's state is not in anyone else's hands.

use flotilla_cluster::{Aggregation, RoleKind, Topology};
use flotilla_tcp::Rejoin;

use crate::config::{Elasticity, TrainConfig};
use crate::error::{Result, TrainError};

/// Set to `1` by the launcher on a worker it restarts alone.
pub const REJOIN_ENV: &str = "FLOTILLA_REJOIN";

/// Whether this process was started as a replacement of a lost worker ([`REJOIN_ENV`]` = 1`).
pub fn asked_to_rejoin() -> bool {
    std::env::var(REJOIN_ENV).is_ok_and(|v| v.trim() == "1")
}

/// Whether rank `rank` of `config`'s `topology` is a worker that may be replaced while the
/// job runs: every server it pushes to aggregates asynchronously, or the job is an elastic
/// flat parameter server's.
pub fn can_rejoin(config: &TrainConfig, topology: &Topology, rank: usize) -> bool {
    let Some(role) = topology.role(rank) else {
        return false;
    };
    let elastic = config.elasticity() == Some(Elasticity::ServerWorkers);
    matches!(role.kind, RoleKind::Worker { .. })
        && !role.parents.is_empty()
        && role.parents.iter().all(|&p| {
            topology
                .role(p)
                .is_some_and(|s| elastic || s.aggregation == Some(Aggregation::Async))
        })
}

/// The workers of `config`'s `topology` that may be replaced while the job runs.
pub fn rejoinable(config: &TrainConfig, topology: &Topology) -> Vec<usize> {
    (0..topology.world_size())
        .filter(|&r| can_rejoin(config, topology, r))
        .collect()
}

/// How rank `rank` of `topology` takes part in rejoins, and (for a replacement) the ranks it
/// links to: rank 0 of a topology with rejoinable workers, and every server of such a
/// worker, accept them; a process started with [`REJOIN_ENV`] joins, linking to its servers
/// (an error if its rank cannot rejoin); everyone else is [`Rejoin::Off`].
pub fn mode(
    config: &TrainConfig,
    topology: &Topology,
    rank: Option<usize>,
) -> Result<(Rejoin, Vec<usize>)> {
    let asked = asked_to_rejoin();
    let workers = rejoinable(config, topology);
    if !asked {
        let accepts = rank.is_some_and(|r| {
            !workers.is_empty()
                && (r == topology.root()
                    || workers.iter().any(|&w| {
                        topology
                            .role(w)
                            .is_some_and(|role| role.parents.contains(&r))
                    }))
        });
        let mode = if accepts { Rejoin::Accept } else { Rejoin::Off };
        return Ok((mode, Vec::new()));
    }
    match rank.filter(|r| workers.contains(r)) {
        Some(r) => {
            let parents = topology.role(r).map(|role| role.parents.clone());
            Ok((Rejoin::Join, parents.unwrap_or_default()))
        }
        None => Err(TrainError::config(
            REJOIN_ENV,
            format!(
                "only a worker (with RANK set) whose parameter servers are all asynchronous, or \
                 of an elastic parameter server, can rejoin a running job; this is rank {} of a {} \
                 topology ({})",
                rank.map_or("?".to_string(), |r| r.to_string()),
                topology.arch(),
                topology.composition()
            ),
        )),
    }
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
    fn workers_under_async_servers_rejoin_and_their_servers_accept() {
        let fixed = TrainConfig::default();
        let flat = topology("arch: flat\nparameter_server: {aggr_type: async, num_workers: 2}\n");
        assert_eq!(rejoinable(&fixed, &flat), vec![1, 2]);
        assert_eq!(
            mode(&fixed, &flat, Some(0)).expect("root").0,
            Rejoin::Accept
        );
        assert_eq!(mode(&fixed, &flat, Some(1)).expect("worker").0, Rejoin::Off);
        let sharded = topology(
            "arch: flat\nservers: 2\nparameter_server: {aggr_type: async, num_workers: 2}\n",
        );
        assert_eq!(rejoinable(&fixed, &sharded), vec![2, 3]);
        assert_eq!(
            mode(&fixed, &sharded, Some(1)).expect("shard").0,
            Rejoin::Accept
        );
        // Global server 0; local server 1 (async) with workers 2, 3; local server 4 (sync)
        // with workers 5, 6.
        let hier = topology(
            "arch: hierarchical\nglobal_server:\n  aggr_type: sync\n  local_servers:\n    - {aggr_type: async, num_workers: 2}\n    - {aggr_type: sync, num_workers: 2}\n",
        );
        assert_eq!(rejoinable(&fixed, &hier), vec![2, 3]);
        assert_eq!(
            mode(&fixed, &hier, Some(0)).expect("global").0,
            Rejoin::Accept
        );
        assert_eq!(
            mode(&fixed, &hier, Some(1)).expect("async local").0,
            Rejoin::Accept
        );
        assert_eq!(
            mode(&fixed, &hier, Some(4)).expect("sync local").0,
            Rejoin::Off
        );
        let sync = topology("arch: flat\nparameter_server: {aggr_type: sync, num_workers: 2}\n");
        assert!(rejoinable(&fixed, &sync).is_empty());
        assert_eq!(mode(&fixed, &sync, Some(0)).expect("root").0, Rejoin::Off);
        // An elastic flat job: its sync server's workers rejoin too.
        let mut elastic = TrainConfig::default();
        elastic.topology.arch = flotilla_cluster::Arch::Flat;
        elastic.topology.min_world_size = Some(2);
        assert_eq!(rejoinable(&elastic, &sync), vec![1, 2]);
        assert_eq!(
            mode(&elastic, &sync, Some(0)).expect("root").0,
            Rejoin::Accept
        );
    }
}
