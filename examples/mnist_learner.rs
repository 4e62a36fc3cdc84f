//! burn's guide MNIST model, trained by burn-train's own `Learner` (`SupervisedTraining`,
//! its metrics, checkpoints and resume) on every rank of a Flotilla job: the guide's program
//! with the data cut by rank and one line more, `.with_training_strategy(flotilla.training())`.
//!
//! ```text
//! cargo build --release -p flotilla -p flotilla-burn --example mnist_learner
//! target/release/flotilla launch -n 2 -- target/release/examples/mnist_learner
//! ```
//! Its own settings (environment): `DATA` (the MNIST directory, default `data/mnist`: burn's
//! `MnistDataset` downloads, this machine reads the vendored files), `EPOCHS` (default 6),
//! `LR` (Adam's, default 1e-3), `DROPOUT` (default 0.1; the guide's 0.5 needs more epochs to
//! reach 99 %), `TRAIN_SAMPLES` (the first n training images, default all), `TEST_SAMPLES`
//! (the first n test images, which validate each epoch and give the final accuracy; default
//! all), `ARTIFACTS` (the `Learner`'s directory: metrics and checkpoints; default
//! `mnist-learner-artifacts`),
//! `RESUME=E` (go on from the checkpoint of epoch E), `STOP_AFTER=E` (burn's early
//! stopping, a strategy of the program's, ends the training once epoch E is validated),
//! `SAVE=FILE` (rank 0 writes the trained
//! parameters as safetensors), `LOOP=own` (the same training in the program's own loop with
//! `flotilla_burn::DataParallel`, no `Learner`: what the tests compare it with; it prints
//! each rank's optimizer state size; with `AVERAGE_EVERY=K` each rank steps its own Adam on
//! its own batches and the models are averaged every K steps, `DataParallel::average_model`).
//! The launcher's settings of the job: `--batch-size` (per rank, default 64), `--zero 1` (the
//! optimizer state sharded by parameter, ZeRO-1: `flotilla_burn::ParamShards`, in the
//! `Learner` and in the own loop), `--strategy async_allreduce` (the one stack's async
//! all-reduce drives the `Learner`), `--strategy flat -n 3` (a parameter server, rank 0, and
//! two workers; a config file with `local_steps: 4` makes it model averaging, `aggr_type:
//! async` asynchronous, `arch: hierarchical` a tree). Rank 0 prints `test accuracy: X` at the
//! end (under parameter servers rank 0 is the root server, which holds the model).

use std::path::PathBuf;
use std::sync::Arc;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::{Dataset, DatasetError};
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::pool::{AdaptiveAvgPool2d, AdaptiveAvgPool2dConfig};
use burn::nn::{Dropout, DropoutConfig, Linear, LinearConfig, Relu};
use burn::optim::{AdamConfig, GradientsParams};
use burn::prelude::*;
use burn::tensor::TensorData;
use burn::train::metric::store::EventStoreClient;
use burn::train::metric::{AccuracyMetric, LossMetric};
use burn::train::{
    ClassificationOutput, EarlyStoppingStrategy, InferenceStep, Learner, SupervisedTraining,
    TrainOutput, TrainStep,
};
use flotilla_burn::{DataParallel, ImageDataset, LearnerStrategy, ParamShards};

/// The guide's model: two convolutions, adaptive pooling, two linear layers, dropout.
#[derive(Module, Debug)]
struct Model {
    conv1: Conv2d,
    conv2: Conv2d,
    pool: AdaptiveAvgPool2d,
    dropout: Dropout,
    linear1: Linear,
    linear2: Linear,
    activation: Relu,
}

impl Model {
    fn new(dropout: f64, device: &Device) -> Self {
        Self {
            conv1: Conv2dConfig::new([1, 8], [3, 3]).init(device),
            conv2: Conv2dConfig::new([8, 16], [3, 3]).init(device),
            pool: AdaptiveAvgPool2dConfig::new([8, 8]).init(),
            activation: Relu::new(),
            linear1: LinearConfig::new(16 * 8 * 8, 512).init(device),
            linear2: LinearConfig::new(512, 10).init(device),
            dropout: DropoutConfig::new(dropout).init(),
        }
    }

    /// `[batch, 28, 28]` images to `[batch, 10]` logits.
    fn forward(&self, images: Tensor<3>) -> Tensor<2> {
        let [batch, height, width] = images.dims();
        let x = images.reshape([batch, 1, height, width]);
        let x = self.dropout.forward(self.conv1.forward(x));
        let x = self.dropout.forward(self.conv2.forward(x));
        let x = self.pool.forward(self.activation.forward(x));
        let x = x.reshape([batch, 16 * 8 * 8]);
        let x = self
            .activation
            .forward(self.dropout.forward(self.linear1.forward(x)));
        self.linear2.forward(x)
    }

