//! Parameter servers: flat (one server, N workers) and hierarchical (a global server over
//! local servers, each with its workers), each level `sync` or `async`; workers push
//! gradients, or weight deltas for model averaging (`local_steps > 1`).
//!
//! Every process of the job joins one world at rendezvous and takes the role of its rank in
//! the [`flotilla_cluster::Topology`]. Roles talk by [`protocol::PsMessage`]s, point to
//! point under [`protocol::TAG`]; every message carries the parameter version it
//! refers to, and every wait has the run's deadline.

pub mod aggregate;
pub mod inbox;
pub mod local;
pub mod protocol;
pub mod root;
pub mod serve;
pub mod server;
pub mod worker;

#[cfg(test)]
mod machine_tests;

use std::sync::Arc;

use flotilla_cluster::{RoleKind, Topology};
use flotilla_comm::ProcessGroup;
use flotilla_data::ImageDataset;
use flotilla_engine::{Engine, EvalStats};

use crate::config::TrainConfig;
use crate::error::Result;
use crate::fault::Fault;
use crate::observe::{Observer, StepEvent};
use crate::runlog::RunLog;
use protocol::PsMessage;

/// What every role of a parameter-server job needs.
pub struct PsContext<'a> {
    /// The process group (tagged point-to-point messages).
    pub comm: &'a Arc<dyn ProcessGroup>,
    /// The run configuration.
    pub config: &'a TrainConfig,
    /// This process's engine: the root's holds the model and server-side optimizer; a
    /// worker's computes gradients; a local server uses only its layout.
    pub engine: &'a mut dyn Engine,
    /// The training set.
    pub train: &'a ImageDataset,
    /// The test set (evaluated by the root).
    pub test: &'a ImageDataset,
    /// This process's rank.
    pub rank: usize,
    /// Workers in the whole topology (for data sharding).
    pub num_workers: usize,
    /// Server rounds of the run.
    pub rounds: u64,
    /// Evaluate every this many rounds (0: only at the end).
    pub eval_every: u64,
    /// This rank's log.
    pub log: &'a mut RunLog,
    /// The front end.
    pub observer: &'a mut dyn Observer,
    /// A fault to inject (tests).
    pub fault: Option<Fault>,
    /// The newest evaluation.
    pub last_eval: Option<EvalStats>,
}

impl PsContext<'_> {
    /// Writes a line to the run log and the front end.
    pub fn log(&mut self, line: &str) -> Result<()> {
        self.observer.message(line);
        self.log.line(line)
    }

    /// Writes a line to the run log only (per-round timings).
    pub fn log_quiet(&mut self, line: &str) -> Result<()> {
        self.log.line(line)
    }

    /// Tells the front end a round finished.
    pub fn observe_round(&mut self, round: u64, total: u64, loss: f32) {
        self.observer.step(&StepEvent {
            epoch: 0,
            epochs: 1,
            step_in_epoch: round,
            steps_per_epoch: total,
            step: round,
            total_steps: total,
            loss,
        });
    }

    /// Evaluates the root's model on the full test set and logs it; returns the accuracy.
    pub fn evaluate_and_log(&mut self, round: u64) -> Result<f64> {
        let stats = evaluate_full(self.engine, self.test)?;
        self.last_eval = Some(stats);
        self.log(&format!(
            "eval round {round} test_loss={:.4} test_acc={:.4}",
            stats.loss(),
            stats.accuracy()
        ))?;
        Ok(stats.accuracy())
    }
}

/// Evaluates on the whole test set in one process.
pub fn evaluate_full(engine: &dyn Engine, test: &ImageDataset) -> Result<EvalStats> {
    let labels: Vec<i64> = test.labels().iter().map(|l| *l as i64).collect();
    Ok(engine.evaluate(test.images(), &labels, 1000)?)
}

/// Sends one message to `peer`.
pub fn send(comm: &Arc<dyn ProcessGroup>, peer: usize, msg: &PsMessage) -> Result<()> {
    send_bytes(comm, peer, &msg.encode())
}

