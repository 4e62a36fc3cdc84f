//! What every parameter-server role takes from the job as it is built ([`Place`]: its role in
//! the topology, how the run counts its rounds, what it says when it starts) and how it
//! resumes ([`restore`]).

use flotilla_cluster::{Aggregation, Role, RoleKind, Topology};
use flotilla_engine::ModelState;

use crate::checkpoint::{self, CheckpointState};
use crate::config::TrainConfig;
use crate::error::{Result, TrainError};
use crate::plan::Counting;
use crate::strategy::{Cx, Resume, Setup};

/// One rank's place in a parameter-server job.
pub struct Place {
    /// This rank's role: kind, parents and children.
    pub role: Role,
    /// Whether its own level aggregates synchronously (a worker's: `true`).
    pub sync: bool,
    /// Rounds the run takes: `num_server_rounds`, else `max_steps`, else the epochs
    /// (`max_steps` also caps `num_server_rounds`).
    pub rounds: u64,
    /// The root evaluates every this many rounds (default: once per epoch of rounds).
    pub eval_every: u64,
    /// Rounds that take one epoch of the training data.
    pub rounds_per_epoch: u64,
    /// Batches a worker takes per round.
    pub local_steps: usize,
    /// Workers of the job.
    pub workers: usize,
    /// The rank whose parameters every rank takes on resume, in a job of several shard
    /// servers (each starts from its shard of them); `None` with one server.
    pub resync_from: Option<usize>,
    /// What the rank says of its place when it starts.
    pub announcement: Announcement,
    /// The most samples each child (of `role.children`, in order) can claim in a push: the
    /// batch size times the local steps, times the workers under it for a local server.
    pub max_samples: Vec<u64>,
}

/// The lines a parameter-server rank logs when it starts, once the job is restored: at the
/// root the job's placement (run log only), then its role (`role <label>: parents [..]
/// children [..]`, which says the rank is up) and what it holds.
#[derive(Debug, Clone, Default)]
pub struct Announcement {
    /// Each line, and whether it goes to the run log only.
    lines: Vec<(String, bool)>,
}

impl Announcement {
    /// The same, and then `line` (to the run log and the front end).
    pub fn then(mut self, line: String) -> Self {
        self.lines.push((line, false));
        self
    }

    /// Logs the lines.
    pub fn log(&self, cx: &mut Cx<'_>) -> Result<()> {
        for (line, quiet) in &self.lines {
            if *quiet {
                cx.log_quiet(line)?;
            } else {
                cx.log(line)?;
            }
        }
        Ok(())
    }
}

impl Place {
    /// This rank's place in the job of `setup`, and its announcement: its role (and, at the
    /// root, the job's placement on its hosts when an inventory is given, else the roles).
    pub fn of(cx: &Cx<'_>, setup: &Setup<'_>) -> Result<Self> {
        let (config, topology) = (cx.config, setup.topology);
        let Some(role) = topology.role(cx.rank).cloned() else {
            return Err(no_role(cx.rank, topology));
        };
        let placement = if cx.rank == topology.root() {
            placement(config, topology)
        } else {
            String::new()
        };
        let mut announcement = Announcement {
            lines: placement.lines().map(|l| (l.to_string(), true)).collect(),
        };
        announcement = announcement.then(format!(
            "role {}: parents [{}] children [{}]",
            topology.label(cx.rank),
            list(&role.parents),
            list(&role.children)
        ));
        let workers = topology.num_workers();
        let local_steps = config.topology.local_steps.max(1);
        let per_round = workers * config.step_batch() * local_steps;
        let rounds_per_epoch = (setup.samples / per_round.max(1)).max(1) as u64;
        let s = &config.schedule;
        let rounds = match (s.num_server_rounds, s.max_steps) {
            (Some(n), Some(m)) => n.min(m),
            (Some(n), None) => n,
            (None, Some(m)) => m,
            (None, None) => s.epochs.max(1) as u64 * rounds_per_epoch,
        };
        let per_worker = (config.step_batch() as u64).saturating_mul(local_steps as u64);
        let max_samples = role
            .children
            .iter()
            .map(|&c| {
                let below = topology.role(c).map_or(0, |r| r.children.len()).max(1);
                per_worker.saturating_mul(below as u64)
            })
            .collect();
        let shards = topology
            .servers()
            .filter(|r| matches!(r.kind, RoleKind::ShardServer { .. }))
            .count();
        Ok(Self {
            sync: role.aggregation.is_none_or(|a| a == Aggregation::Sync),
            role,
            rounds,
            eval_every: s.eval_every.map_or(rounds_per_epoch, u64::from),
            rounds_per_epoch,
            local_steps,
            workers,
            resync_from: (shards > 1).then(|| topology.root()),
            announcement,
            max_samples,
        })
    }

