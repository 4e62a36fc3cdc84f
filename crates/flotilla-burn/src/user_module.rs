//! A burn user's own module as what a Flotilla run trains ([`UserModule`], a
//! [`ModelSource`]), and [`train`]: the whole run of a config job — every way of training
//! but a spec's pipeline, checkpoints and `--resume`, timeline, `/metrics`, run.log,
//! summary.json and plots, target stop — for it, in one call of the user's program.

use std::sync::{Arc, OnceLock};

use burn::prelude::*;
use flotilla_data::Samples;
use flotilla_engine::{
    Engine, ModelState, ModuleEngine, OptimizerSpec, ParamLayout, Shape, ShardSink, StageBuilder,
    StageInput, StageModule, TrainModule, module_pipeline, stage_classes,
};
use flotilla_rank::Session;
use flotilla_train::job_data::JobData;
use flotilla_train::{ModelIo, ModelSource, RunSummary, StageMaker, TrainError};

use crate::error::{DistError, Result};

/// A user's module, built by `build` on the device it is given (the run seeds the device
/// first, so every rank draws the same initial parameters), with what one sample of the
/// job's data looks like to it.
pub struct UserModule<F> {
    name: String,
    input: Vec<usize>,
    vocab: Option<usize>,
    build: F,
    /// The same model cut into stage modules, for `strategy: pipeline` (empty: not cut);
    /// shared with the [`StageMaker`] an elastic pipeline keeps.
    stages: Arc<Vec<StageBuilder>>,
    /// What one build of the module tells (see [`Probe`]).
    probe: OnceLock<std::result::Result<Probe, String>>,
}

/// What one build of a user's module tells.
struct Probe {
    /// Its parameters' names and shapes.
    params: String,
    /// Labels per sample.
    labels_per_sample: usize,
    /// Logits per label: the classes it gives.
    classes: usize,
}

/// A model cut by its program into pipeline stages: one burn module per stage
/// ([`StageModule`]), in order.
#[derive(Default)]
pub struct StageModules {
    builders: Vec<StageBuilder>,
}

impl StageModules {
    /// No stages yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// `self` with one more stage, the module `build` makes on the device it is given.
    /// Stages are built in order from one seed, so a stage draws the initial parameters
    /// that the same layers of the whole module get when it is built of the stages' modules
    /// in the same order.
    pub fn stage<S: StageModule>(
        mut self,
        build: impl Fn(&Device) -> S + Send + Sync + 'static,
    ) -> Self {
        self.builders
            .push(Box::new(move |device| Box::new(build(device))));
        self
    }
}

impl<M: TrainModule, F: Fn(&Device) -> M> UserModule<F> {
    /// The module `build` makes, named `name` (logs, checkpoints), taking samples of shape
    /// `input` (`[1, 28, 28]` for MNIST's images).
    pub fn new(name: &str, input: &[usize], build: F) -> Self {
        Self {
            name: name.to_string(),
            input: input.to_vec(),
            vocab: None,
            build,
            stages: Arc::new(Vec::new()),
            probe: OnceLock::new(),
        }
    }

    /// The same model cut into `stages`, which `strategy: pipeline` trains (one stage per
    /// rank, the GPipe or 1F1B schedule, replicas of every stage), ZeRO stage 3 shards by
    /// (PyTorch FSDP's `fully_shard` per stage module: each one's parameters gathered just
    /// before it runs and released after, its forward recomputed in backward) and
    /// `recompute: true` recomputes by; every other way of training trains the whole
    /// module. Together the stages hold the module's parameters in its order (ZeRO-3 and
    /// recomputation check their shapes), and in sequence compute its logits; the loss is the
    /// cross-entropy of the last stage's logits.
    pub fn with_stages(mut self, stages: StageModules) -> Self {
        self.stages = Arc::new(stages.builders);
        self
    }

    /// The module takes windows of token ids below `vocab` (a text's data set): `input` is
    /// then `[T]`, the window's length.
    pub fn with_vocab(mut self, vocab: usize) -> Self {
        self.vocab = Some(vocab);
        self
    }

    /// One build of the module (seed 0): its parameters' names and shapes, its labels per
    /// sample, and its classes (the logits of one sample of zeros). A module cut into stage
    /// modules is never drawn whole here (ZeRO-3's ranks never hold it whole): its names and
    /// shapes are those of a build whose parameters are not drawn yet, its classes those of
    /// its stages, drawn and run one at a time.
    fn probe(&self) -> flotilla_train::Result<&Probe> {
        let probe = self.probe.get_or_init(|| {
            let shape = Shape::of_sample(&self.input).filter(|_| !self.stages.is_empty());
            let Some(shape) = shape else {
                return self.probe_whole();
            };
            // burn draws a parameter at its first use: this build draws nothing.
            let model = (self.build)(&Device::flex().autodiff());
            let classes = stage_classes(&self.stages, shape).map_err(|e| e.to_string())?;
            Ok(Probe {
                params: param_names(&ParamLayout::of(&model)),
                labels_per_sample: model.labels_per_sample(),
                classes,
            })
        });
        probe
            .as_ref()
            .map_err(|e| TrainError::config("model", format!("building `{}`: {e}", self.name)))
    }

