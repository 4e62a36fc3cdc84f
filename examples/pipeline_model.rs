//! A model written in plain burn, cut into two pipeline stages (one burn module each),
//! trained on MNIST across processes.
//!
//! ```text
//! cargo build --release -p flotilla -p flotilla-burn --example pipeline_model
//! target/release/flotilla launch -n 2 -- target/release/examples/pipeline_model
//! REPLICAS=2 target/release/flotilla launch -n 4 -- target/release/examples/pipeline_model
//! ```
//! Stage 0 (the convolutions) sends its features and a skip tensor (a linear view of the
//! pixels) to stage 1 (the classifier), which adds them and computes the loss; gradients
//! come back. Settings: `REPLICAS` (1; the ranks are `2 × REPLICAS`), `MICRO` (micro-batches,
//! 4), `SCHEDULE` (`1f1b` or `gpipe`), `EPOCHS` (2), `STEPS` (instead of epochs), `BATCH` (per
//! replica, 64), `OPTIMIZER` (`adam`, or `sgd` with momentum 0.9), `MNIST_DIR` (`data/mnist`),
//! `OUT` (unset: nothing is saved; else replica 0's stage `s` saves its module to
//! `OUT.stage<s>.safetensors`).

use anyhow::{Context, Result, bail};
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::pool::{MaxPool2d, MaxPool2dConfig};
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, ModuleOptimizer, SgdConfig};
use burn::prelude::*;
use burn::tensor::{Int, TensorData};
use flotilla_burn::{LOSS, Pipeline, PipelineOptions, PipelineStage, Schedule, Tensors};
use flotilla_data::{Batcher, DistributedSampler, ImageDataset, Mnist, MnistSplits};

/// Stage 0: two convolutions; also a linear view of the pixels that skips to stage 1.
#[derive(Module, Debug)]
struct Features {
    conv1: Conv2d,
    conv2: Conv2d,
    pool: MaxPool2d,
    skip: Linear,
    relu: Relu,
}

/// Stage 1: the classifier, and the loss (with the number of correct predictions).
#[derive(Module, Debug)]
struct Classifier {
    fc1: Linear,
    fc2: Linear,
    relu: Relu,
}

impl PipelineStage for Features {
    fn inputs(&self) -> Vec<String> {
        vec!["image".into()]
    }
    fn outputs(&self) -> Vec<String> {
        vec!["features".into(), "skip".into()]
    }
    fn forward(&self, mut t: Tensors) -> flotilla_burn::Result<Tensors> {
        let x = t.take::<4>("image")?;
        let skip = self.skip.forward(x.clone().flatten::<2>(1, 3));
        let x = self.pool.forward(self.relu.forward(self.conv1.forward(x)));
        let x = self.pool.forward(self.relu.forward(self.conv2.forward(x)));
        Ok(Tensors::new()
            .with("features", x.flatten::<2>(1, 3))
            .with("skip", skip))
    }
}

impl PipelineStage for Classifier {
    fn inputs(&self) -> Vec<String> {
        vec!["features".into(), "skip".into()]
    }
    fn outputs(&self) -> Vec<String> {
        vec![LOSS.into(), "correct".into()]
    }
    fn forward(&self, mut t: Tensors) -> flotilla_burn::Result<Tensors> {
        let x = self
            .relu
            .forward(self.fc1.forward(t.take::<2>("features")?));
        let logits = self.fc2.forward(x) + t.take::<2>("skip")?;
        let labels = t.take_int::<1>("label")?;
        let correct = logits
            .clone()
            .argmax(1)
            .flatten::<1>(0, 1)
            .equal(labels.clone());
        let loss = CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits, labels);
        Ok(Tensors::new()
            .with(LOSS, loss)
            .with("correct", correct.float().sum()))
    }
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

/// Samples `idx` of `data`: images `[n, 1, 28, 28]` as the batch, labels as the targets.
fn tensors(
    data: &ImageDataset,
    idx: &[usize],
    b: &mut Batcher,
    dev: &Device,
) -> Result<(Tensors, Tensors)> {
    let batch = b.fill(data, idx)?;
    let images = Tensor::<4>::from_data(TensorData::new(batch.images.to_vec(), batch.shape), dev);
    let labels =
        Tensor::<1, Int>::from_data(TensorData::new(batch.labels.to_vec(), [batch.len()]), dev);
    Ok((
        Tensors::new().with("image", images),
        Tensors::new().with_int("label", labels),
    ))
}

