//! ZeRO stage 2's gradient path: every bucket goes through one bucket-sized staging buffer.
//!
//! A bucket's gradients are copied into the staging buffer as backward gives them, and the
//! buffer is handed to the bucket's reduce-scatter ([`ProcessGroup::reduce_scatter_bucket`])
//! as soon as the bucket is complete. When the next bucket's first gradient arrives, that
//! reduce-scatter is waited for, the rank's shard of the sum is kept (scaled by `1/N`) in
//! the shard's gradient ([`Zero::keep_shard`]) and the buffer is reused for the next
//! bucket. So a rank holds, besides burn's own gradients, one bucket's wire buffer and its
//! 1/N shard of the gradient, never the whole model's; the reduce-scatter of bucket *k*
//! still overlaps the backward of the layers before it (what does not overlap is the copy
//! of bucket *k+1*, which waits for the buffer).
//!
//! With gradient accumulation (DDP's and FSDP's `no_sync`), the earlier micro-batches'
//! gradients are summed locally, whole (as FSDP's `no_sync` keeps them unsharded; stage 3
//! runs them through the shards, [`Zero::local_pass`]), and added to the last micro-batch's
//! as they enter the staging buffer: one reduce-scatter per step, the same sums in the same
//! order as stage 1 and plain all-reduce.
//!
//! Invariant: backward gives each bucket's gradients together (the buckets are the engine's
//! backward groups; one backward pass gives them in flat order, which keeps each bucket's
//! together too). A gradient of another bucket arriving while one is half filled is an
//! error, as is a bucket left incomplete.

use std::ops::Range;

use flotilla_engine::{BatchRef, Engine, ParamLayout, ShardedPass};
use flotilla_tcp::{PendingAllReduce, ProcessGroup};

use super::zero::{Zero, wire_len};
use crate::bucket::BucketPlan;
use crate::error::{Result, TrainError};
use crate::strategy::accumulate::MicroBatches;

/// One step's buckets on their way through the staging buffer.
struct Scatter<'a> {
    comm: &'a dyn ProcessGroup,
    accumulated: &'a MicroBatches,
    plan: &'a BucketPlan,
    layout: &'a ParamLayout,
    zero: &'a mut Zero,
    /// The staging buffer while this rank holds it (`None` while a reduce-scatter has it).
    buffer: Option<Vec<f32>>,
    /// The bucket being filled and how many of its tensors arrived.
    filling: Option<(usize, usize)>,
    /// The bucket whose reduce-scatter is under way.
    pending: Option<(usize, PendingAllReduce)>,
    /// This rank's loss, once the engine gave it.
    loss: Option<f32>,
    /// The loss slot's mean over the ranks (meaningful on the rank whose shard holds it).
    global_loss: Option<f32>,
    /// Which buckets were reduce-scattered.
    reduced: Vec<bool>,
    /// Why the gradient callback stopped the pass (the engine returns only its text).
    error: Option<TrainError>,
    /// This rank's share of the global batch times the ranks (1: equal shares): its
    /// gradients and loss are scaled by it, so that the mean is the global batch's.
    weight: f32,
}

