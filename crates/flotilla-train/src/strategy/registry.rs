//! The one place that maps the configured way of training to this rank's strategy: the
//! architecture (and for all-reduce its mode; for parameter servers the rank's role in the
//! topology) picks the constructor, and every strategy builds itself from the config.

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
    Ok(
        match (setup.topology.arch(), cx.config.allreduce.mode, kind) {
            (Arch::Allreduce, AllReduceMode::Sync, _) => Box::new(SyncAllReduce::build(cx, setup)?),
            (Arch::Allreduce, AllReduceMode::Async, _) => {
                Box::new(AsyncAllReduce::build(cx, setup)?)
            }
            (Arch::Pipeline, ..) => Box::new(PipelineStage::build(cx, setup)?),
            (_, _, Some(RoleKind::Worker { .. })) => Box::new(Worker::build(cx, setup)?),
            (_, _, Some(RoleKind::LocalServer { .. })) => Box::new(LocalServer::build(cx, setup)?),
            (_, _, Some(RoleKind::ShardServer { .. } | RoleKind::GlobalServer)) => {
                Box::new(ShardServer::build(cx, setup)?)
            }
            (_, _, None) => return Err(no_role(cx.rank, setup.topology)),
            (_, _, Some(RoleKind::Stage { .. })) => {
                return Err(TrainError::config(
                    "topology",
                    "a pipeline stage is not a parameter-server role",
                ));
            }
        },
    )
}
