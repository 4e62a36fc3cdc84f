//! Rank assignment: turning a [`TopologySpec`] into one [`Role`] per rank.
//!
//! All processes join one world, ranks `0..world_size`, and each takes the role of its
//! rank, in hcddl's placement order:
//!
//! * **flat** with `k` shard servers and `N` workers: ranks `0..k` are the shard servers
//!   (shard `i` at rank `i`; rank 0 is also the root), then ranks `k..k+N` the workers.
//! * **hierarchical**: rank 0 is the global server (the root), then each local server
//!   immediately followed by its workers: `global, local0, w, w, local1, w, w, ...`.
//! * **allreduce** ([`Topology::allreduce`]): every rank is a peer worker; rank 0 is root.
//! * **pipeline** ([`Topology::pipeline`]): `S` stages × `D` replicas; rank `r` is stage
//!   `r % S` of replica `r / S` (the stages of a replica are neighbours); rank 0 is root.

use std::ops::Range;

use crate::describe::{format_ranks, render_table};
use crate::error::{ClusterError, Result};
use crate::role::{ROOT_RANK, Role, RoleKind};
use crate::spec::{Aggregation, Arch, ServerSpec, TopologySpec};

/// Most processes a topology may have: every rank has a role (and, in a flat
/// parameter-server topology, every server lists every worker), so an absurd size from a
/// config would otherwise be allocated before anything checks it.
pub const MAX_WORLD_SIZE: usize = 1 << 16;

/// Most server-worker links of a flat parameter-server topology (servers × workers: each
/// server lists every worker, each worker every server).
pub const MAX_LINKS: usize = 1 << 22;

/// Checks a world size (saturated sums and products welcome) against [`MAX_WORLD_SIZE`].
pub(crate) fn check_world_size(count: usize) -> Result<()> {
    if count > MAX_WORLD_SIZE {
        return Err(ClusterError::TooLarge {
            what: "processes",
            count,
            max: MAX_WORLD_SIZE,
        });
    }
    Ok(())
}

/// The processes of a training world and how they are linked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    arch: Arch,
    roles: Vec<Role>,
    num_shards: usize,
    num_workers: usize,
}

impl Topology {
    /// Validates `spec` (see [`TopologySpec::validate`]) and assigns ranks for a
    /// parameter-server architecture. An [`Arch::Allreduce`] spec is refused with
    /// [`ClusterError::NotParameterServer`], because its world size is not part of the
    /// config; use [`Topology::allreduce`] for it.
    pub fn build(spec: &TopologySpec) -> Result<Topology> {
        spec.validate()?;
        match (spec.arch, &spec.parameter_server, &spec.global_server) {
            (Arch::Flat, Some(ps), _) => Ok(Topology::flat(ps, spec.servers)),
            (Arch::Hierarchical, _, Some(global)) => Ok(Topology::hierarchical(
                global.aggr_type,
                &global.local_servers,
            )),
            // `validate` guarantees the keys above are present for flat and hierarchical.
            _ => Err(ClusterError::NotParameterServer),
        }
    }

    /// An all-reduce world of `world_size` peer workers (no servers; rank 0 is the root).
    pub fn allreduce(world_size: usize) -> Result<Topology> {
        if world_size == 0 {
            return Err(ClusterError::ZeroWorldSize);
        }
        check_world_size(world_size)?;
        let roles = (0..world_size)
            .map(|rank| Role {
                rank,
                kind: RoleKind::Worker { index: rank },
                aggregation: None,
                parents: Vec::new(),
                children: Vec::new(),
            })
            .collect();
        Ok(Topology {
            arch: Arch::Allreduce,
            roles,
            num_shards: 1,
            num_workers: world_size,
        })
    }