    /// The most samples `child` can claim in a push (0 for a rank that is not a child).
    pub fn max_samples_of(&self, child: usize) -> u64 {
        self.role
            .children
            .iter()
            .position(|&c| c == child)
            .map_or(0, |i| self.max_samples[i])
    }

    /// How the run counts a role that trains on `shard` of the data (`(1, 0)`: a server).
    pub fn counting(&self, shard: (usize, usize)) -> Counting {
        Counting::Rounds {
            total: self.rounds,
            every: self.eval_every,
            per_epoch: self.rounds_per_epoch,
            local_steps: self.local_steps,
            shard,
        }
    }
}

/// The error of a rank that `topology` gives no role.
pub fn no_role(rank: usize, topology: &Topology) -> TrainError {
    TrainError::config(
        "topology",
        format!(
            "rank {rank} has no role in a topology of {}",
            topology.world_size()
        ),
    )
}

/// `1, 2, 3`.
fn list(ranks: &[usize]) -> String {
    ranks
        .iter()
        .map(|r| r.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The placement of the job on its hosts when an inventory is given, else its roles.
fn placement(config: &TrainConfig, topology: &Topology) -> String {
    match &config.topology.inventory {
        Some(path) => flotilla_cluster::Inventory::load(path)
            .and_then(|inv| flotilla_cluster::place(topology, &inv))
            .map(|p| p.describe())
            .unwrap_or_else(|_| topology.describe()),
        None => topology.describe(),
    }
}

/// A parameter-server rank's resume, on every rank: the root (rank 0) loads the checkpoint
/// into its model (parameters and optimizer state) and every rank learns the round it was
/// taken at. With several shard servers (`resync_from`: the root), the parameters then go from
/// the root to every rank, so that each server starts from its shard of them — a fresh start
/// too: the root's initial model is the job's, whatever the other ranks built (a program's
/// own model may draw other values on each rank). A resumed shard server (`server`) also
/// takes the root's optimizer state, which holds every shard's. `model`: this rank's, and the
/// length of the parameters (a local server holds no model of its own).
pub fn restore(
    cx: &mut Cx<'_>,
    from: &Resume,
    (mut model, len): (Option<&mut dyn ModelState>, usize),
    (resync_from, server): (Option<usize>, bool),
) -> Result<Option<CheckpointState>> {
    let load = |dir: &std::path::Path| match model.as_deref_mut() {
        Some(m) => checkpoint::load(dir, m),
        None => checkpoint::read_state(dir),
    };
    let state = from.share(cx, load)?;
    if from.rejoined() {
        return Ok(state);
    }
    if let Some(root) = resync_from {
        let mut params = vec![0.0f32; len];
        if let Some(m) = &model {
            m.read_params(&mut params)?;
        }
        cx.comm.broadcast_f32(&mut params, root)?;
        if let Some(m) = model.as_deref_mut() {
            m.write_params(&params)?;
        }
        if state.is_some() {
            share_optimizer_state(cx, model, root, server)?;
        }
    }
    Ok(state)
}

/// The root's optimizer state (a resumed checkpoint's: every shard's) to every rank;
/// collective. A shard server (`server`) takes it, the others drop it.
fn share_optimizer_state(
    cx: &mut Cx<'_>,
    model: Option<&mut dyn ModelState>,
    root: usize,
    server: bool,
) -> Result<()> {
    let mut bytes = match (&model, cx.rank == root) {
        (Some(m), true) => m.optimizer_state()?,
        _ => Vec::new(),
    };
    let bound = model.as_ref().map_or(usize::MAX, |m| {
        flotilla_engine::optimizer_state_bound(m.layout())
    });
    cx.comm.broadcast_bytes(&mut bytes, root, bound)?;
    if let Some(m) = model
        && server
        && cx.rank != root
        && !bytes.is_empty()
    {
        m.load_optimizer_state(&bytes)?;
    }
    Ok(())
}
