//! Every way of training together from a user's own loop: a model written in plain burn (an
//! MLP; `custom_model.rs` is the short sync example with a CNN), trained on MNIST across
//! processes.
//!
//! ```text
//! cargo build --release -p flotilla -p flotilla-burn --example custom_model_modes
//! MODE=async target/release/flotilla launch -n 2 -- target/release/examples/custom_model_modes
//! MODE=ps target/release/flotilla launch -n 3 -- target/release/examples/custom_model_modes
//! ```
//! `MODE` picks how the ranks train together: `sync` (`DataParallel`: rank 0's weights, then
//! gradients averaged every step), `async` (`AsyncAllReduce`: averaged in the background,
//! applied one step stale), `averaging` (`ModelAveraging`: each rank steps alone, weights
//! averaged every `AVERAGE_EVERY` (8) steps), `ps` (rank 0 serves the model with `ps::serve`,
//! the other ranks are `ps::Worker`s; `PS_ASYNC=1` for an async server). Settings: `EPOCHS`
//! (3), `STEPS` (instead of epochs), `BATCH` (per rank, 64), `HIDDEN` (256), `OPTIMIZER`
//! (`adam`, or `sgd` with momentum 0.9), `MNIST_DIR` (`data/mnist`), `OUT`
//! (`custom_model_modes.safetensors`).

use std::sync::Arc;

use anyhow::{Context, Result};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, GradientsParams, ModuleOptimizer, SgdConfig};
use burn::prelude::*;
use burn::tensor::{Int, TensorData};
use flotilla_burn::ps::{self, Aggregation, PsConfig};
use flotilla_burn::{
    AsyncAllReduce, AsyncConfig, Correction, DataParallel, ModelAveraging, ProcessGroup, ReduceOp,
};
use flotilla_data::{Batcher, DistributedSampler, ImageDataset, Mnist, MnistSplits};

/// The user's model: a multi-layer perceptron.
#[derive(Module, Debug)]
struct Net {
    fc1: Linear,
    fc2: Linear,
    fc3: Linear,
    relu: Relu,
}

impl Net {
    fn new(device: &Device, hidden: usize) -> Self {
        Net {
            fc1: LinearConfig::new(28 * 28, hidden).init(device),
            fc2: LinearConfig::new(hidden, hidden).init(device),
            fc3: LinearConfig::new(hidden, 10).init(device),
            relu: Relu::new(),
        }
    }

    fn forward(&self, x: Tensor<4>) -> Tensor<2> {
        let x = self.relu.forward(self.fc1.forward(x.flatten(1, 3)));
        let x = self.relu.forward(self.fc2.forward(x));
        self.fc3.forward(x)
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

/// How this rank trains with the others (`MODE`).
enum Mode {
    Sync(DataParallel),
    Async(AsyncAllReduce),
    Averaging(ModelAveraging),
    Worker(ps::Worker),
}

impl Mode {
    /// The model to compute this step's gradient with (`None`: the server said stop).
    fn model(&mut self, net: &Net) -> Result<Option<Net>> {
        Ok(match self {
            Mode::Async(ar) => Some(ar.gradient_point(net)?),
            Mode::Worker(w) => w.pull(net)?,
            _ => Some(net.clone()),
        })
    }

    /// Takes this rank's gradients (over `n` samples, mean loss `loss`) into `net`.
    fn update(
        &mut self,
        net: Net,
        g: GradientsParams,
        o: &mut ModuleOptimizer,
        lr: f64,
        n: u32,
        loss: f32,
    ) -> Result<Net> {
        Ok(match self {
            Mode::Sync(dp) => {
                let g = dp.average(g, &net)?;
                o.step(lr, net, g)
            }
            Mode::Async(ar) => ar.step(net, g, o, lr)?,
            Mode::Averaging(avg) => avg.step(o.step(lr, net, g))?,
            Mode::Worker(w) => {
                w.push(&net, g, n, loss)?;
                net
            }
        })
    }

    /// The ranks' final model (in flight gradients applied, weights averaged) and the wrapper
    /// to save it with; `None` on a worker (the server has the model).
    fn finish(
        self,
        net: Net,
        o: &mut ModuleOptimizer,
        lr: f64,
    ) -> Result<Option<(Net, DataParallel)>> {
        Ok(match self {
            Mode::Worker(_) => None,
            Mode::Sync(dp) => Some((net, dp)),
            Mode::Async(ar) => ar.finish(net, o, lr).map(|(net, dp, _)| Some((net, dp)))?,
            Mode::Averaging(mut avg) => Some((avg.average(net)?, avg.into_data_parallel())),
        })
    }
}

/// What every rank of the run shares.
struct Run {
    mode: String,
    mnist: MnistSplits,
    batcher: Batcher,
    batch: usize,
    device: Device,
    out: String,
    ps: PsConfig,
    /// The ranks that train on data (all, or the workers under the server) and this one's place.
    trainers: usize,
    me: usize,
    sampler: DistributedSampler,
    total: usize,
    /// The learning rate the cosine decay starts from (the optimizer's).
    peak_lr: f64,
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
        Ok(other) => anyhow::bail!("OPTIMIZER={other}: adam or sgd"),
    })
}

