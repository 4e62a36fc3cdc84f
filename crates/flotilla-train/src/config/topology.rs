//! The `topology:` section: which processes there are and how they cooperate, and the
//! process topology it makes.

use std::path::PathBuf;

use flotilla_cluster::{Aggregation, Arch, GlobalServerSpec, ServerSpec, Topology, TopologySpec};
use serde::{Deserialize, Serialize};

use super::TrainConfig;
use crate::error::{Result, TrainError};

/// Which processes there are and how they cooperate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TopologySection {
    /// Number of ranks (processes) for all-reduce; parameter-server trees derive theirs.
    /// In an elastic job (`min_world_size` set) the most it takes.
    pub world_size: usize,
    /// An elastic job (`flotilla launch -n MIN:MAX`): the fewest ranks it trains with
    /// ([`Elasticity`]: all-reduce peers in generations the launcher's lighthouse keeps, or a
    /// parameter server's workers the server keeps). Unset: a fixed-size job.
    pub min_world_size: Option<usize>,
    /// Architecture: `allreduce` (default), `flat` or `hierarchical` parameter servers.
    pub arch: Arch,
    /// Flat parameter server: `{aggr_type: sync|async, num_workers: N}`. Unset under
    /// `arch: flat`: sync, and every rank after the `servers` is a worker (`-n 3
    /// --strategy flat`: one server, two workers).
    pub parameter_server: Option<ServerSpec>,
    /// Hierarchical: `{aggr_type, local_servers: [{aggr_type, num_workers}, ...]}`.
    pub global_server: Option<GlobalServerSpec>,
    /// Shard servers of a flat topology (parameters split by balanced byte ranges).
    pub servers: usize,
    /// Async servers: a push more than this many versions stale is refused (pull again).
    pub max_staleness: Option<u64>,
    /// Parameter servers: scale each update's learning rate by `1 / (1 + staleness)`.
    /// Unset: on at async servers (they apply each push on arrival), off at sync ones
    /// ([`crate::ps::staleness`]).
    pub staleness_lr: Option<bool>,
    /// Async servers: the SGD momentum of the server's optimizer, instead of
    /// `optimizer.momentum` (asynchrony adds momentum of its own; [`crate::ps::staleness`]).
    pub async_momentum: Option<f64>,
    /// Parameter servers: local steps per push; more than 1 is model averaging (workers push
    /// weight deltas, the server averages them weighted by samples).
    pub local_steps: usize,
    /// Inventory file (hcddl's `[pool]` ini or a plain host list) for placement checks.
    pub inventory: Option<PathBuf>,
}

/// How an elastic job (`topology.min_world_size`) changes its members.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Elasticity {
    /// All-reduce peers: the launcher's lighthouse keeps the membership; a lost rank leaves
    /// the others training in a new generation, a new process joins at a step boundary, and
    /// the global batch (`batch_size` x `world_size`) stays ([`crate::elastic`]).
    Generations,
    /// A parameter server's workers (flat or hierarchical): their servers keep them; a lost
    /// (or silent) worker is left out of the rounds while at least `min_world_size` ranks
    /// remain, and its replacement, started alone by the launcher, pulls the current
    /// parameters and is taken back into the round under way. A lost server ends the job.
    ServerWorkers,
}

impl TrainConfig {
    /// How this job changes its members; `None`: a fixed-size job.
    pub fn elasticity(&self) -> Option<Elasticity> {
        self.topology.min_world_size?;
        Some(match self.topology.arch {
            Arch::Flat | Arch::Hierarchical => Elasticity::ServerWorkers,
            _ => Elasticity::Generations,
        })
    }

    /// Ranks per replica of an elastic job: its generations have whole replicas of this
    /// many (a pipeline's stages; 1 for every other way of training).
    pub fn elastic_unit(&self) -> usize {
        match self.topology.arch {
            Arch::Pipeline => self.pipeline.num_stages().max(1),
            _ => 1,
        }
    }
}

