//! Placement of roles onto inventory hosts.

use flotilla_cluster::{ClusterError, Inventory, Placement, Topology, TopologySpec, place};

const HCDDL_EXAMPLE: &str = "\
arch: hierarchical
global_server:
  aggr_type: sync
  local_servers:
    - type: async
      num_workers: 2
    - type: async
      num_workers: 2
";

fn hierarchical() -> Result<Topology, ClusterError> {
    Topology::build(&TopologySpec::from_yaml(HCDDL_EXAMPLE, "hcddl.yaml")?)
}

#[test]
fn too_few_hosts_fails_before_start() -> Result<(), ClusterError> {
    let t = hierarchical()?;
    let inv = Inventory::parse("[pool]\nh0\nh1\nh2\nh3\nh4\n", "pool.ini")?;
    let msg = place(&t, &inv).err().map(|e| e.to_string());
    assert_eq!(
        msg.as_deref(),
        Some(
            "topology needs 7 hosts (1 global server, 2 local servers, 4 workers) but \
             inventory pool.ini lists 5"
        )
    );
    let flat = Topology::build(&TopologySpec::from_yaml(
        "arch: flat\nservers: 2\nparameter_server: {aggr_type: sync, num_workers: 1}\n",
        "flat.yaml",
    )?)?;
    let msg = place(&flat, &Inventory::from_hosts("hosts.txt", ["a"]))
        .err()
        .map(|e| e.to_string());
    assert_eq!(
        msg.as_deref(),
        Some("topology needs 3 hosts (2 shard servers, 1 worker) but inventory hosts.txt lists 1")
    );
    Ok(())
}

#[test]
fn rank_i_runs_on_host_i_and_extras_are_unused() -> Result<(), ClusterError> {
    let t = hierarchical()?;
    let text = "[pool]\nh0\nh1 ansible_host=10.0.0.11\nh2\nh3\nh4\nh5\nh6\nspare1\nspare2\n";
    let inv = Inventory::parse(text, "pool.ini")?;
    let p = place(&t, &inv)?;
    let hosts: Vec<&str> = p.assignments().map(|(_, h)| h.name()).collect();
    assert_eq!(hosts, vec!["h0", "h1", "h2", "h3", "h4", "h5", "h6"]);
    let ranks: Vec<usize> = p.assignments().map(|(r, _)| r.rank).collect();
    assert_eq!(ranks, (0..7).collect::<Vec<_>>());
    assert_eq!(p.address(1), Some("10.0.0.11"));
    assert_eq!(p.address(6), Some("h6"));
    assert_eq!(p.address(7), None);
    let unused: Vec<&str> = p.unused().iter().map(|h| h.name()).collect();
    assert_eq!(unused, vec!["spare1", "spare2"]);

    let text = p.describe();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines[1].split_whitespace().collect::<Vec<_>>(),
        vec!["rank", "role", "aggregation", "parents", "children", "host"]
    );
    assert!(lines[2].ends_with("h0"), "{text}");
    assert!(lines[3].ends_with("h1 (10.0.0.11)"), "{text}");
    assert!(text.contains("global server (root)"), "{text}");
    assert!(text.contains("local server 1"), "{text}");
    assert!(text.contains("worker 3"), "{text}");
    assert_eq!(
        lines.last().copied(),
        Some("unused hosts of pool.ini (2): spare1, spare2")
    );
    Ok(())
}

#[test]
fn exact_fit_has_no_unused_line() -> Result<(), ClusterError> {
    let t = Topology::allreduce(2)?;
    let p = place(&t, &Inventory::from_hosts("hosts.txt", ["a", "b"]))?;
    assert!(p.unused().is_empty());
    assert!(!p.describe().contains("unused"));
    Ok(())
}

#[test]
fn local_placement_uses_loopback() -> Result<(), ClusterError> {
    let t = hierarchical()?;
    let p = Placement::local(&t);
    assert_eq!(p.topology(), &t);
    assert_eq!(p.source_name(), "local");
    let addrs: Vec<Option<&str>> = (0..7).map(|r| p.address(r)).collect();
    assert_eq!(addrs, vec![Some("127.0.0.1"); 7]);
    assert!(p.unused().is_empty());
    assert_eq!(
        p.describe()
            .lines()
            .nth(2)
            .map(|l| l.ends_with("127.0.0.1")),
        Some(true)
    );
    Ok(())
}
