//! Synchronized batch norm: a [`BatchNorm`]'s training pass with the batch statistics of every
//! rank's batch together, as PyTorch's `SyncBatchNorm` computes them.
//!
//! With small per-rank batches a batch norm's statistics are noisy; synchronizing them makes
//! N ranks of B samples normalize as one rank of N·B would, and train the same. Per channel:
//! the count and the sum over every rank give the mean; the sum of squared deviations from it
//! over every rank gives the (biased) variance; each rank normalizes its own samples with them.
//! Both sums go through [`all_reduce_sum`], whose backward sums the gradient over the ranks, so
//! the gradient of every input is the one-rank gradient of the whole batch. The running
//! statistics are updated with the global mean and variance exactly as burn's [`BatchNorm`]
//! updates them (momentum, biased variance), so they stay equal on every rank. Evaluation uses
//! them as an ordinary batch norm does.

use burn::nn::BatchNorm;
use burn::prelude::*;

use crate::collective::{ReducerHandle, all_reduce_sum};

/// `bn`'s forward in training mode with statistics over every rank of `reducer`; in inference
/// mode (no autodiff, or the layer frozen), burn's own forward.
pub fn forward<const D: usize>(bn: &BatchNorm, x: Tensor<D>, reducer: &ReducerHandle) -> Tensor<D> {
    if !(x.device().is_autodiff() && bn.training.is_enabled()) {
        return bn.forward(x);
    }
    let dims = x.dims();
    let channels = dims[1];
    let local = dims.iter().product::<usize>() / channels.max(1);
    let mut count = [local as f32];
    reducer.sum_in_place(&mut count);
    let total = f64::from(count[0]).max(1.0);

    let mut per_channel = [1usize; D];
    per_channel[1] = channels;
    let channel_sums = |t: Tensor<D>| -> Tensor<1> {
        t.swap_dims(0, 1)
            .reshape([channels as i64, -1])
            .sum_dim(1)
            .reshape([channels])
    };
    let mean = all_reduce_sum(channel_sums(x.clone()), reducer).div_scalar(total);
    let centered = x - mean.clone().reshape(per_channel);
    let squares = channel_sums(centered.clone().powi_scalar(2));
    let variance = all_reduce_sum(squares, reducer).div_scalar(total);

    let inv_std = variance.clone().add_scalar(bn.epsilon).sqrt().recip();
    let output = centered * inv_std.reshape(per_channel) * bn.gamma.val().reshape(per_channel)
        + bn.beta.val().reshape(per_channel);

    let device = output.device();
    let m = bn.momentum;
    let running_mean = bn.running_mean.value_sync().to_device(&device);
    let running_var = bn.running_var.value_sync().to_device(&device);
    bn.running_mean
        .update((running_mean.mul_scalar(1.0 - m) + mean.detach().mul_scalar(m)).detach());
    bn.running_var
        .update((running_var.mul_scalar(1.0 - m) + variance.detach().mul_scalar(m)).detach());
    output
}