    /// [`UserModule::probe`] of a module without stage modules: built and drawn whole.
    fn probe_whole(&self) -> std::result::Result<Probe, String> {
        let optimizer = OptimizerSpec::default();
        let engine =
            ModuleEngine::seeded(&self.build, 0, &optimizer, "flex").map_err(|e| e.to_string())?;
        let module = engine.module().map_err(|e| e.to_string())?;
        let zeros = vec![0.0; self.input.iter().product()];
        let [_, classes] = module.logits(&zeros, 1, &Device::flex().autodiff()).dims();
        Ok(Probe {
            params: param_names(engine.layout()),
            labels_per_sample: engine.labels_per_sample(),
            classes,
        })
    }
}

/// Every parameter's name and shape, in flat order: what the ranks must agree on.
fn param_names(layout: &ParamLayout) -> String {
    let params: Vec<String> = layout
        .params
        .iter()
        .map(|p| format!("{}{:?}", p.name, p.shape))
        .collect();
    params.join(" ")
}

impl<M: TrainModule, F: Fn(&Device) -> M> ModelSource for UserModule<F> {
    fn name(&self) -> &str {
        &self.name
    }

    fn fingerprint(&self) -> flotilla_train::Result<String> {
        let params = &self.probe()?.params;
        Ok(format!(
            "{} {:?} {:?} {params}",
            self.name, self.input, self.vocab
        ))
    }

    fn io(&self) -> flotilla_train::Result<ModelIo> {
        Ok(ModelIo {
            input: self.input.clone(),
            vocab: self.vocab,
            classes: Some(self.probe()?.classes),
            labels_per_sample: self.probe()?.labels_per_sample,
        })
    }

    fn engine(
        &self,
        optimizer: &OptimizerSpec,
        device: &str,
        seed: u64,
    ) -> flotilla_train::Result<Box<dyn Engine>> {
        Ok(Box::new(ModuleEngine::seeded(
            &self.build,
            seed,
            optimizer,
            device,
        )?))
    }

    fn grouped_engine(
        &self,
        optimizer: &OptimizerSpec,
        (device, seed): (&str, u64),
        group_bytes: usize,
        sink: Option<&mut dyn ShardSink>,
    ) -> Option<flotilla_train::Result<Box<dyn Engine>>> {
        let _ = group_bytes; // the stage modules are the groups
        if self.stages.is_empty() {
            return None;
        }
        let Some(shape) = Shape::of_sample(&self.input) else {
            let why = format!(
                "`{}` takes samples of shape {:?}; run as its stage modules (ZeRO-3, \
                 recomputation), a module takes [c, h, w] or [f]",
                self.name, self.input
            );
            return Some(Err(TrainError::config("model", why)));
        };
        let blocks = (self.stages.as_slice(), shape);
        let engine = match sink {
            Some(sink) => {
                ModuleEngine::released(&self.build, blocks, optimizer, (device, seed), sink)
            }
            None => ModuleEngine::seeded(&self.build, seed, optimizer, device)
                .and_then(|e| e.with_blocks(blocks)),
        };
        Some(
            engine
                .map(|e| Box::new(e) as Box<dyn Engine>)
                .map_err(Into::into),
        )
    }

    fn stages(&self) -> Option<StageMaker> {
        if self.stages.is_empty() {
            return None;
        }
        let (stages, vocab) = (self.stages.clone(), self.vocab);
        let shape = Shape::of_sample(&self.input);
        let refusal = format!(
            "`{}` takes samples of shape {:?}; a pipeline's input is [c, h, w] or [f]",
            self.name, self.input
        );
        Some(Arc::new(move |index, optimizer, device, seed| {
            let shape = shape.ok_or_else(|| TrainError::config("model", refusal.clone()))?;
            let input = StageInput { shape, vocab };
            let built = module_pipeline(&stages, input, index, optimizer, device, seed);
            Ok(built?)
        }))
    }
}