fn main() -> Result<()> {
    let group = flotilla_burn::init().context("joining the job (start me with flotilla launch)")?;
    let dir = std::env::var("MNIST_DIR").unwrap_or_else(|_| "data/mnist".into());
    let mnist = Mnist::load(&dir).with_context(|| format!("loading MNIST from {dir}"))?;
    let (mode, batch) = (
        std::env::var("MODE").unwrap_or_else(|_| "sync".into()),
        setting("BATCH", 64)?,
    );
    let aggregation = match std::env::var("PS_ASYNC").as_deref() {
        Ok("1") => Aggregation::Async {
            max_staleness: None,
            staleness_lr: true,
        },
        _ => Aggregation::Sync,
    };
    let ps = PsConfig {
        aggregation,
        batch_size: u32::try_from(batch).context("BATCH")?,
        ..PsConfig::default()
    };
    let servers = if mode == "ps" { ps.servers } else { 0 };
    let (trainers, me) = (group.size() - servers, group.rank().saturating_sub(servers));
    let sampler = DistributedSampler::new(mnist.train.len(), trainers, me, 42, true)?;
    let total = setting(
        "STEPS",
        setting("EPOCHS", 3)? * (sampler.num_samples() / batch),
    )?;
    let (optim, peak_lr) = optimizer()?;
    let mut run = Run {
        mode,
        batcher: Batcher::new(batch, mnist.train.image_size()),
        mnist,
        batch,
        device: Device::flex().autodiff(),
        out: std::env::var("OUT").unwrap_or_else(|_| "custom_model_modes.safetensors".into()),
        ps,
        trainers,
        me,
        sampler,
        total,
        peak_lr,
    };
    run.device.seed(group.rank() as u64); // different on every rank: the broadcast makes them agree
    let net = Net::new(&run.device, setting("HIDDEN", 256)?);
    if group.rank() < servers {
        run.serve(group, net, optim)
    } else {
        run.train(group, net, optim)
    }
}

impl Run {
    /// The learning rate: cosine decay from the peak to 0 over the run.
    fn lr(&self, step: usize) -> f64 {
        self.peak_lr / 2.0 * (1.0 + (std::f64::consts::PI * step as f64 / self.total as f64).cos())
    }

    /// A parameter server's rank: serves the model, then saves and tests it.
    fn serve(
        &mut self,
        group: Arc<dyn ProcessGroup>,
        net: Net,
        mut optim: ModuleOptimizer,
    ) -> Result<()> {
        let rate = |version: u64| self.lr(version as usize);
        let (net, stats) = ps::serve(group, net, &mut optim, rate, self.total as u64, self.ps)?;
        println!(
            "server: {} updates, {} refused, staleness up to {}",
            stats.version, stats.rejected, stats.max_staleness
        );
        flotilla_burn::save(&net, self.out.as_ref())?;
        let counts = self.correct(&net, (0..self.mnist.test.len()).collect())?;
        let accuracy = counts[0] as f64 / counts[1] as f64;
        println!(
            "test accuracy {accuracy:.4} ({}, {} workers)",
            self.mode, self.trainers
        );
        Ok(())
    }

