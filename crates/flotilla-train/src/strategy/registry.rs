//! The one place that maps the configured way of training to this rank's strategy: the
//! architecture (and for all-reduce its mode; for parameter servers the rank's role in the
//! topology) picks the constructor ([`build`]), and every strategy builds itself from the
//! config; [`role_label`] names what a rank will be before it is built.

use flotilla_cluster::{Arch, RoleKind};

use super::allreduce::{AsyncAllReduce, SyncAllReduce};
use super::context::{Cx, Setup};
use super::interface::Strategy;
use super::pipeline::PipelineStage;
use super::ps::job::no_role;
use super::ps::local::LocalServer;
use super::ps::shard_server::ShardServer;
use super::ps::worker::Worker;
use crate::config::AllReduceMode;
use crate::error::{Result, TrainError};

/// Builds this rank's strategy for the job of `setup` (collective for a pipeline, whose
/// stages agree on the cut).
pub fn build(cx: &mut Cx<'_>, setup: &Setup<'_>) -> Result<Box<dyn Strategy>> {
    let kind = setup.topology.role(cx.rank).map(|r| r.kind);
    let strategy: Box<dyn Strategy> = match (setup.topology.arch(), cx.config.allreduce.mode, kind)
    {
        (Arch::Allreduce, AllReduceMode::Sync, _) => Box::new(SyncAllReduce::build(cx, setup)?),
        (Arch::Allreduce, AllReduceMode::Async, _) => Box::new(AsyncAllReduce::build(cx, setup)?),
        (Arch::Pipeline, ..) => Box::new(PipelineStage::build(cx, setup)?),
        (_, _, Some(RoleKind::Worker { .. })) => Box::new(Worker::build(cx, setup)?),
        (_, _, Some(RoleKind::LocalServer { .. })) => Box::new(LocalServer::build(cx, setup)?),
        (_, _, Some(RoleKind::ShardServer { .. } | RoleKind::GlobalServer)) => {
            Box::new(ShardServer::build(cx, setup)?)
        }
        (_, _, Some(RoleKind::Stage { .. })) => {
            return Err(TrainError::config(
                "topology",
                "a pipeline stage is not a parameter-server role",
            ));
        }
        (_, _, None) => return Err(no_role(cx.rank, setup.topology)),
    };
    Ok(strategy)
}

/// What rank `rank` does in `topology`, in a word (`peer`, `stage`, `root`, `shard-server`,
/// `global-server`, `local-server`, `worker`).
pub fn role_label(topology: &flotilla_cluster::Topology, rank: usize) -> &'static str {
    match topology.arch() {
        Arch::Allreduce => return "peer",
        Arch::Pipeline => return "stage",
        Arch::Flat | Arch::Hierarchical => {}
    }
    match topology.role(rank).map(|r| r.kind) {
        Some(RoleKind::ShardServer { .. }) if rank == flotilla_cluster::ROOT_RANK => "root",
        Some(RoleKind::ShardServer { .. }) => "shard-server",
        Some(RoleKind::GlobalServer) => "global-server",
        Some(RoleKind::LocalServer { .. }) => "local-server",
        Some(RoleKind::Stage { .. }) => "stage",
        Some(RoleKind::Worker { .. }) | None => "worker",
    }
}
