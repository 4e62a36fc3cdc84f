//! What the formula tests of the servers share: servers built by their production
//! constructors (engine optimizer and staleness policy from [`super::staleness::for_job`]),
//! driven one event at a time on an in-memory world, and the root's update written out.

use std::sync::Arc;
use std::time::{Duration, Instant};

use flotilla_cluster::{Aggregation, GlobalServerSpec, ServerSpec, Topology};
use flotilla_tcp::ProcessGroup;

use super::local::LocalServer;
use super::serve::{ServerMachine, serve_one};
use super::shard_server::ShardServer;
use crate::config::{LrSchedule, TrainConfig};
use crate::strategy::Strategy;
use crate::testkit::{Rank, SgdRef, config, params, sgd};
use flotilla_ps::Inbox;
use flotilla_ps::{PsMessage, TAG};

/// The configured optimizer: SGD, this rate and momentum, cosine over [`ROUNDS`] rounds.
pub(crate) const LR: f64 = 0.2;
pub(crate) const MOMENTUM: f64 = 0.9;
pub(crate) const ROUNDS: u64 = 4;
/// Parameters of [`crate::testkit::SPEC`].
pub(crate) const N: usize = 35;

/// A config of `topology` keys over the test optimizer and schedule ([`ROUNDS`] rounds).
pub(crate) fn ps_config(set: impl FnOnce(&mut crate::config::TopologySection)) -> TrainConfig {
    let mut c = config(sgd(LR, MOMENTUM));
    c.schedule.lr_schedule = LrSchedule::Cosine;
    c.schedule.num_server_rounds = Some(ROUNDS);
    set(&mut c.topology);
    c
}

/// Flat parameter servers (`shards` of them) of `aggr` over `workers` workers.
pub(crate) fn flat(t: &mut crate::config::TopologySection, aggr: Aggregation, shards: usize) {
    t.arch = flotilla_cluster::Arch::Flat;
    t.parameter_server = Some(ServerSpec {
        aggr_type: aggr,
        num_workers: 2,
    });
    t.servers = shards;
}

/// A global server of `global` over two local servers of `local`, two workers each.
pub(crate) fn hierarchical(
    t: &mut crate::config::TopologySection,
    global: Aggregation,
    local: Aggregation,
) {
    t.arch = flotilla_cluster::Arch::Hierarchical;
    let spec = ServerSpec {
        aggr_type: local,
        num_workers: 2,
    };
    t.global_server = Some(GlobalServerSpec {
        aggr_type: global,
        local_servers: vec![spec.clone(), spec],
    });
}

/// Fixed gradient number `i`: 35 different values in [-1, 1).
pub(crate) fn grad(i: usize) -> Vec<f32> {
    (0..N)
        .map(|j| ((i * 31 + j * 17 + 5) % 23) as f32 / 11.5 - 1.0)
        .collect()
}

/// A worker's push of `values` computed on `version` (a worker carries no staleness).
pub(crate) fn push(version: u64, samples: u32, values: &[f32]) -> Vec<u8> {
    PsMessage::Push {
        version,
        staleness: 0,
        samples,
        loss: 1.0,
        delta: false,
        values: values.to_vec(),
    }
    .encode()
}

/// The sample-weighted mean of pushes, summed in arrival order as a server sums them:
/// `(Σ sᵢ·vᵢ) · (1 / Σ sᵢ)` in f32.
pub(crate) fn weighted_mean<V: AsRef<[f32]>>(parts: &[(u32, V)]) -> Vec<f32> {
    let mut sum = [0.0f32; N];
    let mut samples = 0u64;
    for (s, v) in parts {
        let w = *s as f32;
        for (a, b) in sum.iter_mut().zip(v.as_ref()) {
            *a += w * b;
        }
        samples += u64::from(*s);
    }
    let scale = 1.0 / samples as f32;
    sum.iter().map(|a| a * scale).collect()
}

