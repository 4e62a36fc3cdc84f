//! LeNet-5 written in burn by its user, trained by the library's run exactly as the YAML
//! model `lenet5` is by `flotilla train`: the same strategies, settings, checkpoints and
//! `--resume`, timeline, `/metrics` and report.
//!
//! ```text
//! cargo build --release -p flotilla -p flotilla-burn --example lenet5_program
//! target/release/flotilla launch -n 2 --data data/mnist --epochs 1 -- target/release/examples/lenet5_program
//! ```
//! Every setting is the config job's, by the same names (`--strategy async_allreduce -n 4`,
//! `--zero 2`, `--resume`, `FLOTILLA_CONFIG=job.yaml`; `--zero 3` and `--recompute` run it as
//! its two halves, each gathered (ZeRO-3) or recomputed one at a time; `--strategy flat -n
//! 3`: a parameter server and two sync workers, or a `parameter_server` section for others,
//! ...). The layers
//! run through Flotilla's kernels (`conv2d_relu`, `max_pool2d`, `linear`), which the spec
//! model uses too: from the same seed the two train to the same bits. `LAYERS=burn` runs burn's own
//! `forward`s instead (the same values up to rounding). `--strategy pipeline` trains its two
//! halves as two pipeline stages (`--stages 2`, one rank each; `--data-parallel 2`: 4 ranks).
//! `LOOP=own` runs the same training in the program's own loop (`flotilla_burn::session`);
//! `MODEL=spec` the job's YAML model in it (`flotilla_burn::spec_session`); `DATA=DIR` (with
//! `LOOP=own`) its own data: the program reads MNIST from `DIR` into memory itself, keeps
//! the first `TRAIN_SAMPLES` images, and hands them to the run
//! (`flotilla_burn::session_with_data`), which shards them by rank as it does a job's data.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::nn::PaddingConfig2d;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::pool::{MaxPool2d, MaxPool2dConfig};
use burn::nn::{Linear, LinearConfig, Relu};
use burn::prelude::*;
use burn::tensor::{Int, TensorData};
use flotilla_burn::kernels::{linear::linear, max_pool::max_pool2d};
use flotilla_burn::{
    BatchRef, EngineError, ImageDataset, NamedTensors, Normalization, StageModule, StageModules,
    TrainModule, UserModule, conv2d_relu,
};
use flotilla_data::Mnist;

/// LeNet-5's convolutions: `[n, 1, 28, 28]` images to `[n, 400]` features.
#[derive(Module, Debug)]
struct Features {
    conv1: Conv2d,
    pool1: MaxPool2d,
    conv2: Conv2d,
    pool2: MaxPool2d,
    relu: Relu,
    /// Run burn's own `forward`s rather than Flotilla's kernels.
    burn_layers: bool,
}

/// LeNet-5's classifier: features to 10 logits.
#[derive(Module, Debug)]
struct Classifier {
    fc1: Linear,
    fc2: Linear,
    fc3: Linear,
    relu: Relu,
    burn_layers: bool,
}

/// LeNet-5 for 28x28 MNIST, as `models/lenet5.yaml` describes it: the two halves, which are
/// also its two pipeline stages.
#[derive(Module, Debug)]
struct LeNet5 {
    features: Features,
    classifier: Classifier,
}

impl Features {
    fn new(device: &Device, burn_layers: bool) -> Self {
        let pool = || MaxPool2dConfig::new([2, 2]).with_strides([2, 2]).init();
        Features {
            conv1: Conv2dConfig::new([1, 6], [5, 5])
                .with_padding(PaddingConfig2d::Explicit(2, 2, 2, 2))
                .init(device),
            pool1: pool(),
            conv2: Conv2dConfig::new([6, 16], [5, 5])
                .with_padding(PaddingConfig2d::Explicit(0, 0, 0, 0))
                .init(device),
            pool2: pool(),
            relu: Relu::new(),
            burn_layers,
        }
    }

    fn forward(&self, x: Tensor<4>) -> Tensor<2> {
        if self.burn_layers {
            let x = self.pool1.forward(self.relu.forward(self.conv1.forward(x)));
            let x = self.pool2.forward(self.relu.forward(self.conv2.forward(x)));
            return x.flatten(1, 3);
        }
        let x = max_pool2d(&self.pool1, conv2d_relu(&self.conv1, x));
        let x = max_pool2d(&self.pool2, conv2d_relu(&self.conv2, x));
        x.flatten(1, 3)
    }
}