/// Runs forward and backward on `batch` and reduce-scatters every bucket of `plan`
/// through `zero`'s staging buffer, keeping this rank's shard of the averaged gradient in
/// `zero`. Returns this rank's loss and the loss slot's mean (the global loss on the rank
/// whose shard holds the slot; [`Zero::step`] tells every rank). `weight`: this rank's
/// share of the global batch times the ranks (1: equal shares).
pub fn reduce_scatter_step(
    zero: &mut Zero,
    comm: &dyn ProcessGroup,
    engine: &mut dyn Engine,
    (plan, layout): (&BucketPlan, &ParamLayout),
    (batch, accumulated): (BatchRef<'_>, &MicroBatches),
    (overlap, weight): (bool, f32),
) -> Result<(f32, f32)> {
    let buffer = Some(zero.take_staging());
    let mut s = Scatter {
        comm,
        accumulated,
        plan,
        layout,
        zero,
        buffer,
        filling: None,
        pending: None,
        loss: None,
        global_loss: None,
        reduced: vec![false; plan.buckets.len()],
        error: None,
        weight,
    };
    let passed = if s.zero.shards_params() {
        // Stage 3: the engine gathers each group's parameters through `s` too.
        engine.forward_backward_sharded(batch, &mut s)
    } else if overlap {
        engine.forward_backward_streaming(batch, &mut |i, g| s.on_grad(i, g))
    } else {
        engine.forward_backward(batch).and_then(|loss| {
            // The loss is known before the first gradient: the last bucket starts when full.
            s.loss = Some(loss);
            engine.for_each_grad(&mut |i, g| s.on_grad(i, g))?;
            Ok(loss)
        })
    };
    let loss = match (passed, s.error.take()) {
        (_, Some(e)) => return Err(e),
        (passed, None) => passed?,
    };
    s.end(loss)?;
    let global = s.global_loss.unwrap_or(loss);
    Ok((loss, global))
}

impl Scatter<'_> {
    /// Copies parameter `i`'s gradient into the staging buffer (taking the buffer for its
    /// bucket first when it is the bucket's first tensor); starts the reduce-scatter of a
    /// complete bucket.
    fn on_grad(&mut self, i: usize, grad: &[f32]) -> flotilla_engine::Result<()> {
        let k = self.plan.bucket_of(i);
        if self.filling.map(|(f, _)| f) != Some(k)
            && let Err(e) = self.open(k)
        {
            let text = e.to_string();
            self.error = Some(e);
            return Err(flotilla_engine::EngineError::Callback(text));
        }
        let bucket = &self.plan.buckets[k];
        let at = self.layout.params[i].offset - bucket.start;
        let Some(buffer) = self.buffer.as_mut() else {
            return Err(flotilla_engine::EngineError::Callback(
                "stage 2: the staging buffer is with a reduce-scatter".into(),
            ));
        };
        let dst = &mut buffer[at..at + grad.len()];
        self.accumulated
            .add_into(dst, grad, self.layout.params[i].offset);
        if self.weight != 1.0 {
            dst.iter_mut().for_each(|v| *v *= self.weight);
        }
        let filled = self.filling.map_or(0, |(_, n)| n) + 1;
        self.filling = Some((k, filled));
        if filled == bucket.params.len() && (k + 1 < self.plan.buckets.len() || self.loss.is_some())
        {
            self.launch(k);
        }
        Ok(())
    }

    /// Makes the staging buffer bucket `k`'s: the bucket before it must be complete, and
    /// its reduce-scatter is waited for first.
    fn open(&mut self, k: usize) -> Result<()> {
        if let Some((j, _)) = self.filling {
            return Err(incomplete(j, "another bucket's gradients arrived"));
        }
        if self.reduced[k] || self.pending.as_ref().is_some_and(|(p, _)| *p == k) {
            return Err(TrainError::Divergence(format!(
                "stage 2: bucket {k}'s gradients arrived twice in one step"
            )));
        }
        self.finish()?;
        let buffer = self.buffer.get_or_insert_with(Vec::new);
        buffer.resize(wire_len(self.plan, k), 0.0);
        self.filling = Some((k, 0));
        Ok(())
    }

    /// Starts bucket `k`'s reduce-scatter with the staging buffer (the loss in the last
    /// bucket's slot).
    fn launch(&mut self, k: usize) {
        let Some(mut buffer) = self.buffer.take() else {
            return;
        };
        if k + 1 == self.plan.buckets.len() {
            // The mean of the step's micro-batch losses.
            let n = self.plan.buckets[k].len();
            let loss = self.loss.unwrap_or_default();
            buffer[n] = self.accumulated.mean_loss(loss) * self.weight;
        }
        self.filling = None;
        self.pending = Some((k, self.comm.reduce_scatter_bucket(buffer, k)));
    }

    /// Waits for the reduce-scatter under way and keeps this rank's shard of it; the
    /// staging buffer comes back.
    fn finish(&mut self) -> Result<()> {
        let Some((k, pending)) = self.pending.take() else {
            return Ok(());
        };
        let summed = pending.wait()?;
        // The mean over the ranks and the step's micro-batches (the loss slot holds a mean
        // over the micro-batches already).
        let micro = self.accumulated.steps as f32;
        let scale = 1.0 / (self.comm.size() as f32 * micro);
        self.zero.keep_shard(k, &summed, scale, self.accumulated);
        if k + 1 == self.plan.buckets.len() {
            self.global_loss = Some(summed[self.plan.buckets[k].len()] * scale * micro);
        }
        self.reduced[k] = true;
        self.buffer = Some(summed);
        Ok(())
    }

    /// After backward (`loss` known): starts the last bucket, waits for it and gives the
    /// staging buffer back to `zero`; every bucket must have been reduce-scattered.
    fn end(&mut self, loss: f32) -> Result<()> {
        self.loss = Some(loss);
        let last = self.plan.buckets.len().saturating_sub(1);
        match self.filling {
            Some((k, n)) if k == last && n == self.plan.buckets[k].params.len() => {
                self.launch(k);
            }
            Some((k, _)) => return Err(incomplete(k, "backward ended")),
            None => {}
        }
        self.finish()?;
        if let Some(k) = self.reduced.iter().position(|r| !r) {
            return Err(incomplete(k, "backward ended"));
        }
        if let Some(buffer) = self.buffer.take() {
            self.zero.return_staging(buffer);
        }
        Ok(())
    }
}

/// Stage 3's pass: a group's parameters are gathered from every rank's shard, after the
/// reduce-scatter under way (the one collective at a time on the group).
impl ShardedPass for Scatter<'_> {
    fn gather(&mut self, params: Range<usize>, out: &mut [f32]) -> flotilla_engine::Result<()> {
        let gathered = self
            .finish()
            .and_then(|()| self.zero.gather_group(self.plan, params, out));
        gathered.map_err(|e| {
            let text = e.to_string();
            self.error = Some(e);
            flotilla_engine::EngineError::Callback(text)
        })
    }

    fn prefetch(&mut self, params: Range<usize>) -> flotilla_engine::Result<()> {
        self.zero.prefetch_group(self.plan, params).map_err(|e| {
            let text = e.to_string();
            self.error = Some(e);
            flotilla_engine::EngineError::Callback(text)
        })
    }

    fn ready(&mut self, param: usize, grad: &[f32]) -> flotilla_engine::Result<()> {
        self.on_grad(param, grad)
    }
}

/// The error of bucket `k` left incomplete when `what`.
fn incomplete(k: usize, what: &str) -> TrainError {
    TrainError::Divergence(format!(
        "stage 2: {what} before the engine gave every gradient of bucket {k}"
    ))
}