/// Sends an already encoded message to `peer` (to encode once for several peers).
pub fn send_bytes(comm: &Arc<dyn ProcessGroup>, peer: usize, bytes: &[u8]) -> Result<()> {
    comm.send(peer, protocol::TAG, bytes)?;
    Ok(())
}

/// What a non-root role reports at the end.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RoleSummary {
    /// Rounds it took part in.
    pub rounds: u64,
    /// Its last training loss.
    pub loss: f32,
}

/// What this rank did, by role.
#[derive(Debug, Clone, PartialEq)]
pub enum PsOutcome {
    /// The root: how the run ended.
    Root(server::RootOutcome),
    /// A local server: how many times it pushed up.
    Local(u64),
    /// A shard server other than the root: updates applied.
    Shard(u64),
    /// A worker.
    Worker(RoleSummary),
}

/// Runs this rank's role of a parameter-server topology.
pub fn run_role(ctx: &mut PsContext<'_>, topology: &Topology) -> Result<PsOutcome> {
    let Some(role) = topology.role(ctx.rank).cloned() else {
        return Err(crate::TrainError::config(
            "topology",
            format!(
                "rank {} has no role in a topology of {}",
                ctx.rank,
                topology.world_size()
            ),
        ));
    };
    let sync = role
        .aggregation
        .map(|a| a == flotilla_cluster::Aggregation::Sync);
    ctx.log(&format!(
        "role {}: parents [{}] children [{}]",
        topology.label(ctx.rank),
        role.parents
            .iter()
            .map(|r| r.to_string())
            .collect::<Vec<_>>()
            .join(", "),
        role.children
            .iter()
            .map(|r| r.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    ))?;
    let n = ctx.engine.num_params();
    let timeout = std::time::Duration::from_secs_f64(ctx.config.comm.timeout_s);
    let shard_servers: Vec<usize> = topology
        .servers()
        .filter(|r| matches!(r.kind, RoleKind::ShardServer { .. }))
        .map(|r| r.rank)
        .collect();
    let ranges = topology.shard_ranges(n);
    match role.kind {
        RoleKind::Worker { index } => {
            let ranges = if role.parents.len() == ranges.len() {
                ranges
            } else {
                flotilla_cluster::balanced_ranges(n, 1)
            };
            Ok(PsOutcome::Worker(worker::run(
                ctx,
                index,
                &role.parents,
                &ranges,
            )?))
        }
        RoleKind::LocalServer { .. } => {
            let parent = role.parents.first().copied().unwrap_or(0);
            let mut m = local::LocalServer::new(ctx, parent, &role.children, sync.unwrap_or(true));
            serve::serve(&mut m, ctx, timeout)?;
            Ok(PsOutcome::Local(m.pushes_up()))
        }
        RoleKind::ShardServer { shard } => {
            let plan = server::ShardPlan {
                index: shard,
                ranges,
                servers: shard_servers,
            };
            let outcome = run_root(ctx, &role.children, sync.unwrap_or(true), plan, timeout)?;
            Ok(if role.is_root() {
                PsOutcome::Root(outcome)
            } else {
                PsOutcome::Shard(outcome.updates)
            })
        }
        RoleKind::GlobalServer => Ok(PsOutcome::Root(run_root(
            ctx,
            &role.children,
            sync.unwrap_or(true),
            server::ShardPlan::whole(n),
            timeout,
        )?)),
    }
}

/// Runs a root or shard server until it stops, then stops its children.
fn run_root(
    ctx: &mut PsContext<'_>,
    children: &[usize],
    sync: bool,
    plan: server::ShardPlan,
    timeout: std::time::Duration,
) -> Result<server::RootOutcome> {
    let mut m = root::RootServer::new(ctx, children, sync, plan)?;
    serve::serve(&mut m, ctx, timeout)?;
    m.finish(ctx)
}
