//! [`DataParallel`]: Horovod's and PyTorch DDP's contract for a burn user's own model and loop.

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use burn::module::Module;
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::Bytes;
use flotilla_engine::ParamLayout;
use flotilla_engine::{any_module, layer_groups};
use flotilla_group::{PendingAllReduce, ProcessGroup};

use crate::agree::check_same_params;
use crate::error::{DistError, Result};

/// Data-parallel training of one burn module across the ranks of a process group.
///
/// Built from one rank's model, it checks that every rank has the same parameter list. Then:
/// [`DataParallel::broadcast_model`] and [`DataParallel::broadcast_optimizer`] give every rank
/// rank 0's parameters and optimizer state; after each backward pass,
/// [`DataParallel::average`] turns this rank's gradients into the average over all ranks
/// (fused into buckets, each bucket's reduction running while the next is gathered), so that
/// every rank takes the same optimizer step and the replicas stay identical.
#[derive(Debug)]
pub struct DataParallel {
    group: Arc<dyn ProcessGroup>,
    layout: ParamLayout,
    buckets: Vec<Range<usize>>,
    /// Each bucket's buffer, kept between steps.
    spare: Vec<Vec<f32>>,
}

impl DataParallel {
    /// Data parallelism for `model` over `group` with the run's default bucket size
    /// (`comm.bucket_mb`, PyTorch DDP's 25 MiB). Collective: every rank calls it; it fails on
    /// every rank, naming the ranks whose parameter list differs from rank 0's, if the models
    /// do not match.
    pub fn new<M: Module>(group: Arc<dyn ProcessGroup>, model: &M) -> Result<Self> {
        let bytes = flotilla_train::TrainConfig::default().bucket_bytes();
        Self::with_bucket_bytes(group, model, bytes)
    }

    /// As [`DataParallel::new`], with gradient buckets of about `bucket_bytes`: the run's
    /// buckets of a user module ([`layer_groups`]: a layer's tensors together, last layers
    /// first).
    pub fn with_bucket_bytes<M: Module>(
        group: Arc<dyn ProcessGroup>,
        model: &M,
        bucket_bytes: usize,
    ) -> Result<Self> {
        let layout = ParamLayout::of(model);
        check_same_params(group.as_ref(), &layout)?;
        let buckets = layer_groups(&layout, bucket_bytes);
        let spare = vec![Vec::new(); buckets.len()];
        Ok(Self {
            group,
            layout,
            buckets,
            spare,
        })
    }

    /// This process's rank in the group.
    pub fn rank(&self) -> usize {
        self.group.rank()
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.group.size()
    }

    /// The process group, for the user's own collectives (e.g. summing evaluation counts).
    pub fn group(&self) -> &Arc<dyn ProcessGroup> {
        &self.group
    }

    /// The parameter tensors in flat order: names, shapes, offsets.
    pub fn layout(&self) -> &ParamLayout {
        &self.layout
    }

    /// `model` with rank 0's parameter values and buffers (bitwise) and parameter ids numbered
    /// by position, so that optimizer state keyed by id means the same tensor on every rank.
    /// Collective.
    pub fn broadcast_model<M: Module>(&self, model: M) -> Result<M> {
        let model = any_module::renumber(model);
        let mut flat = vec![0.0f32; self.layout.total];
        any_module::read_params(&model, &self.layout, &mut flat)?;
        self.group.broadcast_f32(&mut flat, 0)?;
        let model = any_module::write_params(model, &self.layout, &flat)?;
        self.sync_buffers(model, BufferSync::FromRank0)
    }

    /// `model` with its buffers (batch norm's running statistics, which each rank's forward
    /// passes update from its own batches) made the same on every rank: rank 0's
    /// ([`BufferSync::FromRank0`], PyTorch DDP's `broadcast_buffers`) or the mean over the
    /// ranks ([`BufferSync::Average`]). Call it before evaluating or saving. Collective; a
    /// model without buffers costs nothing.
    pub fn sync_buffers<M: Module>(&self, model: M, how: BufferSync) -> Result<M> {
        let layout = any_module::buffer_layout(&model);
        if layout.total == 0 {
            return Ok(model);
        }
        let mut flat = vec![0.0f32; layout.total];
        any_module::read_buffers(&model, &layout, &mut flat)?;
        match how {
            BufferSync::FromRank0 => self.group.broadcast_f32(&mut flat, 0)?,
            BufferSync::Average => {
                self.group.all_reduce_sum(&mut flat)?;
                let scale = 1.0 / self.size() as f32;
                flat.iter_mut().for_each(|v| *v *= scale);
            }
        }
        Ok(any_module::write_buffers(model, &layout, &flat)?)
    }

