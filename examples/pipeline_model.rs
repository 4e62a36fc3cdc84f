//! A model written in plain burn, cut by its program into three pipeline stages (one burn
//! module each, with a skip tensor from the first stage straight to the last), trained on
//! MNIST across processes by the library's one pipeline — the same one that cuts a YAML
//! model: GPipe or 1F1B, replicas of every stage, checkpoints, `--resume`, the report.
//!
//! ```text
//! cargo build --release -p flotilla -p flotilla-burn --example pipeline_model
//! target/release/flotilla launch --strategy pipeline --stages 3 --epochs 2 -- target/release/examples/pipeline_model
//! ```
//! Stage 0 (`Stem`: a convolution) sends its feature maps to stage 1 and a skip tensor (a
//! linear view of the pixels) to stage 2; stage 1 (`Body`: a convolution) sends its features
//! to stage 2 (`Head`), which adds the skip to its logits. `--data-parallel 2` (6 ranks: 2
//! replicas of each stage), `--micro-batches 8`, `schedule: gpipe` in a config file, and
//! every other setting of a config job apply. Without `--strategy pipeline` the same program
//! trains the whole module (`Net`) under any other way of training; `--zero 3` and
//! `--recompute` run it as its three stage modules, one gathered or recomputed at a time.

use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::pool::{MaxPool2d, MaxPool2dConfig};
use burn::nn::{Linear, LinearConfig, Relu};
use burn::prelude::*;
use burn::tensor::{Int, TensorData};
use flotilla_burn::{
    BatchRef, EngineError, NamedTensors, StageModule, StageModules, TrainModule, UserModule,
};

/// Stage 0: a convolution; also a linear view of the pixels that skips to stage 2.
#[derive(Module, Debug)]
struct Stem {
    conv: Conv2d,
    pool: MaxPool2d,
    skip: Linear,
    relu: Relu,
}

/// Stage 1: a second convolution.
#[derive(Module, Debug)]
struct Body {
    conv: Conv2d,
    pool: MaxPool2d,
    relu: Relu,
}

/// Stage 2: the classifier, plus the skip.
#[derive(Module, Debug)]
struct Head {
    fc1: Linear,
    fc2: Linear,
    relu: Relu,
}

/// The whole model: the three stages in order.
#[derive(Module, Debug)]
struct Net {
    stem: Stem,
    body: Body,
    head: Head,
}

impl Stem {
    fn new(device: &Device) -> Self {
        Stem {
            conv: Conv2dConfig::new([1, 16], [5, 5]).init(device),
            pool: MaxPool2dConfig::new([2, 2]).with_strides([2, 2]).init(),
            skip: LinearConfig::new(28 * 28, 10).init(device),
            relu: Relu::new(),
        }
    }

    /// Feature maps `[n, 16, 12, 12]` and the skip `[n, 10]`.
    fn forward(&self, x: Tensor<4>) -> (Tensor<4>, Tensor<2>) {
        let skip = self.skip.forward(x.clone().flatten::<2>(1, 3));
        (
            self.pool.forward(self.relu.forward(self.conv.forward(x))),
            skip,
        )
    }
}

impl Body {
    fn new(device: &Device) -> Self {
        Body {
            conv: Conv2dConfig::new([16, 32], [5, 5]).init(device),
            pool: MaxPool2dConfig::new([2, 2]).with_strides([2, 2]).init(),
            relu: Relu::new(),
        }
    }

    /// Features `[n, 512]`.
    fn forward(&self, x: Tensor<4>) -> Tensor<2> {
        let x = self.pool.forward(self.relu.forward(self.conv.forward(x)));
        x.flatten(1, 3)
    }
}

impl Head {
    fn new(device: &Device) -> Self {
        Head {
            fc1: LinearConfig::new(32 * 4 * 4, 128).init(device),
            fc2: LinearConfig::new(128, 10).init(device),
            relu: Relu::new(),
        }
    }

    /// Logits `[n, 10]`.
    fn forward(&self, features: Tensor<2>, skip: Tensor<2>) -> Tensor<2> {
        self.fc2
            .forward(self.relu.forward(self.fc1.forward(features)))
            + skip
    }
}

impl StageModule for Stem {
    fn inputs(&self) -> Vec<String> {
        vec!["image".into()]
    }
    fn outputs(&self) -> Vec<String> {
        vec!["maps".into(), "skip".into()]
    }
    fn forward(&self, mut t: NamedTensors) -> Result<NamedTensors, EngineError> {
        let (maps, skip) = self.forward(t.take::<4>("image")?);
        Ok(NamedTensors::new().with("maps", maps).with("skip", skip))
    }
}

impl StageModule for Body {
    fn inputs(&self) -> Vec<String> {
        vec!["maps".into()]
    }
    fn outputs(&self) -> Vec<String> {
        vec!["features".into()]
    }
    fn forward(&self, mut t: NamedTensors) -> Result<NamedTensors, EngineError> {
        Ok(NamedTensors::new().with("features", self.forward(t.take::<4>("maps")?)))
    }
}

impl StageModule for Head {
    fn inputs(&self) -> Vec<String> {
        vec!["features".into(), "skip".into()]
    }
    fn outputs(&self) -> Vec<String> {
        vec!["logits".into()]
    }
    fn forward(&self, mut t: NamedTensors) -> Result<NamedTensors, EngineError> {
        let logits = self.forward(t.take::<2>("features")?, t.take::<2>("skip")?);
        Ok(NamedTensors::new().with("logits", logits))
    }
}

impl TrainModule for Net {
    fn loss(&self, batch: BatchRef<'_>, device: &Device) -> Tensor<1> {
        let n = batch.labels.len();
        let labels =
            Tensor::<1, Int>::from_data(TensorData::new(batch.labels.to_vec(), [n]), device);
        CrossEntropyLossConfig::new()
            .init(device)
            .forward(self.logits(batch.images, n, device), labels)
    }

    fn logits(&self, inputs: &[f32], n: usize, device: &Device) -> Tensor<2> {
        let x = Tensor::from_data(TensorData::new(inputs.to_vec(), [n, 1, 28, 28]), device);
        let (maps, skip) = self.stem.forward(x);
        self.head.forward(self.body.forward(maps), skip)
    }
}

fn main() -> anyhow::Result<()> {
    let stages = StageModules::new()
        .stage(Stem::new)
        .stage(Body::new)
        .stage(Head::new);
    let model = UserModule::new("pipeline-model", &[1, 28, 28], |device| Net {
        stem: Stem::new(device),
        body: Body::new(device),
        head: Head::new(device),
    })
    .with_stages(stages);
    flotilla_burn::train(&model)?;
    Ok(())
}