impl Default for TopologySection {
    fn default() -> Self {
        Self {
            world_size: 2,
            min_world_size: None,
            arch: Arch::Allreduce,
            parameter_server: None,
            global_server: None,
            servers: 1,
            max_staleness: None,
            staleness_lr: None,
            async_momentum: None,
            local_steps: 1,
            inventory: None,
        }
    }
}

impl TrainConfig {
    /// The topology keys as the cluster crate takes them (a flat server's default filled in).
    pub fn topology_spec(&self) -> TopologySpec {
        let t = &self.topology;
        TopologySpec {
            arch: t.arch,
            parameter_server: t.parameter_server.clone().or_else(|| {
                (t.arch == Arch::Flat).then(|| ServerSpec {
                    aggr_type: Aggregation::Sync,
                    num_workers: t.world_size.saturating_sub(t.servers),
                })
            }),
            global_server: t.global_server.clone(),
            servers: t.servers,
        }
    }

    /// The process topology: `world_size` peers for all-reduce, else the parameter-server
    /// tree (whose size is what `world_size` becomes).
    pub fn topology(&self) -> Result<Topology> {
        let t = match self.topology.arch {
            Arch::Allreduce => Topology::allreduce(self.topology.world_size),
            Arch::Pipeline => {
                self.topology_spec()
                    .validate()
                    .map_err(|e| TrainError::config("config", e.to_string()))?;
                // An elastic pipeline has as many replicas as its generation's ranks make.
                let replicas = match self.topology.min_world_size {
                    Some(_) => self.topology.world_size / self.elastic_unit(),
                    None => self.pipeline.data_parallel,
                };
                Topology::pipeline(self.pipeline.num_stages(), replicas)
            }
            _ => Topology::build(&self.topology_spec()),
        };
        t.map_err(|e| TrainError::config("config", e.to_string()))
    }

    /// The number of processes the job needs.
    pub fn effective_world_size(&self) -> Result<usize> {
        Ok(self.topology()?.world_size())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hcddl_keys_are_accepted_as_they_are() {
        let text = "num_server_rounds: 5\ntarget_accuracy: 0.9\nbatch_size: 32\narch: hierarchical\nglobal_server:\n  aggr_type: sync\n  local_servers:\n    - type: async\n      num_workers: 2\n    - aggr_type: async\n      num_workers: 2\n";
        let c = TrainConfig::from_yaml(text, "hcddl.yaml").expect("parse");
        c.validate().expect("valid");
        assert_eq!(c.effective_world_size().expect("size"), 7);
        assert_eq!(c.schedule.num_server_rounds, Some(5));
        let flat = TrainConfig::from_yaml(
            "arch: flat\nparameter_server: {aggr_type: sync, num_workers: 4}\n",
            "f",
        )
        .expect("flat");
        assert_eq!(flat.effective_world_size().expect("size"), 5);
    }

    #[test]
    fn a_flat_server_without_its_section_makes_every_other_rank_a_sync_worker() {
        let c = |yaml: &str| TrainConfig::from_yaml(yaml, "f").expect("parse");
        let three = c("arch: flat\nworld_size: 3\n");
        three.validate().expect("valid");
        let ps = three.topology_spec().parameter_server.expect("filled in");
        assert_eq!((ps.aggr_type, ps.num_workers), (Aggregation::Sync, 2));
        assert_eq!(three.effective_world_size().expect("size"), 3);
        let sharded = c("arch: flat\nworld_size: 5\nservers: 2\n");
        assert_eq!(sharded.effective_world_size().expect("size"), 5);
        let none_left = c("arch: flat\nworld_size: 2\nservers: 2\n");
        let e = none_left.validate().expect_err("no worker").to_string();
        assert!(e.contains("world_size") && e.contains("at least 3"), "{e}");
        // A written section wins; `world_size` then follows from it.
        let written =
            c("arch: flat\nworld_size: 9\nparameter_server: {aggr_type: async, num_workers: 1}\n");
        assert_eq!(written.effective_world_size().expect("size"), 2);
    }
}
