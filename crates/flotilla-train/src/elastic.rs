//! One process of an elastic job (`topology.min_world_size`, `flotilla launch -n MIN:MAX`):
//! its link to the launcher's lighthouse ([`flotilla_tcp::Beacon`]) and the generations it
//! joins ([`flotilla_tcp::TcpGroup::connect_elastic`]). A [`crate::run::Run`] of such a job
//! votes after each step whether the membership changes (a loss, a joiner) so that every
//! member leaves its generation after the same step; a step that fails on a lost member is
//! not counted, and the next generation resumes at the most steps any member holds (its
//! rank 0, whose state every member takes).

use std::sync::Arc;

use flotilla_tcp::{Beacon, CommConfig, CommError, Generation, ProcessGroup, TcpGroup};

use crate::config::TrainConfig;
use crate::error::{Result, TrainError};

/// The variable the launcher names each process of an elastic job by (its slot).
pub const SLOT_ENV: &str = "FLOTILLA_SLOT";

/// An elastic process's membership: its link to the lighthouse and the generation it is a
/// member of. [`crate::run::Run`] holds one for a job of the library's run; a program's own
/// loop holds one through `flotilla_burn::elastic`.
pub struct Elastic {
    beacon: Beacon,
    cfg: CommConfig,
    /// The generation it is a member of.
    pub generation: Generation,
    /// Whether it holds training state (it took part in a generation's start).
    has_state: bool,
    /// The samples of one step over every member (`batch_size` x the most replicas: ranks,
    /// or a pipeline's ranks over its stages).
    pub global_batch: usize,
}

impl Elastic {
    /// Reaches the lighthouse (`comm.master_addr:master_port`) as this process's slot
    /// ([`SLOT_ENV`]; its process id without one) and joins the job's first generation it
    /// can: the first (a start), or a running job's next (a joiner).
    pub fn join(config: &TrainConfig, hash: u64) -> Result<(Arc<dyn ProcessGroup>, Elastic)> {
        let slot = match std::env::var(SLOT_ENV) {
            Ok(v) => v
                .trim()
                .parse::<u64>()
                .map_err(|_| TrainError::config(SLOT_ENV, format!("not a number: {v:?}")))?,
            Err(_) => u64::from(std::process::id()),
        };
        let max = config.topology.world_size;
        let cfg = config.comm_config(None, hash, max)?;
        let mut beacon = Beacon::connect(&cfg, slot)?;
        let (group, generation) = TcpGroup::connect_elastic(cfg.clone(), &mut beacon, None)?;
        let e = Elastic {
            beacon,
            cfg,
            generation,
            has_state: false,
            global_batch: config.step_batch() * max / config.elastic_unit(),
        };
        Ok((Arc::new(group), e))
    }

    /// This process's slot.
    pub fn slot(&self) -> u64 {
        self.beacon.slot()
    }

    /// Whether the lighthouse announced a change (or is lost).
    pub fn changing(&self) -> bool {
        self.beacon.changing()
    }

    /// Joins the next generation, offering the state of `step` steps if it holds one.
    pub fn next(&mut self, step: u64) -> Result<Arc<dyn ProcessGroup>> {
        let offer = self.has_state.then_some(step);
        let (group, generation) =
            TcpGroup::connect_elastic(self.cfg.clone(), &mut self.beacon, offer)?;
        self.generation = generation;
        Ok(Arc::new(group))
    }

    /// The line each member logs as it starts training in its generation: the members'
    /// slots, this process and its `rank`, the `step` it starts from and the parameters'
    /// `hash` (checked the same on every member). One format for the library's run and a
    /// program's own loop (`flotilla_burn::elastic`), which tests and scripts parse.
    pub fn generation_line(&self, rank: usize, step: u64, hash: u64) -> String {
        let g = &self.generation;
        format!(
            "generation {}: {} ranks (slots {:?}), this process (pid {}) rank {rank}, from \
             step {step}; parameters identical on every member (xxh3 {hash:016x})",
            g.number,
            g.slots.len(),
            g.slots,
            std::process::id(),
        )
    }

    /// Tells the lighthouse this process's run ended (after its last collectives).
    pub fn finished(&mut self) {
        self.beacon.finished();
    }

    /// Records whether this process holds training state after a generation's start
    /// (`synced`: it went through; a member other than rank 0 that did not may hold a
    /// mixture).
    pub fn started(&mut self, synced: bool, rank: usize) {
        self.has_state = synced || (self.has_state && rank == 0);
    }
}

/// Whether a run's error is a lost generation, which an elastic process survives by
/// joining the next: a failed or timed-out exchange with a member. The lighthouse's
/// refusals (a stale generation, below the minimum) and local errors are not.
pub fn survivable(e: &TrainError) -> bool {
    match e {
        TrainError::Comm(c) => survivable_comm(c),
        TrainError::Protocol { .. } | TrainError::Peer { .. } => true,
        _ => false,
    }
}

/// Whether a run's error says the job finished while this process stood by (a pipeline's
/// generations had no whole replica with a place for it): it has nothing left to do and
/// ends as the job did, without a final evaluation of its own.
pub fn stood_by(e: &TrainError) -> bool {
    matches!(
        e,
        TrainError::Comm(CommError::Rendezvous(
            flotilla_tcp::RendezvousError::StoodBy { .. }
        ))
    )
}

/// Whether a failed collective is a lost generation (see [`survivable`]): anything but the
/// lighthouse's refusals and a wrong call.
pub fn survivable_comm(c: &CommError) -> bool {
    !matches!(
        c,
        CommError::Rendezvous(_) | CommError::Config(_) | CommError::InvalidArgument(_)
    )
}
