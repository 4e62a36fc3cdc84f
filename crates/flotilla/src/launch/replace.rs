//! Which ranks a job goes on without, and which of them the launcher starts again alone: one
//! policy for a config's job (`flotilla launch CONFIG`) and a program's (`-- PROGRAM`).
//!
//! A rank under an asynchronous server is tolerated (its server trains on without it); so is
//! every worker of an elastic parameter server, flat or hierarchical (`-n MIN:MAX`: its servers leave a lost
//! worker out while the job keeps its minimum). Those that can rejoin
//! (`flotilla_train::rejoin`) are started again, within `--max-restarts`, by `make` with
//! the rejoin variable set.

use std::process::Command;
use std::time::Duration;

use anyhow::Result;
use flotilla_cluster::Topology;
use flotilla_train::TrainConfig;
use flotilla_train::config::Elasticity;

use crate::launch::{LocalJob, Respawn};

/// What starts a rank again: its command by rank, with more environment variables for the
/// rank's process (set where it runs: on its host for an ssh command).
pub type Make = Box<dyn FnMut(usize, &[(String, String)]) -> Result<Command> + Send>;

/// Lets `ranks` go on without its tolerated ranks and start its rejoinable ones again with
/// `make` while `restarts` (used, allowed) leave any; a tolerated rank still running a
/// deadline after the job ended is stopped (one stopped by a signal at once).
pub fn workers(
    ranks: &mut LocalJob,
    (config, topology): (&TrainConfig, &Topology),
    mut make: Make,
    (used, max): (u32, u32),
) {
    let rejoinable = flotilla_train::rejoin::rejoinable(config, topology);
    let mut tolerated = tolerated_ranks(topology);
    if config.elasticity() == Some(Elasticity::ServerWorkers) {
        tolerated.extend(&rejoinable);
    }
    ranks.tolerate(tolerated);
    let left = max.saturating_sub(used);
    if left > 0 && !rejoinable.is_empty() {
        ranks.respawn_with(Respawn {
            make: Box::new(move |rank| {
                let rejoin = (
                    flotilla_train::rejoin::REJOIN_ENV.to_string(),
                    "1".to_string(),
                );
                make(rank, &[rejoin])
            }),
            ranks: rejoinable,
            left,
            total: max,
            used,
            ending: None,
        });
    }
    if let Ok(grace) = Duration::try_from_secs_f64(config.comm.timeout_s) {
        ranks.stop_stragglers_after(grace);
    }
}

/// Ranks whose loss an asynchronous server above them absorbs: a rank is tolerated if any
/// link on its path to the root ends at an `async` server.
fn tolerated_ranks(topology: &Topology) -> Vec<usize> {
    let is_async = |rank: usize| {
        topology
            .role(rank)
            .and_then(|r| r.aggregation)
            .is_some_and(|a| a == flotilla_cluster::Aggregation::Async)
    };
    (0..topology.world_size())
        .filter(|&rank| {
            let mut at = rank;
            for _ in 0..topology.world_size() {
                let Some(parent) = topology.role(at).and_then(|r| r.parents.first().copied())
                else {
                    return false;
                };
                if is_async(parent) {
                    return true;
                }
                at = parent;
            }
            false
        })
        .collect()
}