    fn forward_classification(&self, batch: MnistBatch) -> ClassificationOutput {
        let output = self.forward(batch.images);
        let loss = CrossEntropyLossConfig::new()
            .init(&output.device())
            .forward(output.clone(), batch.targets.clone());
        ClassificationOutput::new(loss, output, batch.targets)
    }
}

impl TrainStep for Model {
    type Input = MnistBatch;
    type Output = ClassificationOutput;

    fn step(&self, batch: MnistBatch) -> TrainOutput<ClassificationOutput> {
        let item = self.forward_classification(batch);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl InferenceStep for Model {
    type Input = MnistBatch;
    type Output = ClassificationOutput;

    fn step(&self, batch: MnistBatch) -> ClassificationOutput {
        self.forward_classification(batch)
    }
}

/// One image (normalized pixels) and its label.
#[derive(Clone, Debug)]
struct MnistItem {
    pixels: Vec<f32>,
    label: u8,
}

/// The vendored MNIST files as a burn `Dataset`.
struct Mnist(Arc<ImageDataset>);

impl Dataset<MnistItem> for Mnist {
    fn get(&self, index: usize) -> Result<MnistItem, DatasetError> {
        let (image, label) = match (self.0.image(index), self.0.label(index)) {
            (Some(image), Some(label)) => (image, label),
            _ => {
                let msg = format!("no image {index} of {}", self.0.len());
                return Err(DatasetError::new(std::io::Error::other(msg)));
            }
        };
        let norm = self.0.normalization();
        let pixels = image.iter().map(|p| norm.apply(*p)).collect();
        Ok(MnistItem { pixels, label })
    }

    fn len(&self) -> usize {
        self.0.len()
    }
}

#[derive(Clone, Debug)]
struct MnistBatch {
    images: Tensor<3>,
    targets: Tensor<1, Int>,
}

#[derive(Clone, Default)]
struct MnistBatcher;

impl Batcher<MnistItem, MnistBatch> for MnistBatcher {
    fn batch(&self, items: Vec<MnistItem>, device: &Device) -> MnistBatch {
        let n = items.len();
        let pixels: Vec<f32> = items
            .iter()
            .flat_map(|i| i.pixels.iter().copied())
            .collect();
        let labels: Vec<i64> = items.iter().map(|i| i64::from(i.label)).collect();
        MnistBatch {
            images: Tensor::from_data(TensorData::new(pixels, [n, 28, 28]), device),
            targets: Tensor::from_data(TensorData::new(labels, [n]), device),
        }
    }
}

/// The example's settings, from its environment.
struct Settings {
    data: PathBuf,
    epochs: usize,
    lr: f64,
    dropout: f64,
    train_samples: Option<usize>,
    test_samples: Option<usize>,
    artifacts: PathBuf,
    resume: Option<usize>,
    save: Option<PathBuf>,
    own_loop: bool,
    average_every: Option<usize>,
    stop_after: Option<usize>,
}

/// burn's early stopping as a program gives its own (`STOP_AFTER=E`): stop once epoch `E`
/// is validated.
#[derive(Clone)]
struct StopAfter(usize);

impl EarlyStoppingStrategy for StopAfter {
    fn should_stop(&mut self, epoch: usize, _: &EventStoreClient) -> bool {
        epoch >= self.0
    }
}

fn env<T: std::str::FromStr>(name: &str, default: T) -> anyhow::Result<T> {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .map_err(|_| anyhow::anyhow!("{name}={v} is not a valid value")),
        Err(_) => Ok(default),
    }
}

impl Settings {
    fn from_env() -> anyhow::Result<Self> {
        let opt = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let parse_opt = |name: &str| -> anyhow::Result<Option<usize>> {
            opt(name)
                .map(|v| {
                    v.parse()
                        .map_err(|_| anyhow::anyhow!("{name}={v} is not a number"))
                })
                .transpose()
        };
        Ok(Self {
            data: env("DATA", PathBuf::from("data/mnist"))?,
            epochs: env("EPOCHS", 6)?,
            lr: env("LR", 1e-3)?,
            dropout: env("DROPOUT", 0.1)?,
            train_samples: parse_opt("TRAIN_SAMPLES")?,
            test_samples: parse_opt("TEST_SAMPLES")?,
            artifacts: env("ARTIFACTS", PathBuf::from("mnist-learner-artifacts"))?,
            resume: parse_opt("RESUME")?,
            save: opt("SAVE").map(PathBuf::from),
            own_loop: opt("LOOP").is_some_and(|v| v == "own"),
            average_every: parse_opt("AVERAGE_EVERY")?,
            stop_after: parse_opt("STOP_AFTER")?,
        })
    }
}

fn main() -> anyhow::Result<()> {
    let s = Settings::from_env()?;
    let mut splits = flotilla_data::Mnist::load(&s.data)?;
    if let Some(n) = s.train_samples {
        splits.train.truncate(n);
    }
    if let Some(n) = s.test_samples {
        splits.test.truncate(n);
    }
    let flotilla = LearnerStrategy::join()?;
    let device = flotilla.device().clone();
    let rank = flotilla.rank();
    // Every rank draws the same initial model (rank 0's is broadcast anyway) and, with dropout,
    // its own masks.
    device.seed(42);
    let model = Model::new(s.dropout, &device);
    device.seed(1000 + rank as u64);
    let test = Arc::new(splits.test);
    // This rank's part of the training set, at the job's batch size (`--batch-size`).
    let train = flotilla.train_loader(Mnist(Arc::new(splits.train)), MnistBatcher)?;
    let valid: Arc<dyn DataLoader<MnistBatch>> = DataLoaderBuilder::new(MnistBatcher)
        .batch_size(500)
        .num_workers(1)
        .set_device(device.clone().inner())
        .build(flotilla.shard_in_order(Mnist(test.clone())));
    let model = if s.own_loop {
        own_loop(&flotilla, model, &train, &s)?
    } else {
        let mut training = SupervisedTraining::new(&s.artifacts, train, valid)
            .metrics((AccuracyMetric::new(), LossMetric::new()))
            .with_default_checkpointers()
            .num_epochs(s.epochs);
        if rank == 0 {
            training = training.summary();
        }
        if let Some(epoch) = s.resume {
            training = training.checkpoint(epoch);
        }
        if let Some(epoch) = s.stop_after {
            training = training.early_stopping(StopAfter(epoch));
        }
        let result = training
            .with_training_strategy(flotilla.training())
            .launch(Learner::new(model, AdamConfig::new().init(), s.lr));
        if let Some(error) = result.error {
            anyhow::bail!("rank {rank}: training failed: {error}");
        }
        result.model
    };
    finish(rank, &model, &Mnist(test), s.save.as_deref())
}

/// The same training in the program's own loop: burn's forward and backward, the gradients
/// averaged by `DataParallel`, burn's Adam.
fn own_loop(
    flotilla: &LearnerStrategy,
    model: Model,
    train: &Arc<dyn DataLoader<MnistBatch>>,
    s: &Settings,
) -> anyhow::Result<Model> {
    let group = flotilla.group().ok_or_else(|| {
        anyhow::anyhow!("the own loop runs sync all-reduce (ZeRO-0 or 1), not this job's way")
    })?;
    let mut dp = DataParallel::new(group.clone(), &model)?;
    let mut model = dp.broadcast_model(model)?;
    // ZeRO-1 (`--zero 1`): the optimizer steps this rank's share of the parameters only.
    let shards = (flotilla.zero() == 1).then(|| ParamShards::new(&dp));
    let mut optim = AdamConfig::new().init();
    let mut step = 0;
    for epoch in 1..=s.epochs {
        flotilla.set_epoch(epoch);
        for batch in train.iter() {
            let out = TrainStep::step(&model, batch?);
            step += 1;
            if let Some(every) = s.average_every {
                // Model averaging: this rank's own step, the replicas averaged every `every`.
                model = optim.step(s.lr, model, out.grads);
                if step % every == 0 {
                    model = dp.average_model(model)?;
                }
                continue;
            }
            let grads: GradientsParams = dp.average(out.grads, &model)?;
            model = match &shards {
                None => optim.step(s.lr, model, grads),
                Some(shards) => {
                    let mine = shards.own_grads(grads, &model)?;
                    shards.gather(optim.step(s.lr, model, mine))?
                }
            };
        }
    }
    let state = optim
        .into_bytes()
        .map_err(|e| anyhow::anyhow!("the optimizer's state: {e:?}"))?;
    println!(
        "rank {} optimizer state: {} bytes",
        flotilla.rank(),
        state.len()
    );
    Ok(model)
}

/// Rank 0: the test accuracy of the trained model, and its parameters saved if asked.
fn finish(
    rank: usize,
    model: &Model,
    test: &Mnist,
    save: Option<&std::path::Path>,
) -> anyhow::Result<()> {
    if rank != 0 {
        return Ok(());
    }
    let model = model.valid();
    let cpu = model.devices()[0].clone();
    let mut correct = 0usize;
    let n = test.len();
    for start in (0..n).step_by(1000) {
        let items: Vec<MnistItem> = (start..(start + 1000).min(n))
            .map(|i| test.get(i))
            .collect::<Result<_, _>>()?;
        let batch = MnistBatcher.batch(items, &cpu);
        let predicted = model.forward(batch.images).argmax(1).flatten::<1>(0, 1);
        let hits = predicted
            .equal(batch.targets)
            .int()
            .sum()
            .into_scalar::<i64>();
        correct += usize::try_from(hits).unwrap_or(0);
    }
    println!("test accuracy: {:.4}", correct as f64 / n as f64);
    if let Some(path) = save {
        flotilla_burn::save(&model, path)?;
    }
    Ok(())
}