    /// A pipeline world: `replicas` copies of a `stages`-stage pipeline, rank `r` running
    /// stage `r % stages` of replica `r / stages` (rank 0, the first stage of replica 0, is
    /// the root).
    pub fn pipeline(stages: usize, replicas: usize) -> Result<Topology> {
        if stages == 0 || replicas == 0 {
            return Err(ClusterError::EmptyPipeline { stages, replicas });
        }
        check_world_size(stages.saturating_mul(replicas))?;
        let roles = (0..stages * replicas)
            .map(|rank| Role {
                rank,
                kind: RoleKind::Stage {
                    stage: rank % stages,
                    replica: rank / stages,
                },
                aggregation: None,
                parents: Vec::new(),
                children: Vec::new(),
            })
            .collect();
        Ok(Topology {
            arch: Arch::Pipeline,
            roles,
            num_shards: 1,
            num_workers: replicas,
        })
    }

    fn flat(ps: &ServerSpec, shards: usize) -> Topology {
        let workers: Vec<usize> = (shards..shards + ps.num_workers).collect();
        let servers: Vec<usize> = (0..shards).collect();
        let mut roles: Vec<Role> = servers
            .iter()
            .map(|&rank| Role {
                rank,
                kind: RoleKind::ShardServer { shard: rank },
                aggregation: Some(ps.aggr_type),
                parents: Vec::new(),
                children: workers.clone(),
            })
            .collect();
        roles.extend(workers.iter().enumerate().map(|(index, &rank)| Role {
            rank,
            kind: RoleKind::Worker { index },
            aggregation: None,
            parents: servers.clone(),
            children: Vec::new(),
        }));
        Topology {
            arch: Arch::Flat,
            roles,
            num_shards: shards,
            num_workers: ps.num_workers,
        }
    }

    fn hierarchical(global_aggr: Aggregation, locals: &[ServerSpec]) -> Topology {
        let mut roles = vec![Role {
            rank: ROOT_RANK,
            kind: RoleKind::GlobalServer,
            aggregation: Some(global_aggr),
            parents: Vec::new(),
            children: Vec::new(),
        }];
        let mut worker_index = 0;
        for (index, local) in locals.iter().enumerate() {
            let local_rank = roles.len();
            let workers: Vec<usize> =
                (local_rank + 1..local_rank + 1 + local.num_workers).collect();
            roles[ROOT_RANK].children.push(local_rank);
            roles.push(Role {
                rank: local_rank,
                kind: RoleKind::LocalServer { index },
                aggregation: Some(local.aggr_type),
                parents: vec![ROOT_RANK],
                children: workers.clone(),
            });
            for rank in workers {
                roles.push(Role {
                    rank,
                    kind: RoleKind::Worker {
                        index: worker_index,
                    },
                    aggregation: None,
                    parents: vec![local_rank],
                    children: Vec::new(),
                });
                worker_index += 1;
            }
        }
        Topology {
            arch: Arch::Hierarchical,
            roles,
            num_shards: 1,
            num_workers: worker_index,
        }
    }

    /// The architecture.
    pub fn arch(&self) -> Arch {
        self.arch
    }

    /// Number of processes, servers included.
    pub fn world_size(&self) -> usize {
        self.roles.len()
    }

    /// The role of `rank`, or `None` if `rank >= world_size()`.
    pub fn role(&self, rank: usize) -> Option<&Role> {
        self.roles.get(rank)
    }

    /// All roles, indexed by rank.
    pub fn roles(&self) -> &[Role] {
        &self.roles
    }

    /// The workers, in rank order.
    pub fn workers(&self) -> impl Iterator<Item = &Role> {
        self.roles.iter().filter(|r| r.is_worker())
    }

    /// The servers (shard, global and local), in rank order; empty for all-reduce.
    pub fn servers(&self) -> impl Iterator<Item = &Role> {
        self.roles.iter().filter(|r| r.is_server())
    }

    /// The rank of the root process; always [`ROOT_RANK`].
    pub fn root(&self) -> usize {
        ROOT_RANK
    }

    /// Number of workers.
    pub fn num_workers(&self) -> usize {
        self.num_workers
    }

    /// Number of parameter shards: `servers` for flat, 1 otherwise.
    pub fn num_shards(&self) -> usize {
        self.num_shards
    }