impl Classifier {
    fn new(device: &Device, burn_layers: bool) -> Self {
        Classifier {
            fc1: LinearConfig::new(16 * 5 * 5, 120).init(device),
            fc2: LinearConfig::new(120, 84).init(device),
            fc3: LinearConfig::new(84, 10).init(device),
            relu: Relu::new(),
            burn_layers,
        }
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        if self.burn_layers {
            let x = self.relu.forward(self.fc1.forward(x));
            let x = self.relu.forward(self.fc2.forward(x));
            return self.fc3.forward(x);
        }
        let x = linear(&self.fc1, x, true);
        let x = linear(&self.fc2, x, true);
        linear(&self.fc3, x, false)
    }
}

impl TrainModule for LeNet5 {
    fn loss(&self, batch: BatchRef<'_>, device: &Device) -> Tensor<1> {
        let n = batch.labels.len();
        let logits = self.logits(batch.images, n, device);
        let labels =
            Tensor::<1, Int>::from_data(TensorData::new(batch.labels.to_vec(), [n]), device);
        CrossEntropyLossConfig::new()
            .init(device)
            .forward(logits, labels)
    }

    fn logits(&self, inputs: &[f32], n: usize, device: &Device) -> Tensor<2> {
        let x = Tensor::from_data(TensorData::new(inputs.to_vec(), [n, 1, 28, 28]), device);
        self.classifier.forward(self.features.forward(x))
    }
}

/// Stage 0 of `strategy: pipeline`: images in, features out.
impl StageModule for Features {
    fn inputs(&self) -> Vec<String> {
        vec!["image".into()]
    }
    fn outputs(&self) -> Vec<String> {
        vec!["features".into()]
    }
    fn forward(&self, mut t: NamedTensors) -> Result<NamedTensors, EngineError> {
        Ok(NamedTensors::new().with("features", self.forward(t.take::<4>("image")?)))
    }
}

/// Stage 1: features in, logits out (the run computes the loss).
impl StageModule for Classifier {
    fn inputs(&self) -> Vec<String> {
        vec!["features".into()]
    }
    fn outputs(&self) -> Vec<String> {
        vec!["logits".into()]
    }
    fn forward(&self, mut t: NamedTensors) -> Result<NamedTensors, EngineError> {
        Ok(NamedTensors::new().with("logits", self.forward(t.take::<2>("features")?)))
    }
}

fn main() -> anyhow::Result<()> {
    let burn_layers = std::env::var("LAYERS").is_ok_and(|v| v == "burn");
    let stages = StageModules::new()
        .stage(move |device| Features::new(device, burn_layers))
        .stage(move |device| Classifier::new(device, burn_layers));
    let build = move |device: &Device| LeNet5 {
        features: Features::new(device, burn_layers),
        classifier: Classifier::new(device, burn_layers),
    };
    let model = UserModule::new("lenet5-program", &[1, 28, 28], build).with_stages(stages);
    if std::env::var("LOOP").is_ok_and(|v| v == "own") {
        return own_loop(&model, build);
    }
    if std::env::var("MODEL").is_ok_and(|v| v == "spec") {
        return spec_loop();
    }
    flotilla_burn::train(&model)?;
    Ok(())
}

/// `MODEL=spec`: the job's YAML model (`model: lenet5`) instead of this module, in the
/// program's own loop (`flotilla_burn::spec_session`). In an elastic pipeline a process can
/// stand by (no whole replica has a place for it) until the job ends: it ends as the job did.
fn spec_loop() -> anyhow::Result<()> {
    let trained = flotilla_burn::spec_session().and_then(|mut run| {
        while run.step()?.is_some() {}
        run.finish()?;
        Ok(())
    });
    match trained {
        Err(e) if e.stood_by() => {
            println!("{e}");
            Ok(())
        }
        other => other.map_err(Into::into),
    }
}

/// What `LOOP=own` asks of the run besides its steps, from the environment:
/// `CHECKPOINT_AT=S` writes a checkpoint after step `S`, `STOP_AT=S` ends the run after step
/// `S`, `EVAL_AT=S,T,...` evaluates after those steps (every rank decides alike), and
/// `SAVE_MODEL=PATH` writes the whole module's parameters to `PATH` after step
/// `SAVE_MODEL_AT` (else after the last), where the writing rank loads them back into a
/// module of its own.
struct Asks {
    checkpoint_at: Option<u64>,
    stop_at: Option<u64>,
    eval_at: Vec<u64>,
    save_model: Option<(PathBuf, Option<u64>)>,
}