/// Trains this rank's stage, then evaluates on the test set; rank of the last stage of
/// replica 0 prints the accuracy.
fn run<M: PipelineStage>(
    mut pipe: Pipeline,
    stage: M,
    mnist: &MnistSplits,
    dev: &Device,
) -> Result<()> {
    let (batch, replicas) = (setting("BATCH", 64)?, pipe.replicas());
    let mut stage = pipe.broadcast_model(stage)?;
    let (optim, peak_lr) = optimizer()?;
    let mut optim = pipe.broadcast_optimizer(optim)?;
    let sampler = DistributedSampler::new(mnist.train.len(), replicas, pipe.replica(), 42, true)?;
    let mut batcher = Batcher::new(batch, mnist.train.image_size());
    let total = setting(
        "STEPS",
        setting("EPOCHS", 2)? * (sampler.num_samples() / batch),
    )?;
    let shards = (0..).flat_map(|e| {
        sampler
            .indices(e)
            .chunks_exact(batch)
            .map(<[_]>::to_vec)
            .collect::<Vec<_>>()
    });
    for (step, idx) in shards.take(total).enumerate() {
        let lr = peak_lr / 2.0 * (1.0 + (std::f64::consts::PI * step as f64 / total as f64).cos());
        let (x, y) = tensors(&mnist.train, &idx, &mut batcher, dev)?;
        let out = pipe.step(&stage, x, y)?;
        if let Some(loss) = out.loss.filter(|_| step % 200 == 0 && pipe.replica() == 0) {
            println!("step {step}/{total}: loss {loss:.4}");
        }
        stage = optim.step(lr, stage, out.grads);
    }
    if let Ok(out) = std::env::var("OUT").as_deref()
        && pipe.replica() == 0
    {
        let path = format!("{out}.stage{}.safetensors", pipe.stage());
        flotilla_burn::save(&stage, path.as_ref())?;
    }
    let (mut correct, mut count) = (0.0, 0);
    let all: Vec<usize> = (0..mnist.test.len()).collect();
    let evaluates = pipe.replica() == 0; // replica 0's stages evaluate the test set
    for idx in all.chunks(1000).filter(|_| evaluates) {
        let (x, y) = tensors(&mnist.test, idx, &mut batcher, dev)?;
        if let Some(mut out) = pipe.evaluate(&stage, x, y)? {
            correct += out.take::<1>("correct")?.into_scalar::<f32>();
            count += idx.len();
        }
    }
    if count > 0 {
        println!(
            "test accuracy {:.4} ({} stages × {replicas} replicas)",
            correct / count as f32,
            2
        );
    }
    Ok(())
}

fn main() -> Result<()> {
    let group = flotilla_burn::init().context("joining the job (start me with flotilla launch)")?;
    let replicas = setting("REPLICAS", 1)?;
    if group.size() != 2 * replicas {
        bail!(
            "2 stages × REPLICAS={replicas} need {} ranks, launched with {}",
            2 * replicas,
            group.size()
        );
    }
    let schedule = match std::env::var("SCHEDULE").as_deref() {
        Ok("gpipe") => Schedule::GPipe,
        Ok("1f1b") | Err(_) => Schedule::OneFOneB,
        Ok(other) => bail!("SCHEDULE={other}: gpipe or 1f1b"),
    };
    let options = PipelineOptions::new(2, setting("MICRO", 4)?).with_schedule(schedule);
    let dir = std::env::var("MNIST_DIR").unwrap_or_else(|_| "data/mnist".into());
    let mnist = Mnist::load(&dir).with_context(|| format!("loading MNIST from {dir}"))?;
    let dev = Device::flex().autodiff();
    dev.seed(group.rank() as u64); // replicas differ until broadcast_model
    match options.place(group.as_ref())?.stage {
        0 => {
            let stage = Features {
                conv1: Conv2dConfig::new([1, 16], [5, 5]).init(&dev),
                conv2: Conv2dConfig::new([16, 32], [5, 5]).init(&dev),
                pool: MaxPool2dConfig::new([2, 2]).with_strides([2, 2]).init(),
                skip: LinearConfig::new(28 * 28, 10).init(&dev),
                relu: Relu::new(),
            };
            run(
                Pipeline::new(group, &stage, &dev, options)?,
                stage,
                &mnist,
                &dev,
            )
        }
        _ => {
            let stage = Classifier {
                fc1: LinearConfig::new(32 * 4 * 4, 128).init(&dev),
                fc2: LinearConfig::new(128, 10).init(&dev),
                relu: Relu::new(),
            };
            run(
                Pipeline::new(group, &stage, &dev, options)?,
                stage,
                &mnist,
                &dev,
            )
        }
    }
}
