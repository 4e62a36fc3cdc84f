//! What the in-memory tests of strategies, servers and the run loop share: a tiny model, a
//! small deterministic data set, in-memory worlds, one rank's context and its strategies
//! built by their production constructors ([`Rank::build`]), and the serial references they
//! are checked against — a gradient oracle (the engine's gradient at given
//! parameters on a given batch) and SGD written out as a formula.
//!
//! The references are deliberately plain: the code under test is the production strategy or
//! server; only the numbers it must produce are computed here, one step at a time.

use std::sync::Arc;
use std::time::Duration;

use flotilla_cluster::Topology;
use flotilla_data::{ImageDataset, Normalization};
use flotilla_engine::{
    BatchRef, BurnEngine, DecayParams, Engine, ModelSpec, ModelState, OptimizerSpec,
};
use flotilla_tcp::{CommConfig, ProcessGroup, TcpGroup};

use crate::batches::{Batches, Position};
use crate::checkpoint::CheckpointState;
use crate::config::{LrSchedule, TrainConfig};
use crate::observe::Quiet;
use crate::runlog::RunLog;
use crate::strategy::{Cx, Setup, Strategy};

/// Two linear layers on a 2×2 input, 3 classes: 35 parameters in 4 tensors.
pub(crate) const SPEC: &str = "name: mlp2\ninput: [1, 2, 2]\nlayers:\n  - flatten\n  - linear: {out: 4}\n  - tanh\n  - linear: {out: 3}\n";
/// The engine's initialisation seed (every rank builds the same model).
pub(crate) const SEED: u64 = 11;
/// The data shuffling seed of every [`Batches`].
pub(crate) const DATA_SEED: u64 = 3;
/// Samples per batch.
pub(crate) const BATCH: usize = 4;

/// The model of [`SPEC`].
pub(crate) fn spec() -> ModelSpec {
    ModelSpec::from_yaml(SPEC, "mlp2").expect("spec")
}

/// SGD without weight decay (PyTorch semantics, as burn implements it).
pub(crate) fn sgd(lr: f64, momentum: f64) -> OptimizerSpec {
    OptimizerSpec::Sgd {
        lr,
        momentum,
        dampening: 0.0,
        nesterov: false,
        weight_decay: 0.0,
        decay_params: DecayParams::All,
    }
}

/// Adam without weight decay (betas 0.9 and 0.99).
pub(crate) fn adam(lr: f64) -> OptimizerSpec {
    OptimizerSpec::Adam {
        lr,
        beta1: 0.9,
        beta2: 0.99,
        epsilon: 1e-8,
        weight_decay: 0.0,
        decay_params: DecayParams::All,
    }
}

/// A config of `optimizer`, constant learning rate, no warm-up, a 5 s deadline, engines on
/// `flex` from [`SEED`].
pub(crate) fn config(optimizer: OptimizerSpec) -> TrainConfig {
    let mut c = TrainConfig {
        optimizer,
        ..TrainConfig::default()
    };
    c.model.device = "flex".into();
    c.model.seed = SEED;
    c.schedule.lr_schedule = LrSchedule::Constant;
    c.schedule.warmup_steps = 0;
    c.schedule.divergence_check_rounds = 0;
    c.comm.timeout_s = 5.0;
    c
}

/// `n` samples of 2×2 pixels normalised into [-1, 1) and labels 0..3, all different.
pub(crate) fn dataset(n: usize) -> ImageDataset {
    let pixels = (0..n * 4).map(|i| ((i * 37 + 11) % 101) as u8).collect();
    let labels = (0..n).map(|i| ((i * 7 + i / 3) % 3) as u8).collect();
    let norm = Normalization {
        mean: 0.2,
        std: 0.2,
    };
    ImageDataset::new(pixels, labels, 2, 2, norm).expect("dataset")
}

/// `n` ranks of one in-memory world.
pub(crate) fn world(n: usize) -> Vec<Arc<dyn ProcessGroup>> {
    world_with(n, CommConfig::new(Some(0), n))
}

/// `n` ranks of one in-memory world of `cfg` (with a 5 s deadline).
pub(crate) fn world_with(n: usize, cfg: CommConfig) -> Vec<Arc<dyn ProcessGroup>> {
    TcpGroup::in_memory(n, cfg.with_timeout(Duration::from_secs(5)))
        .expect("world")
        .into_iter()
        .map(|c| Arc::new(c) as Arc<dyn ProcessGroup>)
        .collect()
}

/// The batches shard `rank` of `workers` trains on, from the start.
pub(crate) fn batches(data: &ImageDataset, workers: usize, rank: usize) -> Batches {
    Batches::new(
        Arc::new(data.clone()),
        (workers, rank),
        DATA_SEED,
        BATCH,
        Position::default(),
    )
    .expect("batches")
}

/// What one rank's [`Cx`] borrows.
pub(crate) struct Rank {
    pub(crate) comm: Arc<dyn ProcessGroup>,
    pub(crate) config: TrainConfig,
    pub(crate) data: ImageDataset,
    pub(crate) log: RunLog,
    pub(crate) observer: Quiet,
    /// Units of progress of the run (the learning-rate schedule's length).
    pub(crate) rounds: u64,
    _dir: tempfile::TempDir,
}

impl Rank {
    /// Rank `comm.rank()` of a job of `config`, with `samples` training samples.
    pub(crate) fn new(
        comm: Arc<dyn ProcessGroup>,
        mut config: TrainConfig,
        samples: usize,
    ) -> Self {
        let dir = tempfile::tempdir().expect("tmp");
        config.telemetry.output = dir.path().to_path_buf();
        let log = RunLog::open(dir.path(), comm.rank()).expect("log");
        Self {
            comm,
            config,
            data: dataset(samples),
            log,
            observer: Quiet,
            rounds: 1000,
            _dir: dir,
        }
    }

