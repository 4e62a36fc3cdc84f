//! A model written in plain burn, in the user's own loop, trained on MNIST across processes.
//!
//! ```text
//! cargo build --release -p flotilla -p flotilla-burn --example custom_model
//! target/release/flotilla launch -n 2 -- target/release/examples/custom_model
//! ```
//! Each rank trains on its shard; `DataParallel` makes the ranks start from rank 0's weights
//! and averages the gradients. Settings: `EPOCHS` (3), `STEPS` (instead of epochs), `BATCH`
//! (per rank, 64), `HIDDEN` (128), `OPTIMIZER` (`adam`, or `sgd` with momentum 0.9), `LR`
//! (the peak learning rate: 2e-3 for Adam, 0.05 for SGD),
//! `MNIST_DIR` (`data/mnist`), `OUT` (`custom_model.safetensors`).

use anyhow::{Context, Result, bail};
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::pool::{MaxPool2d, MaxPool2dConfig};
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, GradientsParams, ModuleOptimizer, SgdConfig};
use burn::prelude::*;
use burn::tensor::{Int, TensorData};
use std::f64::consts::PI;

use flotilla_burn::{DistError, ReduceOp, TrainState};
use flotilla_data::{Batcher, DistributedSampler, ImageDataset, Mnist};

/// The user's model: two convolutions and two linear layers.
#[derive(Module, Debug)]
struct Net {
    conv1: Conv2d,
    conv2: Conv2d,
    pool: MaxPool2d,
    fc1: Linear,
    fc2: Linear,
    relu: Relu,
}

impl Net {
    fn new(device: &Device, hidden: usize) -> Self {
        Net {
            conv1: Conv2dConfig::new([1, 16], [5, 5]).init(device),
            conv2: Conv2dConfig::new([16, 32], [5, 5]).init(device),
            pool: MaxPool2dConfig::new([2, 2]).with_strides([2, 2]).init(),
            fc1: LinearConfig::new(32 * 4 * 4, hidden).init(device),
            fc2: LinearConfig::new(hidden, 10).init(device),
            relu: Relu::new(),
        }
    }

    fn forward(&self, x: Tensor<4>) -> Tensor<2> {
        let x = self.pool.forward(self.relu.forward(self.conv1.forward(x)));
        let x = self.pool.forward(self.relu.forward(self.conv2.forward(x)));
        let x = self.relu.forward(self.fc1.forward(x.flatten(1, 3)));
        self.fc2.forward(x)
    }
}

/// A batch of `data` as tensors: images `[n, 1, 28, 28]` and labels.
fn tensors(
    data: &ImageDataset,
    idx: &[usize],
    b: &mut Batcher,
    dev: &Device,
) -> Result<(Tensor<4>, Tensor<1, Int>)> {
    let batch = b.fill(data, idx)?;
    let images = Tensor::from_data(TensorData::new(batch.images.to_vec(), batch.shape), dev);
    let labels = Tensor::from_data(TensorData::new(batch.labels.to_vec(), [batch.len()]), dev);
    Ok((images, labels))
}

/// A number from the environment, or `default`.
fn setting(name: &str, default: usize) -> Result<usize> {
    std::env::var(name).map_or(Ok(default), |v| {
        v.parse().with_context(|| format!("{name}={v}"))
    })
}

/// The optimizer `OPTIMIZER` names (`adam`, the default; `sgd`: with momentum 0.9) and its
/// peak learning rate.
fn optimizer() -> Result<(ModuleOptimizer, f64)> {
    Ok(match std::env::var("OPTIMIZER").as_deref() {
        Ok("adam") | Err(_) => (AdamConfig::new().init(), 2e-3),
        Ok("sgd") => {
            let momentum = MomentumConfig::new().with_momentum(0.9);
            (SgdConfig::new().with_momentum(Some(momentum)).init(), 0.05)
        }
        Ok(other) => bail!("OPTIMIZER={other}: adam or sgd"),
    })
}

