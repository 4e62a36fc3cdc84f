//! Rank order, links and descriptions of built topologies.

use flotilla_cluster::{
    Aggregation, Arch, ClusterError, Role, RoleKind, ServerSpec, Topology, TopologySpec,
};

const HCDDL_EXAMPLE: &str = "\
arch: hierarchical        # or flat
global_server:
  aggr_type: sync         # sync | async
  local_servers:
    - aggr_type: async
      num_workers: 2
    - aggr_type: async
      num_workers: 2
";

fn kinds(t: &Topology) -> Vec<RoleKind> {
    t.roles().iter().map(|r| r.kind).collect()
}

fn flat_spec(servers: usize, num_workers: usize) -> TopologySpec {
    TopologySpec {
        arch: Arch::Flat,
        parameter_server: Some(ServerSpec {
            aggr_type: Aggregation::Sync,
            num_workers,
        }),
        global_server: None,
        servers,
    }
}

#[test]
fn hcddl_hierarchical_example_ranks_and_links() -> Result<(), ClusterError> {
    let spec = TopologySpec::from_yaml(HCDDL_EXAMPLE, "hcddl.yaml")?;
    assert_eq!(spec.arch, Arch::Hierarchical);
    assert_eq!(spec.servers, 1);
    let t = Topology::build(&spec)?;
    assert_eq!(t.world_size(), 7);
    assert_eq!(t.num_workers(), 4);
    assert_eq!(t.num_shards(), 1);
    assert_eq!(t.root(), 0);
    assert_eq!(
        kinds(&t),
        vec![
            RoleKind::GlobalServer,
            RoleKind::LocalServer { index: 0 },
            RoleKind::Worker { index: 0 },
            RoleKind::Worker { index: 1 },
            RoleKind::LocalServer { index: 1 },
            RoleKind::Worker { index: 2 },
            RoleKind::Worker { index: 3 },
        ]
    );
    let links: Vec<(Vec<usize>, Vec<usize>)> = t
        .roles()
        .iter()
        .map(|r| (r.parents.clone(), r.children.clone()))
        .collect();
    assert_eq!(
        links,
        vec![
            (vec![], vec![1, 4]),
            (vec![0], vec![2, 3]),
            (vec![1], vec![]),
            (vec![1], vec![]),
            (vec![0], vec![5, 6]),
            (vec![4], vec![]),
            (vec![4], vec![]),
        ]
    );
    let aggs: Vec<Option<Aggregation>> = t.roles().iter().map(|r| r.aggregation).collect();
    assert_eq!(
        aggs,
        vec![
            Some(Aggregation::Sync),
            Some(Aggregation::Async),
            None,
            None,
            Some(Aggregation::Async),
            None,
            None,
        ]
    );
    let worker_ranks: Vec<usize> = t.workers().map(|r| r.rank).collect();
    assert_eq!(worker_ranks, vec![2, 3, 5, 6]);
    let server_ranks: Vec<usize> = t.servers().map(|r| r.rank).collect();
    assert_eq!(server_ranks, vec![0, 1, 4]);
    assert!(t.role(0).is_some_and(Role::is_root));
    assert!(t.role(7).is_none());
    Ok(())
}

#[test]
fn type_alias_is_accepted() -> Result<(), ClusterError> {
    let text = HCDDL_EXAMPLE.replace("- aggr_type:", "- type:");
    assert!(text.contains("- type: async"));
    let aliased = TopologySpec::from_yaml(&text, "readme.yaml")?;
    let plain = TopologySpec::from_yaml(HCDDL_EXAMPLE, "hcddl.yaml")?;
    assert_eq!(aliased, plain);
    assert_eq!(Topology::build(&aliased)?.world_size(), 7);
    Ok(())
}

#[test]
fn flat_single_server_ranks() -> Result<(), ClusterError> {
    let spec = TopologySpec::from_yaml(
        "arch: flat\nparameter_server: {aggr_type: async, num_workers: 4}\n",
        "flat.yaml",
    )?;
    let t = Topology::build(&spec)?;
    assert_eq!(t.arch(), Arch::Flat);
    assert_eq!(t.world_size(), 5);
    assert_eq!(t.num_shards(), 1);
    assert_eq!(
        kinds(&t),
        vec![
            RoleKind::ShardServer { shard: 0 },
            RoleKind::Worker { index: 0 },
            RoleKind::Worker { index: 1 },
            RoleKind::Worker { index: 2 },
            RoleKind::Worker { index: 3 },
        ]
    );
    let server = t.role(0).cloned();
    assert_eq!(
        server,
        Some(Role {
            rank: 0,
            kind: RoleKind::ShardServer { shard: 0 },
            aggregation: Some(Aggregation::Async),
            parents: vec![],
            children: vec![1, 2, 3, 4],
        })
    );
    assert_eq!(t.role(3).map(|r| r.parents.clone()), Some(vec![0]));
    assert_eq!(t.label(0), "server (root)");
    assert_eq!(t.composition(), "1 server, 4 workers");
    assert_eq!(t.shard_ranges(10), vec![0..10]);
    Ok(())
}

