//! Synchronized batch norm for a user's own model: PyTorch's `SyncBatchNorm`, for burn.
//!
//! A [`SyncBatchNorm`] is burn's [`BatchNorm`] (its parameters and running statistics, under
//! `<field>.norm.*`) whose training pass takes the mean and variance of every rank's batch
//! together, through the engine's differentiable all-reduce
//! ([`flotilla_engine::sync_batch_norm`]): N ranks of B samples normalize, and get gradients,
//! as one rank of N·B would. Build the model's layers with a [`BatchNormSync`] from
//! [`batch_norm_sync`], which every rank calls once, in the same order relative to its other
//! collectives (it splits a group of its own off the job's, so that the statistics never wait
//! behind a gradient bucket). Every rank must then run the same layers in the same order.

use std::sync::Arc;

use burn::module::Module;
use burn::nn::{BatchNorm, BatchNormConfig};
use burn::prelude::*;
use flotilla_engine::collective::{Reducer, ReducerHandle};
use flotilla_group::ProcessGroup;

use crate::error::{DistError, Result};

/// The sums a [`SyncBatchNorm`] takes its statistics from: a group of the job's ranks of its
/// own. Cloning it shares the group.
#[derive(Clone, Debug)]
pub struct BatchNormSync {
    handle: ReducerHandle,
}

/// A group's sum, as the engine's differentiable all-reduce takes it.
struct GroupSum(Arc<dyn ProcessGroup>);

impl Reducer for GroupSum {
    fn all_reduce_sum(&self, values: &mut [f32]) -> std::result::Result<(), String> {
        self.0.all_reduce_sum(values).map_err(|e| e.to_string())
    }

    fn world(&self) -> usize {
        self.0.size()
    }
}

/// Statistics shared by every rank of `group`. Collective: every member calls it, in the same
/// order relative to its other collectives on `group`.
pub fn batch_norm_sync(group: &Arc<dyn ProcessGroup>) -> Result<BatchNormSync> {
    let own = group.split(Some(0), 0)?.ok_or_else(|| {
        DistError::BatchNormSync("the split for batch norm statistics gave no group".into())
    })?;
    Ok(BatchNormSync {
        handle: ReducerHandle::new(Arc::new(GroupSum(own))),
    })
}

impl BatchNormSync {
    /// How many ranks share the statistics.
    pub fn world(&self) -> usize {
        self.handle.world()
    }

    /// The error a sum met since the last check, if any (the passes after it normalized with
    /// each rank's own statistics and must be discarded). A failed sum means a broken group,
    /// so the next gradient average fails too; call this to name the cause first.
    pub fn check(&self) -> Result<()> {
        self.handle
            .take_error()
            .map_or(Ok(()), |e| Err(DistError::BatchNormSync(e)))
    }
}

/// burn's [`BatchNorm`] whose training statistics are those of every rank's batch.
#[derive(Module, Debug)]
pub struct SyncBatchNorm {
    /// The batch norm: weight (`gamma`), bias (`beta`) and running statistics.
    pub norm: BatchNorm,
    /// Where the statistics are summed (never saved).
    #[module(skip)]
    sync: BatchNormSync,
}

impl SyncBatchNorm {
    /// A synchronized batch norm of `config` on `device`, summing over `sync`'s ranks.
    pub fn new(config: &BatchNormConfig, device: &Device, sync: &BatchNormSync) -> Self {
        Self {
            norm: config.init(device),
            sync: sync.clone(),
        }
    }

    /// Normalizes `input` (`[batch, channels, ...]`): in training, with the statistics of
    /// every rank's batch (updating the running ones with them); in inference, with the
    /// running statistics, as burn's [`BatchNorm`] does.
    pub fn forward<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        flotilla_engine::sync_batch_norm::forward(&self.norm, input, &self.sync.handle)
    }
}