    /// The run loop's context of this rank.
    pub(crate) fn cx(&mut self) -> Cx<'_> {
        Cx {
            comm: &self.comm,
            config: &self.config,
            test: &self.data,
            rank: self.comm.rank(),
            rounds: self.rounds,
            log: &mut self.log,
            observer: &mut self.observer,
            fault: None,
        }
    }

    /// This rank's strategy in the job of `topology` (of [`SPEC`]), made by its production
    /// constructor `build`: the one the trainer's [`crate::strategy::registry`] calls.
    pub(crate) fn build<S>(
        &mut self,
        topology: &Topology,
        build: impl FnOnce(&mut Cx<'_>, &Setup<'_>) -> crate::Result<S>,
    ) -> S {
        self.build_model(&spec(), topology, build)
    }

    /// As [`Rank::build`], for a model of `spec`.
    pub(crate) fn build_model<S>(
        &mut self,
        spec: &ModelSpec,
        topology: &Topology,
        build: impl FnOnce(&mut Cx<'_>, &Setup<'_>) -> crate::Result<S>,
    ) -> S {
        let setup = Setup {
            model: spec,
            topology,
            samples: self.data.len(),
            joining: false,
        };
        build(&mut self.cx(), &setup).expect("strategy")
    }
}

/// The flat parameters `strategy` holds.
pub(crate) fn params(strategy: &mut dyn Strategy) -> Vec<f32> {
    let model = strategy.model().expect("a strategy with a model");
    let mut p = vec![0.0; model.num_params()];
    model.read_params(&mut p).expect("params");
    p
}

/// The gradient of the loss at given parameters on a given batch, from an engine of
/// [`SPEC`] (the same computation the ranks' engines do, so bitwise the same numbers).
pub(crate) struct Oracle {
    engine: BurnEngine,
}

impl Oracle {
    /// An oracle, and the model's initial parameters.
    pub(crate) fn new() -> (Self, Vec<f32>) {
        let engine = BurnEngine::new(&spec(), &sgd(0.1, 0.0), "flex", SEED).expect("engine");
        let mut w = vec![0.0; engine.num_params()];
        engine.read_params(&mut w).expect("params");
        (Self { engine }, w)
    }

    /// The gradient at `params` on `batch`, and the batch's mean loss.
    pub(crate) fn grad(&mut self, params: &[f32], batch: BatchRef<'_>) -> (Vec<f32>, f32) {
        self.engine.write_params(params).expect("write");
        let loss = self.engine.forward_backward(batch).expect("backward");
        let mut g = vec![0.0; params.len()];
        self.engine.read_grads(&mut g).expect("grads");
        (g, loss)
    }
}

/// SGD with momentum as a formula (burn's and PyTorch's, dampening 0, no weight decay): the
/// velocity is the first gradient, then `v ← g + μ·v`; the step is `w ← w − lr·v`, in f32
/// with the learning rate rounded to f32.
pub(crate) struct SgdRef {
    momentum: f32,
    velocity: Option<Vec<f32>>,
}

impl SgdRef {
    /// No velocity yet.
    pub(crate) fn new(momentum: f64) -> Self {
        Self {
            momentum: momentum as f32,
            velocity: None,
        }
    }

    /// One step of `w` with gradient `g` at learning rate `lr`.
    pub(crate) fn step(&mut self, w: &mut [f32], g: &[f32], lr: f64) {
        let v = match self.velocity.take() {
            Some(mut v) if self.momentum > 0.0 => {
                for (v, g) in v.iter_mut().zip(g) {
                    // burn: `g·(1 − dampening) + μ·v`; `g·1` is `g` exactly.
                    *v = g + *v * self.momentum;
                }
                v
            }
            _ => g.to_vec(),
        };
        let lr = lr as f32;
        for (w, v) in w.iter_mut().zip(&v) {
            *w -= v * lr;
        }
        self.velocity = Some(v);
    }
}

/// The mean of two ranks' gradients as a two-rank ring all-reduce makes it: `(a + b) / 2`.
pub(crate) fn mean2(a: &[f32], b: &[f32]) -> Vec<f32> {
    a.iter().zip(b).map(|(a, b)| (a + b) * 0.5).collect()
}

/// Asserts `got == want` bit for bit, naming the first difference.
pub(crate) fn assert_bitwise(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!(
            "{what}: parameter {i} is {} but the reference is {} (relative error {:e})",
            got[i],
            want[i],
            ((got[i] - want[i]) / want[i].abs().max(1e-6)).abs()
        );
    }
}

/// The largest relative error of `got` against `want` (relative to the largest |want|).
pub(crate) fn relative_error(got: &[f32], want: &[f32]) -> f32 {
    let scale = want.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
    got.iter()
        .zip(want)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()))
        / scale
}

/// The state a test's checkpoint records after `step` steps of epoch 0 of model `model`.
pub(crate) fn checkpoint_at(step: u64, model: &str) -> CheckpointState {
    CheckpointState {
        step,
        epoch: 0,
        step_in_epoch: step,
        config_hash: 7,
        model: model.into(),
        num_params: 0,
        test_acc: None,
        stages: None,
        zero: None,
        stage_zero: None,
    }
}

/// The tensors of the safetensors file `file` by name, with their bytes.
pub(crate) fn tensor_bytes(file: &std::path::Path) -> std::collections::BTreeMap<String, Vec<u8>> {
    let bytes = std::fs::read(file).expect("a safetensors file");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    (st.tensors().into_iter())
        .map(|(n, v)| (n, v.data().to_vec()))
        .collect()
}