#[test]
fn flat_two_shards_ranks() -> Result<(), ClusterError> {
    let spec = TopologySpec::from_yaml(
        "arch: flat\nparameter_server: {aggr_type: sync, num_workers: 3}\nservers: 2\n",
        "flat2.yaml",
    )?;
    assert_eq!(spec, flat_spec(2, 3));
    let t = Topology::build(&spec)?;
    assert_eq!(t.world_size(), 5);
    assert_eq!(t.num_shards(), 2);
    assert_eq!(t.num_workers(), 3);
    assert_eq!(
        kinds(&t),
        vec![
            RoleKind::ShardServer { shard: 0 },
            RoleKind::ShardServer { shard: 1 },
            RoleKind::Worker { index: 0 },
            RoleKind::Worker { index: 1 },
            RoleKind::Worker { index: 2 },
        ]
    );
    for shard in 0..2 {
        let role = t.role(shard).cloned();
        assert_eq!(
            role.as_ref().map(|r| r.children.clone()),
            Some(vec![2, 3, 4])
        );
        assert_eq!(role.as_ref().map(Role::is_root), Some(shard == 0));
    }
    for worker in t.workers() {
        assert_eq!(worker.parents, vec![0, 1]);
        assert!(worker.children.is_empty());
        assert_eq!(worker.aggregation, None);
    }
    assert_eq!(t.label(0), "shard server 0/2 (root)");
    assert_eq!(t.label(1), "shard server 1/2");
    assert_eq!(t.composition(), "2 shard servers, 3 workers");
    assert_eq!(t.shard_ranges(10), vec![0..5, 5..10]);
    Ok(())
}

#[test]
fn allreduce_world_is_all_workers() -> Result<(), ClusterError> {
    let t = Topology::allreduce(3)?;
    assert_eq!(t.arch(), Arch::Allreduce);
    assert_eq!(t.world_size(), 3);
    assert_eq!(t.num_workers(), 3);
    assert_eq!(t.servers().count(), 0);
    assert_eq!(t.label(0), "worker 0 (root)");
    assert_eq!(t.composition(), "3 workers");
    assert!(matches!(
        Topology::allreduce(0),
        Err(ClusterError::ZeroWorldSize)
    ));
    Ok(())
}

#[test]
fn describe_lists_every_role() -> Result<(), ClusterError> {
    let t = Topology::build(&TopologySpec::from_yaml(HCDDL_EXAMPLE, "hcddl.yaml")?)?;
    let text = t.describe();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines.first().copied(),
        Some(
            "topology: arch hierarchical, world size 7 (1 global server, 2 local servers, 4 workers)"
        )
    );
    assert_eq!(lines.len(), 1 + 1 + 7, "{text}");
    assert_eq!(
        lines[1].split_whitespace().collect::<Vec<_>>(),
        vec!["rank", "role", "aggregation", "parents", "children"]
    );
    assert_eq!(
        lines[2].split_whitespace().collect::<Vec<_>>(),
        vec!["0", "global", "server", "(root)", "sync", "-", "1,4"]
    );
    assert_eq!(
        lines[3].split_whitespace().collect::<Vec<_>>(),
        vec!["1", "local", "server", "0", "async", "0", "2-3"]
    );
    assert_eq!(
        lines[8].split_whitespace().collect::<Vec<_>>(),
        vec!["6", "worker", "3", "-", "4", "-"]
    );
    assert!(!text.contains("host"));
    Ok(())
}

#[test]
fn describe_mentions_sharding() -> Result<(), ClusterError> {
    let t = Topology::build(&flat_spec(3, 2))?;
    let text = t.describe();
    assert!(
        text.contains("parameters split across 3 shard servers (ranks 0-2)"),
        "{text}"
    );
    assert!(text.contains("shard server 2/3"), "{text}");
    Ok(())
}

#[test]
fn spec_round_trips_through_yaml() -> Result<(), ClusterError> {
    let spec = flat_spec(2, 4);
    let yaml = serde_norway::to_string(&spec).map_err(|source| ClusterError::Yaml {
        source_name: "round-trip".to_owned(),
        source,
    })?;
    assert!(!yaml.contains("global_server"), "{yaml}");
    assert_eq!(TopologySpec::from_yaml(&yaml, "round-trip")?, spec);
    assert_eq!(
        TopologySpec::from_yaml("{}", "empty")?,
        TopologySpec::default()
    );
    Ok(())
}

/// Fuzzing found: `servers + num_workers` overflowed (a panic), and absurd sizes were
/// allocated role by role (out of memory) before anything checked them.
#[test]
fn absurd_sizes_are_refused_before_anything_is_allocated() {
    let too_large = |r: Result<Topology, ClusterError>| {
        assert!(matches!(r, Err(ClusterError::TooLarge { .. })), "{r:?}");
    };
    too_large(Topology::build(&flat_spec(usize::MAX, 4)));
    too_large(Topology::build(&flat_spec(100_000_000, 4)));
    too_large(Topology::build(&flat_spec(4_000, 4_000)));
    too_large(Topology::allreduce(1_000_000_000_000));
    too_large(Topology::pipeline(usize::MAX, 2));
    let hier = TopologySpec::from_yaml(
        "arch: hierarchical\nglobal_server: {aggr_type: sync, local_servers: \
         [{aggr_type: sync, num_workers: 18446744073709551615}]}\n",
        "t.yaml",
    )
    .expect("parses");
    too_large(Topology::build(&hier));
    let e = Topology::allreduce(70_000)
        .expect_err("too large")
        .to_string();
    assert_eq!(
        e,
        "processes: 70000 is more than the 65536 this build supports"
    );
    assert!(Topology::allreduce(1 << 16).is_ok());
}