    /// The ranges of a flat parameter buffer of `total_params` elements held by each shard
    /// ([`Topology::num_shards`] of them; shard `i` sits at rank `i` in a flat topology).
    /// The one sharding rule of Flotilla, the ring's ([`flotilla_group::segment`]: sizes
    /// differing by at most one, the first ones shorter), so a parameter server and ZeRO cut
    /// a model at the same places.
    pub fn shard_ranges(&self, total_params: usize) -> Vec<Range<usize>> {
        (0..self.num_shards)
            .map(|i| flotilla_group::segment(total_params, self.num_shards, i))
            .collect()
    }

    /// What the processes are, e.g. `1 global server, 2 local servers, 4 workers`.
    pub fn composition(&self) -> String {
        let count =
            |pred: fn(&RoleKind) -> bool| self.roles.iter().filter(|r| pred(&r.kind)).count();
        let mut parts = Vec::new();
        match self.arch {
            Arch::Allreduce => {}
            Arch::Pipeline => {
                let stages = self.roles.len() / self.num_workers.max(1);
                parts.push(plural(stages, "stage"));
                parts.push(plural(self.num_workers, "replica"));
                return parts.join(" × ");
            }
            Arch::Flat if self.num_shards == 1 => parts.push(plural(1, "server")),
            Arch::Flat => parts.push(plural(self.num_shards, "shard server")),
            Arch::Hierarchical => {
                parts.push(plural(1, "global server"));
                parts.push(plural(
                    count(|k| matches!(k, RoleKind::LocalServer { .. })),
                    "local server",
                ));
            }
        }
        parts.push(plural(self.num_workers, "worker"));
        parts.join(", ")
    }

    /// A human-readable label of the role of `rank`, e.g. `shard server 1/2` or
    /// `global server (root)`; empty for an unknown rank.
    pub fn label(&self, rank: usize) -> String {
        let Some(role) = self.role(rank) else {
            return String::new();
        };
        let base = match role.kind {
            RoleKind::ShardServer { .. } if self.num_shards == 1 => "server".to_owned(),
            RoleKind::ShardServer { shard } => format!("shard server {shard}/{}", self.num_shards),
            RoleKind::GlobalServer => "global server".to_owned(),
            RoleKind::LocalServer { index } => format!("local server {index}"),
            RoleKind::Worker { index } => format!("worker {index}"),
            RoleKind::Stage { stage, replica } => format!("stage {stage} of replica {replica}"),
        };
        if role.is_root() {
            format!("{base} (root)")
        } else {
            base
        }
    }

    /// A table of every rank, printed before training starts: rank, role, aggregation,
    /// parent(s), children.
    pub fn describe(&self) -> String {
        self.describe_with_hosts(None)
    }

    /// [`Topology::describe`] with an extra `host` column when `hosts` is given.
    pub(crate) fn describe_with_hosts(&self, hosts: Option<&[String]>) -> String {
        let mut out = format!(
            "topology: arch {}, world size {} ({})\n",
            self.arch,
            self.world_size(),
            self.composition()
        );
        if self.num_shards > 1 {
            out.push_str(&format!(
                "parameters split across {} shard servers (ranks 0-{})\n",
                self.num_shards,
                self.num_shards - 1
            ));
        }
        let mut headers = vec!["rank", "role", "aggregation", "parents", "children"];
        if hosts.is_some() {
            headers.push("host");
        }
        let rows: Vec<Vec<String>> = self
            .roles
            .iter()
            .map(|role| {
                let mut row = vec![
                    role.rank.to_string(),
                    self.label(role.rank),
                    role.aggregation.map_or("-".to_owned(), |a| a.to_string()),
                    format_ranks(&role.parents),
                    format_ranks(&role.children),
                ];
                if let Some(hosts) = hosts {
                    row.push(
                        hosts
                            .get(role.rank)
                            .cloned()
                            .unwrap_or_else(|| "-".to_owned()),
                    );
                }
                row
            })
            .collect();
        out.push_str(&render_table(&headers, &rows));
        out
    }
}

fn plural(n: usize, noun: &str) -> String {
    if n == 1 {
        format!("{n} {noun}")
    } else {
        format!("{n} {noun}s")
    }
}