impl Asks {
    fn from_env() -> anyhow::Result<Self> {
        let at = |var: &str| -> anyhow::Result<Option<u64>> {
            match std::env::var(var) {
                Ok(v) => Ok(Some(
                    v.parse().map_err(|e| anyhow::anyhow!("{var}={v}: {e}"))?,
                )),
                Err(_) => Ok(None),
            }
        };
        let eval_at = match std::env::var("EVAL_AT") {
            Ok(v) => v
                .split(',')
                .map(|s| {
                    s.trim()
                        .parse()
                        .map_err(|e| anyhow::anyhow!("EVAL_AT={v}: {e}"))
                })
                .collect::<anyhow::Result<_>>()?,
            Err(_) => Vec::new(),
        };
        let save_model = match std::env::var_os("SAVE_MODEL") {
            Some(path) => Some((PathBuf::from(path), at("SAVE_MODEL_AT")?)),
            None => None,
        };
        Ok(Self {
            checkpoint_at: at("CHECKPOINT_AT")?,
            stop_at: at("STOP_AT")?,
            eval_at,
            save_model,
        })
    }
}

/// `LOOP=own`: the same run in the program's own loop (`flotilla_burn::session`), which
/// prints a line of its own every 50 steps and does what [`Asks`] says; it trains to the
/// same bits as `flotilla_burn::train`.
fn own_loop<M, F>(model: &UserModule<F>, build: F) -> anyhow::Result<()>
where
    M: TrainModule,
    F: Fn(&Device) -> M,
{
    let asks = Asks::from_env()?;
    let mut run = match std::env::var("DATA") {
        Ok(dir) => {
            let keep = std::env::var("TRAIN_SAMPLES")
                .ok()
                .map(|v| v.parse())
                .transpose()?;
            let (train, test) = own_data(&dir, keep)?;
            flotilla_burn::session_with_data(model, Arc::new(train), Box::new(test))?
        }
        Err(_) => flotilla_burn::session(model)?,
    };
    while let Some(p) = run.step()? {
        if !p.progressed {
            continue;
        }
        if p.step % 50 == 0
            && let Some(loss) = p.loss
        {
            println!("own loop: step {}/{} loss {loss:.4}", p.step, p.total);
        }
        if asks.checkpoint_at == Some(p.step)
            && let Some(dir) = run.checkpoint()?
        {
            println!("own loop: checkpoint {}", dir.display());
        }
        if asks.eval_at.contains(&p.step)
            && let Some(e) = run.evaluate()?
        {
            let acc = e.accuracy();
            println!("own loop: eval at step {} test_acc={acc:.6}", p.step);
        }
        if let Some((path, Some(at))) = &asks.save_model
            && *at == p.step
        {
            save_model(&mut run, path, &build)?;
        }
        if asks.stop_at == Some(p.step) {
            run.stop(&format!("the program's own stop at step {}", p.step))?;
        }
    }
    if let Some((path, None)) = &asks.save_model {
        save_model(&mut run, path, &build)?;
    }
    run.finish()?;
    Ok(())
}

/// The whole module's parameters written to `path` (every rank calls it; under ZeRO-3 no
/// rank holds them all); the rank that wrote them loads them into a module of its own, as
/// a program that goes on to use the trained model would (a pipeline's file names each
/// tensor by its stage module: loaded stage by stage, not here).
fn save_model<M: TrainModule>(
    run: &mut flotilla_burn::Session,
    path: &Path,
    build: impl Fn(&Device) -> M,
) -> anyhow::Result<()> {
    let Some(file) = run.save_model(path)? else {
        return Ok(());
    };
    println!("own loop: model {}", file.display());
    if run.role() != "stage" {
        let loaded = flotilla_burn::load(&build(&Device::default()), &file)?;
        println!("own loop: loaded back, {} parameters", loaded.num_params());
    }
    Ok(())
}

/// `DATA=DIR`: MNIST read by the program itself, its training images cut to the first
/// `keep` (all: `None`) and copied into a data set of the program's own making.
fn own_data(dir: &str, keep: Option<u64>) -> anyhow::Result<(ImageDataset, ImageDataset)> {
    let splits = Mnist::load(dir)?;
    let train = &splits.train;
    let n = keep.map_or(train.len(), |k| (k as usize).min(train.len()));
    let size = train.rows() * train.cols();
    let own = ImageDataset::new(
        train.pixels()[..n * size].to_vec(),
        train.labels()[..n].to_vec(),
        train.rows(),
        train.cols(),
        Normalization::MNIST,
    )?;
    Ok((own, splits.test))
}