/// Trains `model` as this process's rank of the job it was started in (`flotilla launch -n
/// N -- PROGRAM`, torchrun, mpirun, Slurm): the settings of the environment in the one
/// schema a config job reads ([`flotilla_train::program::settings`]: the launcher's
/// variables, `FLOTILLA_<SECTION>__<FIELD>`, the file `FLOTILLA_CONFIG` names), then the
/// run a config job's rank makes ([`flotilla_rank::run`]): the configured way of training,
/// data, optimizer and schedule, checkpoints and resume, telemetry and rank 0's report.
pub fn train<M: TrainModule, F: Fn(&Device) -> M>(model: &UserModule<F>) -> Result<RunSummary> {
    let config = flotilla_train::program::settings()?;
    let rank = flotilla_train::program::launcher_rank()?;
    flotilla_rank::run(&config, model, rank).map_err(DistError::from)
}

/// The run [`train`] makes, for the caller's own loop: this process's rank of the job it
/// was started in, set up and started, to be stepped until the run ends —
///
/// ```no_run
/// # fn demo<M: flotilla_burn::TrainModule, F: Fn(&burn::prelude::Device) -> M>(
/// #     model: &flotilla_burn::UserModule<F>) -> anyhow::Result<()> {
/// let mut run = flotilla_burn::session(model)?;
/// while let Some(p) = run.step()? {
///     if p.loss.is_some_and(|l| l < 0.05) {
///         run.stop("the loss is low enough")?; // every all-reduce peer sees the same loss
///     }
/// }
/// let summary = run.finish()?;
/// # Ok(()) }
/// ```
///
/// Every way of training, setting, checkpoint and report of [`train`] is there; between
/// steps the loop may evaluate ([`Session::evaluate`]), write a checkpoint
/// ([`Session::checkpoint`]) or stop ([`Session::stop`]), each on every rank after the same
/// step for the collective ways of training.
pub fn session<M: TrainModule, F: Fn(&Device) -> M>(model: &UserModule<F>) -> Result<Session> {
    let config = flotilla_train::program::settings()?;
    let rank = flotilla_train::program::launcher_rank()?;
    Session::start(&config, model, None, rank).map_err(DistError::from)
}

/// [`session`] on the program's own data instead of what `data.path` names: `train` to
/// draw the batches from (each rank its shard of each epoch's shuffle, as for a config
/// job's data), `test` to evaluate on. Every rank gives the same samples; they are checked
/// against the model as a config job's data is ([`JobData::given`]).
pub fn session_with_data<M: TrainModule, F: Fn(&Device) -> M>(
    model: &UserModule<F>,
    train: Arc<dyn Samples>,
    test: Box<dyn Samples>,
) -> Result<Session> {
    let config = flotilla_train::program::settings()?;
    let rank = flotilla_train::program::launcher_rank()?;
    let data = JobData::given(&config, model, train, test)?;
    Session::start(&config, model, Some(data), rank).map_err(DistError::from)
}

/// [`session`] for the job's YAML model (`model:` of its settings, a spec of `models/` or
/// a file) instead of a module of the program's: the model `flotilla train` would train,
/// in the caller's own loop.
pub fn spec_session() -> Result<Session> {
    let config = flotilla_train::program::settings()?;
    let spec = config.validate()?;
    let rank = flotilla_train::program::launcher_rank()?;
    Session::start(&config, &spec, None, rank).map_err(DistError::from)
}

#[cfg(test)]
mod tests {
    use burn::nn::{Linear, LinearConfig};

    use super::*;

    /// A linear classifier of `[4]` inputs into 3 classes.
    #[derive(Module, Debug)]
    struct Tiny {
        fc: Linear,
    }

    impl TrainModule for Tiny {
        fn loss(&self, batch: flotilla_engine::BatchRef<'_>, device: &Device) -> Tensor<1> {
            self.logits(batch.images, batch.labels.len(), device).sum()
        }

        fn logits(&self, inputs: &[f32], n: usize, device: &Device) -> Tensor<2> {
            let x = burn::tensor::TensorData::new(inputs.to_vec(), [n, 4]);
            self.fc.forward(Tensor::from_data(x, device))
        }
    }

    /// A user's module says what the data checks need: its classes (from its logits), its
    /// labels per sample and its parameters (in the fingerprint the ranks agree on).
    #[test]
    fn a_users_module_says_its_classes_and_parameters() {
        let _seed = crate::SEED_LOCK.lock().unwrap_or_else(|p| p.into_inner());
        let m = UserModule::new("tiny", &[4], |d| Tiny {
            fc: LinearConfig::new(4, 3).init(d),
        });
        let io = m.io().expect("io");
        assert_eq!((io.classes, io.labels_per_sample), (Some(3), 1));
        let fingerprint = m.fingerprint().expect("fingerprint");
        assert!(fingerprint.contains("fc.weight[4, 3]"), "{fingerprint}");
    }
}
