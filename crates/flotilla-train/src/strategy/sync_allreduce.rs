//! Synchronous data parallel training over a ring all-reduce, with fusion buckets.

use std::sync::Arc;

use flotilla_comm::{PendingAllReduce, ProcessGroup};
use flotilla_engine::{BatchRef, Engine, ParamLayout};

use crate::batches::Batches;
use crate::bucket::BucketPlan;
use crate::error::{Result, TrainError};
use crate::role::{Cx, Evaluation, Role, Step};

/// What one step produced.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepStats {
    /// This rank's mean loss on its batch.
    pub local_loss: f32,
    /// The mean loss over every rank's batch (the global batch).
    pub global_loss: f32,
}

/// Sync data parallel: every rank computes gradients on its own batch, the gradients are
/// summed by ring all-reduces (one per bucket, started as soon as the bucket is filled, so
/// that reducing bucket `k` overlaps with copying the gradients of bucket `k + 1` out of the
/// engine), averaged, and every rank applies the same optimizer step.
///
/// The mean loss rides along as one extra value at the end of the last bucket, so logging the
/// global loss costs no extra collective.
pub struct SyncAllReduce {
    comm: Arc<dyn ProcessGroup>,
    layout: ParamLayout,
    plan: BucketPlan,
    /// One reusable buffer per bucket; the last one has a slot more for the loss.
    buffers: Vec<Vec<f32>>,
    /// The averaged flat gradient handed to the optimizer.
    flat: Vec<f32>,
}

impl SyncAllReduce {
    /// A strategy for a model of `layout`, with buckets of at most `bucket_bytes`.
    pub fn new(comm: Arc<dyn ProcessGroup>, layout: &ParamLayout, bucket_bytes: usize) -> Self {
        let plan = BucketPlan::new(layout, bucket_bytes);
        let last = plan.buckets.len().saturating_sub(1);
        let buffers = plan
            .buckets
            .iter()
            .enumerate()
            .map(|(k, b)| vec![0.0; b.len() + usize::from(k == last)])
            .collect();
        Self {
            comm,
            layout: layout.clone(),
            plan,
            buffers,
            flat: vec![0.0; layout.total],
        }
    }

    /// The bucket plan in use.
    pub fn plan(&self) -> &BucketPlan {
        &self.plan
    }
}

impl Role for SyncAllReduce {
    fn name(&self) -> &'static str {
        "peer"
    }

    fn evaluation(&self) -> Evaluation {
        Evaluation::Collective
    }

    fn writes_checkpoints(&self) -> bool {
        self.comm.rank() == 0
    }

    fn stops_itself(&self) -> bool {
        true
    }

    fn start(&mut self, cx: &mut Cx<'_>) -> Result<()> {
        self.synchronize_initial_state(cx.engine()?)
    }

    fn step(&mut self, cx: &mut Cx<'_>, data: &mut Batches<'_>, done: u64) -> Result<Step> {
        let lr = cx.lr_at(done);
        let world = self.comm.size() as u64;
        let (_, batch) = {
            let _span = tracing::info_span!(target: "flotilla::train", "data").entered();
            data.next_batch()?
        };
        let samples = batch.labels.len() as u64 * world;
        let stats = self.step_on(cx.engine()?, batch, lr)?;
        Ok(Step {
            progressed: true,
            loss: Some(stats.global_loss),
            samples,
            done: None,
        })
    }
}

impl SyncAllReduce {
    /// Makes every rank start from rank 0's parameters and optimizer state.
    pub fn synchronize_initial_state(&mut self, engine: &mut dyn Engine) -> Result<()> {
        let rank = self.comm.rank();
        let mut params = vec![0.0; engine.num_params()];
        engine.read_params(&mut params)?;
        self.comm.broadcast_f32(&mut params, 0)?;
        let mut state = if rank == 0 {
            engine.optimizer_state()?
        } else {
            Vec::new()
        };
        self.comm.broadcast_bytes(&mut state, 0)?;
        if rank != 0 {
            engine.write_params(&params)?;
            engine.load_optimizer_state(&state)?;
        }
        Ok(())
    }

    /// One training step on this rank's batch at learning rate `lr`.
    pub fn step_on(
        &mut self,
        engine: &mut dyn Engine,
        batch: BatchRef<'_>,
        lr: f64,
    ) -> Result<StepStats> {
        let local_loss = engine.forward_backward(batch)?;
        // A step that failed half-way may have left buffers with the communicator.
        let last_index = self.plan.buckets.len().saturating_sub(1);
        for (k, (buffer, bucket)) in self.buffers.iter_mut().zip(&self.plan.buckets).enumerate() {
            buffer.resize(bucket.len() + usize::from(k == last_index), 0.0);
        }
        let world = self.comm.size() as f32;
        let last = self.plan.buckets.len().saturating_sub(1);
        let mut pending: Vec<PendingAllReduce> = Vec::with_capacity(self.plan.buckets.len());
        {
            let (plan, layout, buffers, comm) =
                (&self.plan, &self.layout, &mut self.buffers, &self.comm);
            let mut current = 0;
            engine.for_each_grad(&mut |i, grad| {
                let bucket = &plan.buckets[current];
                let info = &layout.params[i];
                let at = info.offset - bucket.start;
                buffers[current][at..at + grad.len()].copy_from_slice(grad);
                if i == bucket.last_param {
                    if current == last {
                        buffers[current][bucket.len()] = local_loss;
                    }
                    pending.push(
                        comm.all_reduce_bucket(std::mem::take(&mut buffers[current]), current),
                    );
                    current += 1;
                }
                Ok(())
            })?;
        }
        if pending.len() != self.plan.buckets.len() {
            return Err(TrainError::Divergence(format!(
                "the engine gave gradients for {} of {} buckets",
                pending.len(),
                self.plan.buckets.len()
            )));
        }
        let scale = 1.0 / world;
        let mut global_loss = local_loss;
        for (k, p) in pending.into_iter().enumerate() {
            let summed = p.wait()?;
            let bucket = &self.plan.buckets[k];
            for (dst, src) in self.flat[bucket.start..bucket.end].iter_mut().zip(&summed) {
                *dst = src * scale;
            }
            if k == last {
                global_loss = summed[bucket.len()] * scale;
            }
            self.buffers[k] = summed;
        }
        engine.apply_grads(&self.flat, lr)?;
        Ok(StepStats {
            local_loss,
            global_loss,
        })
    }
}