fn main() -> Result<()> {
    let (batch, epochs) = (setting("BATCH", 64)?, setting("EPOCHS", 3)?);
    // The global batch: BATCH on each of the job's ranks (the most of an elastic job's).
    let global = batch * setting("WORLD_SIZE", 1)?;
    let dir = std::env::var("MNIST_DIR").unwrap_or_else(|_| "data/mnist".into());
    let mnist = Mnist::load(&dir).with_context(|| format!("loading MNIST from {dir}"))?;
    let device = Device::flex().autodiff();
    device.seed(42); // a joiner's draw does not matter: it takes the members' state
    let steps_per_epoch = mnist.train.len() / global;
    let total = setting("STEPS", epochs * steps_per_epoch)? as u64;
    let (optim, default_lr) = optimizer()?;
    let peak_lr = match std::env::var("LR") {
        Ok(v) => v.parse().with_context(|| format!("LR={v}"))?,
        Err(_) => default_lr,
    };
    let state = TrainState::new(Net::new(&device, setting("HIDDEN", 128)?), optim);
    let loss_fn = CrossEntropyLossConfig::new().init(&device);
    let mut batcher = Batcher::new(global, mnist.train.image_size());
    // Runs again after each change of an elastic job's members (`-n MIN:MAX`), from the
    // state they committed last: the data is cut among the members anew.
    let done = flotilla_burn::elastic::run(state, |r| {
        let (rank, size) = (r.dp.rank(), r.dp.size());
        let sampler = DistributedSampler::new(mnist.train.len(), size, rank, 42, true)?
            .with_global_batch(global);
        let share = sampler.rank_batch().unwrap_or(0);
        let mut epoch = (u64::MAX, Vec::new());
        while r.state.step < total {
            let step = r.state.step;
            let e = step / steps_per_epoch as u64;
            if epoch.0 != e {
                epoch = (e, sampler.indices(e));
            }
            let k = (step % steps_per_epoch as u64) as usize;
            let idx = &epoch.1[k * share..(k + 1) * share];
            // Cosine decay from the peak learning rate to 0 over the run.
            let lr = peak_lr / 2.0 * (1.0 + (PI * step as f64 / total as f64).cos());
            let batch = tensors(&mnist.train, idx, &mut batcher, &device);
            let (x, y) = batch.map_err(DistError::program)?;
            let loss = loss_fn.forward(r.state.model.forward(x), y);
            if rank == 0 && step % 50 == 0 {
                let l = loss.clone().into_scalar::<f32>();
                println!("step {step}/{total}: loss {l:.4}");
            }
            let grads = GradientsParams::from_grads(loss.backward(), &r.state.model);
            let grads =
                r.dp.average_over_samples(grads, &r.state.model, idx.len())?;
            r.state.model = r.state.optimizer.step(lr, r.state.model.clone(), grads);
            r.state.step += 1;
            r.commit()?;
        }
        Ok(())
    })?;
    let (net, dp) = (done.state.model, done.dp);
    let (rank, size) = (dp.rank(), dp.size());
    let out = std::env::var("OUT").unwrap_or_else(|_| "custom_model.safetensors".into());
    dp.save(&net, out.as_ref())?;

    // Each rank counts its share of the test set; the counts are summed across ranks.
    let valid = net.valid();
    let mine: Vec<usize> = (rank..mnist.test.len()).step_by(size).collect();
    let mut counts = [0i64, mine.len() as i64];
    for idx in mine.chunks(1000) {
        let (x, y) = tensors(&mnist.test, idx, &mut batcher, &device.clone().inner())?;
        let predicted = valid.forward(x).argmax(1).flatten::<1>(0, 1);
        counts[0] += predicted.equal(y).int().sum().into_scalar::<i64>();
    }
    dp.group().all_reduce_i64(&mut counts, ReduceOp::Sum)?;
    if rank == 0 {
        println!(
            "test accuracy {:.4} on {size} ranks",
            counts[0] as f64 / counts[1] as f64
        );
    }
    Ok(())
}
