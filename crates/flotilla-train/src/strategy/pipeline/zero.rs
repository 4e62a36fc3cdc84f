//! ZeRO-1 and ZeRO-2 among the replicas of a pipeline's stage (`allreduce.zero: 1` or `2`
//! with `arch: pipeline` and `data_parallel` above 1; [`super::PipelineOptions::zero`]): each
//! of a stage's `D` replicas keeps the optimizer state of its shard of the stage's flat
//! parameters only ([`ShardOptimizer`], 1/D of it), steps that shard by its shard of the
//! gradient the replicas averaged, and all-gathers the stage's parameters from the replicas.
//!
//! ZeRO-1 all-reduces the gradient whole; ZeRO-2 reduce-scatters it (`pipe.rs`:
//! `Pipeline::average`), each replica summing only its shard: one reduce-scatter and one
//! all-gather of the stage's size a step, the traffic of one all-reduce (ZeRO-1: an
//! all-reduce and an all-gather). Both leave the replica's shard with the bits zero 0's
//! all-reduce gives it, and clipping reads each replica's shard (its squares summed over the
//! world), so the parameters are zero 0's bit for bit at either stage. The stage still
//! accumulates its whole gradient over a step's micro-batches, as PyTorch's pipelining with
//! FSDP does (DeepSpeed refuses ZeRO-2 under a pipeline for this): the gradient memory a
//! replica saves is none; the traffic, and the optimizer state, it does save.
//!
//! Checkpoints hold each replica's shard of the stage's optimizer state, written by the
//! replica itself (`state.rs`: [`ReplicaShard::optimizer`]), and the replicas' ranges. A
//! replica resumed at the same shard loads its own file ([`ReplicaShard::load_shard`]); at
//! another number of replicas, another ZeRO stage or another cut, or from a checkpoint of a
//! stage without ZeRO, its shard is cut out of the checkpoint's state files, reading only
//! what meets it ([`ReplicaShard::recut`]), by itself or by rank 0 for it (`restore.rs`).
//! Tests compare them with the stage's whole state put together on replica 0
//! (`ReplicaShard::whole_state`, tests only).

use std::ops::Range;
#[cfg(test)]
use std::time::Instant;

#[cfg(test)]
use flotilla_engine::FlatOptimizerState;
use flotilla_engine::{OptimizerSpec, ShardOptimizer, ShardRecut, StageEngine};
use flotilla_tcp::{ProcessGroup, shard};

use crate::error::Result;
#[cfg(test)]
use crate::error::TrainError;
#[cfg(test)]
use crate::strategy::pipeline::wire::{self, Direction};

/// The part number of a replica's shard of optimizer state in a [`Direction::State`] tag
/// (0 and 1 are a stage's weights and whole optimizer state: `state.rs`).
#[cfg(test)]
const SHARD_PART: usize = 2;

/// This replica's part of its stage's optimizer.
pub(super) struct ReplicaShard {
    optimizer: ShardOptimizer,
    /// This replica's shard of the stage's flat parameters ([`owned`]).
    owned: Vec<Range<usize>>,
}

/// Replica `r` of `d`'s shard of a stage of `total` values: under ZeRO-1 and 2 the [`shard`]
/// of them all (as the all-gather and the reduce-scatter of the whole stage cut it); under
/// ZeRO-3 its shard of each parameter group's values (`groups`: their flat ranges), as the
/// group's all-gather cuts it.
pub(super) fn owned(
    total: usize,
    groups: Option<&[Range<usize>]>,
    d: usize,
    r: usize,
) -> Vec<Range<usize>> {
    match groups {
        None => vec![shard(total, d, r)],
        Some(groups) => (groups.iter())
            .map(|g| {
                let s = shard(g.len(), d, r);
                g.start + s.start..g.start + s.end
            })
            .collect(),
    }
}

impl ReplicaShard {
    /// The optimizer of `spec` on the named device over this replica's shard of `stage`
    /// (`owned`, [`owned`]); its state in files under `offload` if given.
    pub(super) fn new(
        stage: &dyn StageEngine,
        owned: Vec<Range<usize>>,
        spec: &OptimizerSpec,
        device: &str,
        offload: Option<&std::path::Path>,
    ) -> Result<Self> {
        let mut optimizer = ShardOptimizer::new(spec, stage.layout(), &owned, device)?;
        if let Some(base) = offload {
            optimizer.offload_to(base)?;
        }
        Ok(Self { optimizer, owned })
    }

    /// ZeRO-3's step at `lr`: `values`, this replica's shard of the parameters (its pieces'
    /// values one after the other in flat order), move by `grad` (the same pieces' average
    /// gradient), in place.
    pub(super) fn step_shard(&mut self, values: &mut [f32], grad: &[f32], lr: f64) -> Result<()> {
        Ok(self.optimizer.step_shard(values, grad, lr)?)
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
        match self.owned.as_slice() {
            [one] => self.optimizer.step(&mut params, &grads[one.clone()], lr)?,
            ranges => {
                let mine: Vec<f32> = (ranges.iter())
                    .flat_map(|r| grads[r.clone()].iter().copied())
                    .collect();
                self.optimizer.step(&mut params, &mine, lr)?;
            }
        }
        grads.fill(0.0);
        replicas.all_gather_f32(&mut params)?;
        stage.write_params(&params)?;
        Ok(())
    }

    /// This replica's optimizer (its state written into a checkpoint by
    /// [`ShardOptimizer::save_state`]).
    pub(super) fn optimizer(&self) -> &ShardOptimizer {
        &self.optimizer
    }

    /// Loads this replica's own shard of the optimizer state (as [`ReplicaShard::optimizer`]
    /// wrote it).
    pub(super) fn load_shard(&mut self, bytes: Vec<u8>) -> Result<()> {
        Ok(self.optimizer.load_state(bytes)?)
    }

    /// Bytes of optimizer state this replica holds (its shard's).
    pub(super) fn state_bytes(&self) -> Result<u64> {
        Ok(self.optimizer.state_bytes()?)
    }

    /// Tests only: the reference the replicas' own shard files are checked against.
    /// The stage's whole optimizer state (as [`flotilla_engine::ModelState::optimizer_state`]
    /// writes it) on the replicas' rank 0, put together from every replica's shard; `None` on
    /// the others, which send theirs. Collective over `replicas`.
    #[cfg(test)]
    pub(super) fn whole_state(
        &self,
        stage: &dyn StageEngine,
        replicas: &dyn ProcessGroup,
        groups: Option<&[Range<usize>]>,
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
        let ranges: Vec<Vec<Range<usize>>> =
            (0..n).map(|r| owned(layout.total, groups, n, r)).collect();
        let parts: Vec<_> = ranges
            .iter()
            .zip(&states)
            .map(|(ranges, state)| (Some(ranges.as_slice()), state.as_slice()))
            .collect();
        let flat = FlatOptimizerState::gather(layout, &parts)?;
        // The shards' records go before the whole record is made: one copy fewer at the peak.
        drop(parts);
        drop(states);
        Ok(Some(flat.whole(layout)?))
    }

    /// This replica's shard of the stage's flat parameters ([`owned`]).
    pub(super) fn owned_ranges(&self) -> &[Range<usize>] {
        &self.owned
    }

    /// This replica's shard of `stage`'s optimizer state, to cut out of the state files of a
    /// checkpoint sharded otherwise, reading only what meets it.
    pub(super) fn recut(&self, stage: &dyn StageEngine) -> Result<ShardRecut> {
        Ok(ShardRecut::new(stage.layout(), &self.owned)?)
    }
}
