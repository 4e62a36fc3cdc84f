//! Gradient accumulation (`allreduce.accumulation_steps`, DDP's `no_sync`): a step's batch
//! is cut into `k` equal micro-batches; all but the last are differentiated and summed
//! locally, without a collective, and the last one's gradients go out with that sum added
//! as the backward produces them (or, for a parameter-server worker, before its push).
//! Every data-parallel strategy that accumulates (sync with any ZeRO stage, async, a
//! worker) does it through [`MicroBatches`], so they sum in one order.
//!
//! Sync all-reduce may instead reduce every micro-batch's gradients as its backward gives
//! them (`allreduce.reduce_each_micro_batch`: DDP without `no_sync`, FSDP's default and
//! DeepSpeed's ZeRO-2/3): each reduction is kept scaled by `1/(N·k)` ([`MicroBatches::keep`],
//! the first one written, the later ones added in micro-batch order), so nothing whole is
//! summed on the rank and under ZeRO-2/3 the gradient stays this rank's shard throughout,
//! at the price of one reduction per micro-batch instead of one per step.

use flotilla_engine::{BatchRef, Engine, ParamLayout};

use crate::error::{Result, TrainError};

/// Where a parameter's gradient goes: its index and its values.
pub type GradSink<'a> = dyn FnMut(usize, &[f32]) -> flotilla_engine::Result<()> + 'a;

/// How a micro-batch is differentiated: its gradients handed, parameter by parameter, to
/// the [`GradSink`]; its loss returned.
pub type Differentiate<'a> = dyn FnMut(BatchRef<'_>, &mut GradSink<'_>) -> Result<f32> + 'a;

/// The micro-batches of a step before its last.
#[derive(Debug)]
pub struct MicroBatches {
    /// Micro-batches per step (1: no accumulation).
    pub steps: usize,
    /// Their gradients' sum, in flat order (empty: no accumulation).
    pub sum: Vec<f32>,
    /// Their losses' sum.
    pub loss: f32,
    /// Whether every micro-batch is reduced on its own (`allreduce.reduce_each_micro_batch`)
    /// instead of summed here: then `sum` stays empty.
    pub reduce_each: bool,
    /// Micro-batches of the step already reduced into the averaged gradient (with
    /// `reduce_each`): [`MicroBatches::keep`] writes the first and adds the others.
    pub reduced: usize,
}

impl MicroBatches {
    /// `steps` micro-batches per step.
    pub fn new(steps: usize) -> Self {
        Self {
            steps: steps.max(1),
            sum: Vec::new(),
            loss: 0.0,
            reduce_each: false,
            reduced: 0,
        }
    }

    /// `self` reducing every micro-batch on its own when `on` (see the module docs).
    pub fn reducing_each(mut self, on: bool) -> Self {
        self.reduce_each = on;
        self
    }

    /// `batch` cut into the step's micro-batches, in order (`lps`: labels per sample).
    pub fn cut<'b>(&self, lps: usize, batch: BatchRef<'b>) -> Result<Vec<BatchRef<'b>>> {
        let k = self.steps;
        if k == 1 {
            return Ok(vec![batch]);
        }
        let n = batch.labels.len() / lps.max(1);
        if n == 0 || !n.is_multiple_of(k) {
            return Err(TrainError::config(
                "allreduce.accumulation_steps",
                format!("a batch of {n} samples does not cut into {k} equal micro-batches"),
            ));
        }
        let (inputs, labels) = (batch.images.len() / k, batch.labels.len() / k);
        Ok((0..k)
            .map(|j| BatchRef {
                images: &batch.images[j * inputs..(j + 1) * inputs],
                labels: &batch.labels[j * labels..(j + 1) * labels],
            })
            .collect())
    }

    /// Keeps a reduction's `summed` values scaled by `scale` in `dst`, the averaged
    /// gradient's place for them: written by the step's first reduction, added to by the
    /// later micro-batches' (with `reduce_each`), in micro-batch order.
    pub fn keep(&self, dst: &mut [f32], summed: &[f32], scale: f32) {
        if self.reduced == 0 {
            for (d, s) in dst.iter_mut().zip(summed) {
                *d = s * scale;
            }
        } else {
            for (d, s) in dst.iter_mut().zip(summed) {
                *d += s * scale;
            }
        }
    }

    /// Differentiates every micro-batch of `batch` but its last, in order, summing their
    /// gradients and losses; returns the last. Without accumulation, `batch` itself.
    pub fn run<'b>(
        &mut self,
        engine: &mut dyn Engine,
        layout: &ParamLayout,
        batch: BatchRef<'b>,
    ) -> Result<BatchRef<'b>> {
        let lps = engine.labels_per_sample();
        self.run_with(lps, layout, batch, &mut |micro, each| {
            let loss = engine.forward_backward(micro)?;
            engine.for_each_grad(each)?;
            Ok(loss)
        })
    }

    /// [`MicroBatches::run`] with each earlier micro-batch differentiated by
    /// `differentiate`, which hands every parameter's gradient to the callback it is given
    /// and returns the loss (ZeRO-3: a sharded pass whose gradients stay on this rank).
    /// `lps`: labels per sample.
    pub fn run_with<'b>(
        &mut self,
        lps: usize,
        layout: &ParamLayout,
        batch: BatchRef<'b>,
        differentiate: &mut Differentiate<'_>,
    ) -> Result<BatchRef<'b>> {
        self.loss = 0.0;
        self.sum.clear();
        self.reduced = 0;
        let mut micro = self.cut(lps, batch)?;
        let Some(last) = micro.pop() else {
            return Ok(batch);
        };
        if micro.is_empty() {
            return Ok(last);
        }
        self.sum.resize(layout.total, 0.0);
        for batch in micro {
            let sum = &mut self.sum;
            self.loss += differentiate(batch, &mut |i, g| {
                let p = &layout.params[i];
                for (a, x) in sum[p.offset..p.offset + p.len].iter_mut().zip(g) {
                    *a += x;
                }
                Ok(())
            })?;
        }
        Ok(last)
    }

    /// Writes into `dst` the last micro-batch's `grad` of the tensor at flat `offset`, plus
    /// the earlier micro-batches' sum of it.
    pub fn add_into(&self, dst: &mut [f32], grad: &[f32], offset: usize) {
        match self.sum.get(offset..offset + grad.len()) {
            Some(sum) => {
                for ((d, g), a) in dst.iter_mut().zip(grad).zip(sum) {
                    *d = g + a;
                }
            }
            None => dst.copy_from_slice(grad),
        }
    }

    /// The last micro-batch's `grad` of the tensor at flat `offset` plus the earlier
    /// micro-batches' sum of it, as a new buffer (a copy of `grad` when nothing accumulated).
    pub fn summed(&self, grad: &[f32], offset: usize) -> Vec<f32> {
        match self.sum.get(offset..offset + grad.len()) {
            Some(sum) => grad.iter().zip(sum).map(|(g, a)| g + a).collect(),
            None => grad.to_vec(),
        }
    }

    /// Makes `grad`, the last micro-batch's whole gradient, the mean over the step's
    /// micro-batches (what one batch of them all gives, to rounding).
    pub fn mean_into(&self, grad: &mut [f32]) {
        if self.sum.len() != grad.len() {
            return;
        }
        let scale = 1.0 / self.steps as f32;
        for (g, a) in grad.iter_mut().zip(&self.sum) {
            *g = (*g + a) * scale;
        }
    }

    /// The mean of the step's micro-batch losses, the last one being `last`.
    pub fn mean_loss(&self, last: f32) -> f32 {
        (self.loss + last) / self.steps as f32
    }
}
