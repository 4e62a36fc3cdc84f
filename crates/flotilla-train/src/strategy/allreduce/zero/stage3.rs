//! ZeRO stage 3 (PyTorch FSDP's full sharding): besides the optimizer state and the averaged
//! gradient, each rank keeps only its shard of the **parameters** — the values of
//! [`super::owned_ranges`], one after the other in flat order, as its optimizer steps them.
//! The engine's model holds none between uses ([`Engine::release_params`]): a step runs
//! [`Engine::forward_backward_sharded`], which gathers each backward group's parameters (one
//! bucket's all-gather: the buckets are the engine's backward groups) before its forward
//! and again before its recomputed forward in backward, and hands its gradients to the
//! reduce-scatter of stage 2 (`scatter.rs`) as its backward ends. The optimizer then steps
//! the shard in place ([`ShardOptimizer::step_shard`]): no all-gather after the step; the
//! next step's forward gathers the new values.
//!
//! The update is stage 2's (the same reduce-scatter, the same shard step) and the gathered
//! parameters are the values stage 2's all-gather writes, so stage 3 equals stage 2, and
//! zero 0 where stage 2 does, bit for bit.
//!
//! A whole-model operation between steps (evaluation, the parameters' hash, a checkpoint:
//! each after [`crate::strategy::Strategy::prepare_model`]) gathers every bucket into the
//! engine first ([`Zero::materialize`]); the next step releases them again.
//!
//! [`ShardOptimizer::step_shard`]: flotilla_engine::ShardOptimizer::step_shard

use std::ops::Range;

use flotilla_engine::Engine;
use flotilla_tcp::shard;

use super::{Zero, wire_len};
use crate::bucket::BucketPlan;
use crate::error::{Result, TrainError};

impl Zero {
    /// Whether the parameters are sharded too (stage 3).
    pub fn shards_params(&self) -> bool {
        self.stage == 3
    }

    /// Stage 3's start: keeps this rank's shard of `engine`'s parameters (the same on every
    /// rank after the initial broadcast) and releases them in the engine.
    pub fn take_param_shard(&mut self, engine: &mut dyn Engine) -> Result<()> {
        let mut whole = vec![0.0; self.total];
        engine.read_params(&mut whole)?;
        self.params = Vec::with_capacity(self.optimizer.len());
        for piece in self.optimizer.pieces() {
            self.params.extend_from_slice(&whole[piece.range.clone()]);
        }
        drop(whole);
        engine.release_params()?;
        self.released = true;
        Ok(())
    }

    /// Releases the parameters a whole-model operation gathered ([`Zero::materialize`]),
    /// before a step.
    pub fn release(&mut self, engine: &mut dyn Engine) -> Result<()> {
        if !self.released {
            engine.release_params()?;
            self.released = true;
        }
        Ok(())
    }

    /// Gathers every bucket's parameters into `engine` (collective), for a whole-model
    /// operation between steps; the next step releases them.
    pub fn materialize(&mut self, engine: &mut dyn Engine, plan: &BucketPlan) -> Result<()> {
        if !self.released {
            return Ok(());
        }
        let mut whole = vec![0.0; self.total];
        for (k, bucket) in plan.buckets.iter().enumerate() {
            self.gather_bucket(plan, k, &mut whole[bucket.start..bucket.end])?;
        }
        engine.write_params(&whole)?;
        self.released = false;
        Ok(())
    }

    /// The values of the parameters `params` (a backward group: one bucket's parameters)
    /// into `out`, from every rank's shard (collective).
    pub fn gather_group(
        &mut self,
        plan: &BucketPlan,
        params: Range<usize>,
        out: &mut [f32],
    ) -> Result<()> {
        let k = plan
            .buckets
            .iter()
            .position(|b| b.params == params)
            .ok_or_else(|| {
                TrainError::Divergence(format!(
                    "ZeRO-3: parameters {params:?} are not one bucket's (the buckets are the \
                     engine's backward groups)"
                ))
            })?;
        self.gather_bucket(plan, k, out)
    }

    /// Bucket `k`'s parameter values into `out` (its length): this rank's piece put in its
    /// place of the bucket's wire buffer, which one all-gather fills.
    fn gather_bucket(&mut self, plan: &BucketPlan, k: usize, out: &mut [f32]) -> Result<()> {
        let len = plan.buckets[k].len();
        if out.len() != len {
            return Err(TrainError::Divergence(format!(
                "ZeRO-3: {} values asked of bucket {k}, which has {len}",
                out.len()
            )));
        }
        let slot = &self.slots[k];
        let mut wire = std::mem::take(&mut self.gathered);
        wire.clear();
        wire.resize(wire_len(plan, k), 0.0);
        wire[slot.wire.clone()].copy_from_slice(&self.params[slot.at..slot.at + slot.wire.len()]);
        let gathered = self.comm.all_gather_f32(&mut wire);
        out.copy_from_slice(&wire[..len]);
        self.gathered = wire;
        Ok(gathered?)
    }

    /// Stage 3's step: the optimizer moves this rank's shard of the parameters by its shard
    /// of the averaged gradient at `lr`, in place; returns the global loss, which the rank
    /// whose shard holds the loss slot (its `slot_loss`) tells every rank.
    pub fn step_sharded(&mut self, slot_loss: f32, lr: f64, plan: &BucketPlan) -> Result<f32> {
        self.optimizer
            .step_shard(&mut self.params, &self.grad, lr)?;
        let last = plan.buckets.len().saturating_sub(1);
        let w = wire_len(plan, last);
        let (n, rank) = (self.comm.size(), self.comm.rank());
        let mut loss = [0.0f32];
        if shard(w, n, rank).contains(&(w - 1)) {
            loss[0] = slot_loss;
        }
        self.comm.all_reduce_sum(&mut loss)?;
        Ok(loss[0])
    }

    /// Bytes of parameters this rank keeps between steps (its shard's).
    pub fn param_shard_bytes(&self) -> usize {
        self.params.capacity() * std::mem::size_of::<f32>()
    }
}
