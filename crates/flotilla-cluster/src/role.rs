//! What each process of a topology does.

use crate::spec::Aggregation;

/// The rank of the root process in every topology.
///
/// The root evaluates the model and decides when training stops. It is always rank 0:
/// the only (or first) shard server in [`crate::Arch::Flat`], the global server in
/// [`crate::Arch::Hierarchical`], and the first peer in [`crate::Arch::Allreduce`].
pub const ROOT_RANK: usize = 0;

/// The part a process plays. Root duty is orthogonal to this: see [`ROOT_RANK`] and
/// [`Role::is_root`]. In a flat topology with one server that server is
/// `ShardServer { shard: 0 }` holding the whole parameter buffer, and it is the root; with
/// `k > 1` servers, rank 0 is `ShardServer { shard: 0 }` and the root as well.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RoleKind {
    /// Flat parameter server holding shard `shard` of the parameters (see
    /// [`crate::Topology::shard_ranges`]); every worker pushes to and pulls from it.
    ShardServer {
        /// Which shard, `0..k`; equals the rank.
        shard: usize,
    },
    /// Hierarchical global server at rank 0, aggregating its local servers.
    GlobalServer,
    /// Hierarchical local server, aggregating its workers and pushing to the global server.
    LocalServer {
        /// Which local server, in config order (`global_server.local_servers[index]`).
        index: usize,
    },
    /// One stage of a pipeline replica: it holds the layers of `stage` and trains on the data
    /// shard of `replica`.
    Stage {
        /// Which stage, `0..stages`.
        stage: usize,
        /// Which replica of the pipeline, `0..data_parallel`.
        replica: usize,
    },
    /// A process that computes gradients on its part of the data.
    Worker {
        /// Global worker index `0..num_workers`, in rank order (for data sharding).
        index: usize,
    },
}

/// One process of a topology: its rank, kind and links.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Role {
    /// The process's rank in the world.
    pub rank: usize,
    /// What the process does.
    pub kind: RoleKind,
    /// How it aggregates its children's updates; `Some` for servers only.
    pub aggregation: Option<Aggregation>,
    /// Ranks it sends updates to, ascending. A flat worker has one parent per shard server
    /// (`parents[i]` holds shard `i`); a local server has the global server; the root and
    /// all-reduce peers have none.
    pub parents: Vec<usize>,
    /// Ranks that send updates to it, ascending; empty for workers.
    pub children: Vec<usize>,
}

impl Role {
    /// Whether this is the root process (rank [`ROOT_RANK`]).
    pub fn is_root(&self) -> bool {
        self.rank == ROOT_RANK
    }

    /// Whether this is a worker.
    pub fn is_worker(&self) -> bool {
        matches!(self.kind, RoleKind::Worker { .. })
    }

    /// Whether this is any kind of server.
    pub fn is_server(&self) -> bool {
        !self.is_worker() && !matches!(self.kind, RoleKind::Stage { .. })
    }

    /// The global worker index, for workers.
    pub fn worker_index(&self) -> Option<usize> {
        match self.kind {
            RoleKind::Worker { index } => Some(index),
            _ => None,
        }
    }
}