    /// This rank's way of training, from rank 0's model and optimizer (a worker pulls them).
    fn start(
        &self,
        group: Arc<dyn ProcessGroup>,
        net: Net,
        optim: &mut ModuleOptimizer,
    ) -> Result<(Net, Mode)> {
        if self.mode == "ps" {
            return Ok((
                net.clone(),
                Mode::Worker(ps::Worker::new(group, &net, self.ps)?),
            ));
        }
        let dp = DataParallel::new(group, &net)?;
        let net = dp.broadcast_model(net)?;
        *optim = dp.broadcast_optimizer(optim.clone())?;
        let mode = match self.mode.as_str() {
            "sync" => Mode::Sync(dp),
            "async" => {
                // One step stale, each gradient taken where the optimizer's momentum (Adam's
                // `beta1`, SGD's momentum: 0.9 both) will apply it.
                let correction = Correction::Predict { momentum: 0.9 };
                let config = AsyncConfig {
                    correction,
                    ..AsyncConfig::default()
                };
                Mode::Async(AsyncAllReduce::start(dp, &net, config)?)
            }
            "averaging" => Mode::Averaging(ModelAveraging::new(
                dp,
                setting("AVERAGE_EVERY", 8)? as u64,
            )?),
            other => anyhow::bail!("MODE={other}: sync, async, averaging or ps"),
        };
        Ok((net, mode))
    }

    /// Trains on this rank's shard, then saves and tests the model (collectively).
    fn train(
        &mut self,
        group: Arc<dyn ProcessGroup>,
        net: Net,
        mut optim: ModuleOptimizer,
    ) -> Result<()> {
        let (rank, size) = (group.rank(), group.size());
        let (mut net, mut mode) = self.start(group, net, &mut optim)?;
        let loss_fn = CrossEntropyLossConfig::new().init(&self.device);
        let (batch, total) = (self.batch, self.total);
        let shards: Vec<Vec<usize>> = (0..)
            .flat_map(|e| {
                self.sampler
                    .indices(e)
                    .chunks_exact(batch)
                    .map(<[_]>::to_vec)
                    .collect::<Vec<_>>()
            })
            // A worker trains until its server says stop.
            .take(if self.mode == "ps" {
                total * self.trainers + 1
            } else {
                total
            })
            .collect();
        for (step, idx) in shards.iter().enumerate() {
            let Some(at) = mode.model(&net)? else { break };
            let (x, y) = tensors(&self.mnist.train, idx, &mut self.batcher, &self.device)?;
            let loss = loss_fn.forward(at.forward(x), y);
            let l = loss.clone().into_scalar::<f32>();
            if self.me == 0 && step % 200 == 0 {
                println!("step {step}/{total}: loss {l:.4}");
            }
            // `at` shares `net`'s parameter ids: its gradients update `net` itself.
            let grads = GradientsParams::from_grads(loss.backward(), &at);
            net = mode.update(net, grads, &mut optim, self.lr(step), batch as u32, l)?;
        }
        let Some((net, dp)) = mode.finish(net, &mut optim, self.lr(total))? else {
            return Ok(()); // a worker: the server tests and saves
        };
        dp.save(&net, self.out.as_ref())?;
        // Each rank counts its share of the test set; the counts are summed across ranks.
        let mut counts =
            self.correct(&net, (rank..self.mnist.test.len()).step_by(size).collect())?;
        dp.group().all_reduce_i64(&mut counts, ReduceOp::Sum)?;
        if rank == 0 {
            println!(
                "test accuracy {:.4} on {size} ranks ({})",
                counts[0] as f64 / counts[1] as f64,
                self.mode
            );
        }
        Ok(())
    }

    /// `[correct, total]` of `net` on the test samples `idx`.
    fn correct(&mut self, net: &Net, idx: Vec<usize>) -> Result<[i64; 2]> {
        let valid = net.valid();
        let mut counts = [0i64, idx.len() as i64];
        for chunk in idx.chunks(1000) {
            let device = self.device.clone().inner();
            let (x, y) = tensors(&self.mnist.test, chunk, &mut self.batcher, &device)?;
            let predicted = valid.forward(x).argmax(1).flatten::<1>(0, 1);
            counts[0] += predicted.equal(y).int().sum().into_scalar::<i64>();
        }
        Ok(counts)
    }
}
