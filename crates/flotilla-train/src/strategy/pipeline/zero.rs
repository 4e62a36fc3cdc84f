//! ZeRO-1 among the replicas of a pipeline's stage (`allreduce.zero: 1` with `arch:
//! pipeline` and `data_parallel` above 1; [`super::PipelineOptions::zero`]): each of a
//! stage's `D` replicas keeps the optimizer state of its shard of the stage's flat
//! parameters only ([`ShardOptimizer`], 1/D of it), steps that shard by its shard of the
//! gradient the replicas averaged, and all-gathers the stage's parameters from the replicas.
//!
//! The gradient is still all-reduced whole (so that clipping by the global norm reads every
//! value, as without ZeRO), which leaves every replica the bits zero 0 steps with: the
//! parameters are zero 0's bit for bit. A step moves one all-reduce and one all-gather of
//! the stage's size (zero 0: the all-reduce alone).
//!
//! Checkpoints hold the stage's whole optimizer state, as without ZeRO: replica 0 gathers
//! the shards' states into it ([`ReplicaShard::whole_state`]), and each replica loads its
//! shard of a whole state ([`ReplicaShard::load_whole`]). So a checkpoint resumes with or
//! without ZeRO, at another number of replicas or (through `recut.rs`) another cut.

use std::ops::Range;
use std::time::Instant;

use flotilla_engine::{FlatOptimizerState, OptimizerSpec, ShardOptimizer, StageEngine};
use flotilla_tcp::{ProcessGroup, shard};

use crate::error::{Result, TrainError};
use crate::strategy::pipeline::wire::{self, Direction};

/// The part number of a replica's shard of optimizer state in a [`Direction::State`] tag
/// (0 and 1 are a stage's weights and whole optimizer state: `state.rs`).
const SHARD_PART: usize = 2;

/// This replica's part of its stage's optimizer.
pub(super) struct ReplicaShard {
    optimizer: ShardOptimizer,
    /// This replica's shard of the stage's flat parameters ([`shard`] of them among the
    /// replicas, as the all-gather fills it).
    owned: Range<usize>,
}

impl ReplicaShard {
    /// The optimizer of `spec` on the named device over this replica's shard of `stage`,
    /// among the replicas of `replicas`; its state in files under `offload` if given.
    pub(super) fn new(
        stage: &dyn StageEngine,
        replicas: &dyn ProcessGroup,
        spec: &OptimizerSpec,
        device: &str,
        offload: Option<&std::path::Path>,
    ) -> Result<Self> {
        let layout = stage.layout();
        let owned = shard(layout.total, replicas.size(), replicas.rank());
        let mut optimizer =
            ShardOptimizer::new(spec, layout, std::slice::from_ref(&owned), device)?;
        if let Some(base) = offload {
            optimizer.offload_to(base)?;
        }
        Ok(Self { optimizer, owned })
    }

    /// One step at `lr`: this replica's shard of `stage`'s parameters moves by its shard of
    /// the stage's (averaged) gradient, which is then zeroed, and the parameters are
    /// all-gathered from the replicas into the stage. Collective over `replicas`.
    pub(super) fn step(
        &mut self,
        stage: &mut dyn StageEngine,
        replicas: &dyn ProcessGroup,
        lr: f64,
    ) -> Result<()> {
        let mut params = vec![0.0; stage.layout().total];
        stage.read_params(&mut params)?;
        let grads = stage.grads_mut();
        self.optimizer
            .step(&mut params, &grads[self.owned.clone()], lr)?;
        grads.fill(0.0);
        replicas.all_gather_f32(&mut params)?;
        stage.write_params(&params)?;
        Ok(())
    }

    /// Bytes of optimizer state this replica holds (its shard's).
    pub(super) fn state_bytes(&self) -> Result<u64> {
        Ok(self.optimizer.state_bytes()?)
    }

    /// The stage's whole optimizer state (as [`flotilla_engine::ModelState::optimizer_state`]
    /// writes it) on the replicas' rank 0, put together from every replica's shard; `None` on
    /// the others, which send theirs. Collective over `replicas`.
    pub(super) fn whole_state(
        &self,
        stage: &dyn StageEngine,
        replicas: &dyn ProcessGroup,
    ) -> Result<Option<Vec<u8>>> {
        let mine = self.optimizer.state()?;
        let tag = wire::tag(Direction::State, SHARD_PART, 0);
        if replicas.rank() != 0 {
            replicas.send_large(0, tag, &mine)?;
            return Ok(None);
        }
        let (n, layout) = (replicas.size(), stage.layout());
        let deadline = Instant::now() + replicas.timeout();
        let mut states = vec![mine];
        for r in 1..n {
            let state = replicas
                .recv_large(r, tag, deadline)
                .map_err(|e| TrainError::Peer {
                    peer: replicas.world_rank(r),
                    message: format!("waiting for replica {r}'s shard of the optimizer state: {e}"),
                })?;
            states.push(state);
        }
        let ranges: Vec<Range<usize>> = (0..n).map(|r| shard(layout.total, n, r)).collect();
        let parts: Vec<_> = ranges
            .iter()
            .zip(&states)
            .map(|(range, state)| (Some(std::slice::from_ref(range)), state.as_slice()))
            .collect();
        Ok(Some(
            FlatOptimizerState::gather(layout, &parts)?.whole(layout)?,
        ))
    }

    /// Loads this replica's shard of `whole`, a stage's whole optimizer state (as
    /// [`ReplicaShard::whole_state`] or a stage without ZeRO writes it).
    pub(super) fn load_whole(&mut self, stage: &dyn StageEngine, whole: &[u8]) -> Result<()> {
        let layout = stage.layout();
        let flat = FlatOptimizerState::gather(layout, &[(None, whole)])?;
        let mine = flat.shard(layout, std::slice::from_ref(&self.owned))?;
        Ok(self.optimizer.load_state(&mine)?)
    }
}
