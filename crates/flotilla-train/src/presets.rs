//! The compare presets: the ways of training a config can be run in, by name — what
//! `flotilla compare --strategies` accepts. Each preset is a change of the topology keys only
//! (model, data, optimizer, seed and budget stay as configured), for a job of `workers` ranks
//! that compute gradients. The table [`PRESETS`] is the one place that says what each name
//! means. (The ways of training themselves are [`crate::strategy`].)

use flotilla_cluster::{Aggregation, Arch, GlobalServerSpec, ServerSpec};

use crate::config::{AllReduceMode, StagesSetting, TrainConfig};
use crate::error::{Result, TrainError};

/// A named way of training (a compare preset).
#[derive(Debug, Clone, Copy)]
pub struct Preset {
    /// The name (`sync_allreduce`, `ps_flat_sync`, ...).
    pub name: &'static str,
    /// What it runs, in a line.
    pub about: &'static str,
    /// Sets the topology keys of a config for `workers` gradient-computing ranks.
    apply: fn(&mut TrainConfig, usize),
}

/// Every preset, in the order `flotilla compare` lists them.
pub const PRESETS: &[Preset] = &[
    Preset {
        name: "sync_allreduce",
        about: "N peers, ring all-reduce of fused gradient buckets every step (DDP, Horovod)",
        apply: |c, n| allreduce(c, n, AllReduceMode::Sync),
    },
    Preset {
        name: "ps_flat_sync",
        about: "one parameter server and N workers; the server averages all N pushes per round",
        apply: |c, n| flat(c, n, Aggregation::Sync),
    },
    Preset {
        name: "ps_flat_async",
        about: "one parameter server and N workers; the server applies each push as it arrives",
        apply: |c, n| flat(c, n, Aggregation::Async),
    },
    Preset {
        name: "ps_hierarchical",
        about: "a sync global server over 2 sync local servers sharing the N workers",
        apply: hierarchical,
    },
    Preset {
        name: "pipeline",
        about: "the model cut into N stages (automatic cut), one rank each, 1 replica",
        apply: pipeline,
    },
    Preset {
        name: "async_allreduce",
        about: "N peers; gradients reduced by a background cycle and applied one step late",
        apply: |c, n| allreduce(c, n, AllReduceMode::Async),
    },
];

/// The presets `flotilla compare` runs when none are named, comma-separated.
pub const DEFAULT_PRESETS: &str = "sync_allreduce,ps_flat_sync,ps_flat_async,ps_hierarchical";

/// The preset called `name`; an error listing the known names otherwise.
pub fn preset(name: &str) -> Result<&'static Preset> {
    PRESETS
        .iter()
        .find(|s| s.name == name)
        .ok_or_else(|| TrainError::UnknownPreset {
            name: name.to_string(),
            known: PRESETS
                .iter()
                .map(|s| s.name)
                .collect::<Vec<_>>()
                .join(", "),
        })
}

/// The ranks computing gradients in `config`: all-reduce peers, parameter-server workers,
/// or every pipeline stage.
pub fn workers(config: &TrainConfig) -> Result<usize> {
    let topology = config.topology()?;
    Ok(match topology.arch() {
        Arch::Flat | Arch::Hierarchical => topology.num_workers(),
        Arch::Allreduce | Arch::Pipeline => topology.world_size(),
    })
}

impl Preset {
    /// `base` run in this preset with `workers` gradient-computing ranks. Only the topology
    /// changes, and what must follow it for the runs to be comparable: evaluation once per
    /// epoch (`schedule.eval_every` back to its default, whose unit differs between
    /// architectures) and the same budget for all (no `num_server_rounds`, no early stop at
    /// `target_accuracy` or `target_loss`: every preset trains `epochs`, or `max_steps`).
    pub fn configure(&self, base: &TrainConfig, workers: usize) -> TrainConfig {
        let mut c = base.clone();
        c.topology.parameter_server = None;
        c.topology.global_server = None;
        c.topology.servers = 1;
        c.allreduce.mode = AllReduceMode::Sync;
        c.schedule.eval_every = None;
        c.schedule.num_server_rounds = None;
        c.schedule.target_accuracy = None;
        c.schedule.target_loss = None;
        (self.apply)(&mut c, workers.max(1));
        c
    }
}

fn allreduce(c: &mut TrainConfig, n: usize, mode: AllReduceMode) {
    c.topology.arch = Arch::Allreduce;
    c.topology.world_size = n;
    c.allreduce.mode = mode;
}

fn flat(c: &mut TrainConfig, n: usize, aggr_type: Aggregation) {
    c.topology.arch = Arch::Flat;
    c.topology.parameter_server = Some(ServerSpec {
        aggr_type,
        num_workers: n,
    });
}

/// Two local servers (one when there is a single worker), the workers split evenly.
fn hierarchical(c: &mut TrainConfig, n: usize) {
    let groups = n.min(2);
    let local_servers = (0..groups)
        .map(|i| ServerSpec {
            aggr_type: Aggregation::Sync,
            num_workers: n / groups + usize::from(i < n % groups),
        })
        .collect();
    c.topology.arch = Arch::Hierarchical;
    c.topology.global_server = Some(GlobalServerSpec {
        aggr_type: Aggregation::Sync,
        local_servers,
    });
}

fn pipeline(c: &mut TrainConfig, n: usize) {
    c.topology.arch = Arch::Pipeline;
    c.pipeline.stages = StagesSetting::Count(n);
    c.pipeline.split_points = None;
    c.pipeline.data_parallel = 1;
    c.pipeline.hosts.clear();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_preset_gives_a_valid_topology_of_its_workers() {
        let base = TrainConfig::default();
        for s in PRESETS {
            let c = s.configure(&base, 3);
            c.validate().unwrap_or_else(|e| panic!("{}: {e}", s.name));
            assert_eq!(workers(&c).expect("topology"), 3, "{}", s.name);
        }
        let h = preset("ps_hierarchical")
            .expect("known")
            .configure(&base, 3);
        assert_eq!(
            h.topology().expect("tree").world_size(),
            6,
            "global + 2 local + 3 workers"
        );
        for name in DEFAULT_PRESETS.split(',') {
            preset(name).expect("default presets are known");
        }
    }

    #[test]
    fn an_unknown_name_lists_the_known_ones() {
        let e = preset("ps_flat").expect_err("unknown").to_string();
        assert!(
            e.contains("ps_flat") && e.contains("sync_allreduce, ps_flat_sync"),
            "{e}"
        );
    }

    #[test]
    fn the_budget_and_evaluation_cadence_are_the_same_for_all() {
        let mut base = TrainConfig::default();
        base.schedule.num_server_rounds = Some(2000);
        base.schedule.target_accuracy = Some(0.98);
        base.schedule.target_loss = Some(1.5);
        base.schedule.eval_every = Some(1);
        let c = preset("ps_flat_async").expect("known").configure(&base, 2);
        assert_eq!(c.schedule.num_server_rounds, None);
        assert_eq!(c.schedule.target_accuracy, None);
        assert_eq!(c.schedule.target_loss, None);
        assert_eq!(c.schedule.eval_every, None);
        assert_eq!(c.schedule.epochs, base.schedule.epochs);
    }
}