    /// `model` with every parameter the mean of its values over the ranks: model averaging
    /// (local SGD, PyTorch's `PostLocalSGDOptimizer`), where each rank takes its own
    /// optimizer steps on its own batches and the replicas are averaged every few steps.
    /// Buffers are left alone ([`DataParallel::sync_buffers`] averages them). Collective.
    pub fn average_model<M: Module>(&self, model: M) -> Result<M> {
        let mut flat = vec![0.0f32; self.layout.total];
        any_module::read_params(&model, &self.layout, &mut flat)?;
        self.group.all_reduce_sum(&mut flat)?;
        let scale = 1.0 / self.size() as f32;
        flat.iter_mut().for_each(|v| *v *= scale);
        Ok(any_module::write_params(model, &self.layout, &flat)?)
    }

    /// `optimizer` with rank 0's state (moments, step counts; empty before the first step).
    /// Collective. Call it after [`DataParallel::broadcast_model`], whose ids the state uses.
    pub fn broadcast_optimizer(&self, optimizer: ModuleOptimizer) -> Result<ModuleOptimizer> {
        let mut bytes = if self.rank() == 0 {
            optimizer
                .into_bytes()
                .map_err(|e| DistError::Optimizer(format!("saving: {e:?}")))?
                .to_vec()
        } else {
            Vec::new()
        };
        let bound = flotilla_engine::optimizer_state_bound(&self.layout);
        self.group.broadcast_bytes(&mut bytes, 0, bound)?;
        optimizer
            .from_bytes(Bytes::from_bytes_vec(bytes))
            .map_err(|e| DistError::Optimizer(format!("loading rank 0's: {e:?}")))
    }

    /// The average over all ranks of each parameter's gradient, from this rank's `grads` of
    /// `model`. A parameter without a gradient on a rank counts as zero there. Collective:
    /// every rank calls it once per step.
    pub fn average<M: Module>(
        &mut self,
        grads: GradientsParams,
        model: &M,
    ) -> Result<GradientsParams> {
        self.reduce(grads, model, None)
    }

    /// The mean gradient over every sample of the ranks' batches, from this rank's `grads`
    /// (the mean over its own `samples`): each rank's gradient weighted by its samples, for
    /// ranks whose batches differ in size (a global batch cut among members that do not
    /// divide it, [`flotilla_data::DistributedSampler::with_global_batch`]). Equal batches
    /// give [`DataParallel::average`]'s result. Collective.
    pub fn average_over_samples<M: Module>(
        &mut self,
        grads: GradientsParams,
        model: &M,
        samples: usize,
    ) -> Result<GradientsParams> {
        self.reduce(grads, model, Some(samples))
    }

    /// The sum over the ranks of `grads`, each weighted by its `samples` (or 1), divided by
    /// the sum of the weights.
    fn reduce<M: Module>(
        &mut self,
        mut grads: GradientsParams,
        model: &M,
        samples: Option<usize>,
    ) -> Result<GradientsParams> {
        let _span = tracing::info_span!(target: "flotilla::burn", "all_reduce").entered();
        let (weight, scale) = match samples {
            None => (None, 1.0 / self.size() as f32),
            Some(n) => {
                let mut total = [n as f32];
                self.group.all_reduce_sum(&mut total)?;
                (Some(n as f32), 1.0 / total[0].max(1.0))
            }
        };
        let mut pending: Vec<PendingAllReduce> = Vec::with_capacity(self.buckets.len());
        for (k, params) in self.buckets.iter().enumerate() {
            let mut buf = std::mem::take(&mut self.spare[k]);
            buf.resize(bucket_len(&self.layout, params), 0.0);
            any_module::take_grads(model, &mut grads, &self.layout, params.clone(), &mut buf)?;
            if let Some(w) = weight {
                buf.iter_mut().for_each(|v| *v *= w);
            }
            pending.push(self.group.all_reduce_bucket(buf, k));
        }
        let mut averaged = GradientsParams::new();
        for (k, p) in pending.into_iter().enumerate() {
            let mut buf = p.wait()?;
            buf.iter_mut().for_each(|v| *v *= scale);
            let params = self.buckets[k].clone();
            any_module::put_grads(model, &mut averaged, &self.layout, params, &buf)?;
            self.spare[k] = buf;
        }
        Ok(averaged)
    }

    /// Writes `model`'s parameters as safetensors under the module's own names (PyTorch's
    /// layout), from rank 0 only, atomically (a temporary file renamed into place). Every rank
    /// may call it; the others do nothing.
    pub fn save<M: Module>(&self, model: &M, path: &Path) -> Result<()> {
        if self.rank() != 0 {
            return Ok(());
        }
        crate::save(model, path)
    }

    /// `model` with its parameters read from `path` (written by [`DataParallel::save`]).
    pub fn load<M: Module>(&self, model: &M, path: &Path) -> Result<M> {
        Ok(any_module::load_module(model, path)?)
    }
}

/// How [`DataParallel::sync_buffers`] makes the ranks' buffers agree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BufferSync {
    /// Every rank takes rank 0's.
    FromRank0,
    /// Every rank takes the mean over the ranks.
    Average,
}

fn bucket_len(layout: &ParamLayout, params: &Range<usize>) -> usize {
    layout.params[params.clone()].iter().map(|p| p.len).sum()
}