/// One server under test: its rank, the machine its production constructor built (the one
/// the trainer's registry calls) and its inbox, driven one event at a time as its step does.
pub(crate) struct Server<M> {
    pub(crate) rank: Rank,
    pub(crate) machine: M,
    inbox: Inbox,
}

impl Server<ShardServer> {
    /// The root or shard server of `comm`'s rank in `topology`, in a job of `config`.
    pub(crate) fn updating(
        comm: Arc<dyn ProcessGroup>,
        config: &TrainConfig,
        topology: &Topology,
    ) -> Self {
        let mut rank = Rank::new(comm, config.clone(), 16);
        rank.rounds = ROUNDS;
        let machine = rank.build(topology, ShardServer::build);
        Self::with(rank, machine)
    }
}

impl Server<LocalServer> {
    /// The local server of `comm`'s rank in `topology`, started (it pulled from its parent).
    pub(crate) fn local(
        comm: Arc<dyn ProcessGroup>,
        config: &TrainConfig,
        topology: &Topology,
    ) -> Self {
        let mut rank = Rank::new(comm, config.clone(), 16);
        let mut machine = rank.build(topology, LocalServer::build);
        machine.on_start(&mut rank.cx()).expect("start");
        Self::with(rank, machine)
    }
}

impl<M: ServerMachine + Strategy> Server<M> {
    fn with(rank: Rank, machine: M) -> Self {
        let inbox = Inbox::listen(&rank.comm, &machine.peers());
        Self {
            rank,
            machine,
            inbox,
        }
    }

    /// The parameters the server holds.
    pub(crate) fn params(&mut self) -> Vec<f32> {
        params(&mut self.machine)
    }

    /// Takes the one event waiting (at most `wait`) and sends what it held back for the
    /// loop, which goes on.
    pub(crate) fn try_step(&mut self, wait: Duration) -> crate::Result<()> {
        let mut cx = self.rank.cx();
        serve_one(&mut self.machine, &mut cx, &self.inbox, wait)?;
        ServerMachine::flush(&mut self.machine, &mut cx)
    }

    /// Takes the one event waiting (at most 5 s), which must succeed.
    pub(crate) fn step(&mut self) {
        self.try_step(Duration::from_secs(5)).expect("server event");
    }
}

/// Reads the parameters `from` sent to `me` (within 5 s).
pub(crate) fn answer(me: &dyn ProcessGroup, from: usize) -> (u64, Vec<f32>) {
    let bytes = me
        .recv(from, TAG, Instant::now() + Duration::from_secs(5))
        .expect("answer");
    match PsMessage::decode(&bytes, from).expect("decodes") {
        PsMessage::Params { version, values } => (version, values),
        other => panic!("expected parameters from rank {from}, got {other:?}"),
    }
}

/// The updating server's formula: each update is one optimizer step (SGD with the server's
/// momentum) with the mean push, at the cosine rate of its round (`updates / children` for an
/// async server), divided by `1 + staleness` when scaled.
pub(crate) struct RootRef {
    pub(crate) w: Vec<f32>,
    opt: SgdRef,
    pub(crate) updates: u64,
    per_round: u64,
    scaled: bool,
}

impl RootRef {
    /// From parameters `w`, momentum `momentum`, `per_round` updates a round.
    pub(crate) fn new(w: Vec<f32>, momentum: f64, per_round: u64, scaled: bool) -> Self {
        Self {
            w,
            opt: SgdRef::new(momentum),
            updates: 0,
            per_round,
            scaled,
        }
    }

    /// Applies `mean` of staleness `staleness`.
    pub(crate) fn apply(&mut self, mean: &[f32], staleness: u64) {
        let round = self.updates / self.per_round;
        let mut lr = LrSchedule::Cosine.lr_at(LR, round, ROUNDS, 0);
        if self.scaled {
            lr /= 1.0 + staleness as f64;
        }
        self.opt.step(&mut self.w, mean, lr);
        self.updates += 1;
    }
}
