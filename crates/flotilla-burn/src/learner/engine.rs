//! [`LearnerEngine`]: burn-train's `Learner` as the one stack's [`Engine`], so that every way
//! of training written against the engine (async all-reduce, parameter-server workers, model
//! averaging) trains a `Learner`'s model: a batch is a list of sample indices (the run's data
//! are the training set's indices, see [`super::source::IndexSamples`]), turned into the
//! `Learner`'s input by the user's batcher; forward and backward are the `Learner`'s
//! `train_step`; an optimizer step is the `Learner`'s own (its scheduler and optimizer).

use std::cell::RefCell;
use std::ops::Range;
use std::path::Path;
use std::rc::Rc;
use std::sync::Arc;

use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::train::metric::store::EventStoreClient;
use burn::train::{Learner, LearnerModel, TrainStep};
use flotilla_engine::collective::Reducer;
use flotilla_engine::{
    BatchRef, Engine, EngineError, EvalStats, ModelState, ParamLayout, ParamPlacement, any_module,
};

use super::global_output::GlobalOutput;

/// Makes the `Learner`'s input of the samples with these indices, on this device.
pub(crate) type BatchMaker<I> = Arc<dyn Fn(&[usize], &Device) -> Result<I, String> + Send + Sync>;

/// What the engine and the strategy's loop share: the `Learner`, and the outputs of the
/// training steps since the loop last took them (for the metrics; a model-averaging worker
/// takes several steps per round).
pub(crate) struct Shared<M: LearnerModel> {
    pub(crate) learner: Learner<M>,
    pub(crate) outputs: Vec<<M as TrainStep>::Output>,
    /// The training's event store, which reading the `Learner`'s optimizer state takes
    /// ([`super::state`]).
    pub(crate) store: Arc<EventStoreClient>,
}

/// The `Learner` as an [`Engine`] (see the module docs).
pub(crate) struct LearnerEngine<M: LearnerModel> {
    shared: Rc<RefCell<Shared<M>>>,
    make: BatchMaker<<M as TrainStep>::Input>,
    device: Device,
    layout: ParamLayout,
    buffers: ParamLayout,
    /// The last backward's gradients, flat (layout order); `None`: none kept.
    grads: Option<Vec<f32>>,
}

fn failed(what: &str, e: impl std::fmt::Display) -> EngineError {
    EngineError::Callback(format!("{what}: {e}"))
}

impl<M> LearnerEngine<M>
where
    M: LearnerModel,
    <M as TrainStep>::Output: GlobalOutput,
{
    pub(crate) fn new(
        shared: Rc<RefCell<Shared<M>>>,
        make: BatchMaker<<M as TrainStep>::Input>,
        device: Device,
    ) -> Self {
        let model = shared.borrow().learner.model();
        Self {
            layout: ParamLayout::of(&model),
            buffers: any_module::buffer_layout(&model),
            shared,
            make,
            device,
            grads: None,
        }
    }

    fn model(&self) -> M {
        self.shared.borrow().learner.model()
    }

    fn set_model(&mut self, model: M) {
        self.shared
            .borrow_mut()
            .learner
            .load_model(model.into_record());
    }
}

impl<M> ModelState for LearnerEngine<M>
where
    M: LearnerModel,
    <M as TrainStep>::Output: GlobalOutput,
{
    fn layout(&self) -> &ParamLayout {
        &self.layout
    }

    fn read_params(&self, out: &mut [f32]) -> flotilla_engine::Result<()> {
        any_module::read_params(&self.model(), &self.layout, out)
    }

    fn write_params(&mut self, src: &[f32]) -> flotilla_engine::Result<()> {
        let model = any_module::write_params(self.model(), &self.layout, src)?;
        self.set_model(model);
        Ok(())
    }

    /// The `Learner`'s optimizer and learning-rate scheduler state, keyed by parameter
    /// position ([`super::state`]): what the run gives every member at a start (a joiner's
    /// too) and writes in its checkpoints.
    fn optimizer_state(&self) -> flotilla_engine::Result<Vec<u8>> {
        let shared = self.shared.borrow();
        super::state::export(&shared.learner, &shared.store)
            .map_err(|e| EngineError::Optimizer(format!("the Learner's state: {e}")))
    }

    fn load_optimizer_state(&mut self, bytes: &[u8]) -> flotilla_engine::Result<()> {
        let mut shared = self.shared.borrow_mut();
        super::state::import(&mut shared.learner, bytes)
            .map_err(|e| EngineError::Optimizer(format!("loading the Learner's state: {e}")))
    }

    fn save_weights(&self, path: &Path) -> flotilla_engine::Result<()> {
        any_module::save_module(&self.model(), path, &[])
    }

    fn load_weights(&mut self, path: &Path) -> flotilla_engine::Result<()> {
        let model = any_module::load_module(&self.model(), path)?;
        self.set_model(model);
        Ok(())
    }

    fn weights_bytes(&self) -> flotilla_engine::Result<Vec<u8>> {
        any_module::module_bytes(&self.model(), &[])
    }

    fn load_weights_bytes(&mut self, bytes: &[u8]) -> flotilla_engine::Result<()> {
        let model = any_module::load_module_bytes(&self.model(), bytes)?;
        self.set_model(model);
        Ok(())
    }

    fn param_placement(&self) -> flotilla_engine::Result<Option<ParamPlacement>> {
        Ok(None)
    }

    fn buffer_layout(&self) -> &ParamLayout {
        &self.buffers
    }

    fn read_buffers(&self, out: &mut [f32]) -> flotilla_engine::Result<()> {
        any_module::read_buffers(&self.model(), &self.buffers, out)
    }

    fn write_buffers(&mut self, src: &[f32]) -> flotilla_engine::Result<()> {
        let model = any_module::write_buffers(self.model(), &self.buffers, src)?;
        self.set_model(model);
        Ok(())
    }
}

impl<M> Engine for LearnerEngine<M>
where
    M: LearnerModel,
    <M as TrainStep>::Output: GlobalOutput,
{
    /// The batch's "inputs" are sample indices (as `f32` integers); its labels are unused
    /// (the `Learner`'s batcher makes the targets).
    fn forward_backward(&mut self, batch: BatchRef<'_>) -> flotilla_engine::Result<f32> {
        let indices: Vec<usize> = batch.images.iter().map(|i| *i as usize).collect();
        let input = (self.make)(&indices, &self.device).map_err(|e| failed("a batch", e))?;
        let out = self.shared.borrow().learner.train_step(input);
        let model = self.model();
        let mut flat = vec![0.0f32; self.layout.total];
        let mut grads = out.grads;
        let all = 0..self.layout.params.len();
        any_module::take_grads(&model, &mut grads, &self.layout, all, &mut flat)?;
        let loss = out.item.loss_value();
        self.grads = Some(flat);
        self.shared.borrow_mut().outputs.push(out.item);
        Ok(loss)
    }

    fn labels_per_sample(&self) -> usize {
        1
    }

    /// Nothing: the `Learner`'s model draws its dropout masks from the device's generator,
    /// as on one device.
    fn set_dropout_seed(&mut self, _seed: u64) {}

    fn set_batch_norm_sync(
        &mut self,
        reducer: Option<Arc<dyn Reducer>>,
    ) -> flotilla_engine::Result<()> {
        match reducer {
            None => Ok(()),
            Some(_) => Err(EngineError::BatchNormSync(
                "a Learner's model synchronizes its own batch norms \
                 (flotilla_burn::SyncBatchNorm in its forward)"
                    .into(),
            )),
        }
    }

    fn for_each_grad(
        &self,
        f: &mut dyn FnMut(usize, &[f32]) -> flotilla_engine::Result<()>,
    ) -> flotilla_engine::Result<()> {
        let grads = self.grads.as_ref().ok_or(EngineError::NoGradients)?;
        for (i, p) in self.layout.params.iter().enumerate() {
            f(i, &grads[p.offset..p.offset + p.len])?;
        }
        Ok(())
    }

    /// The `Learner`'s own step: its scheduler's learning rate (not `lr`: the job's
    /// schedule does not apply to a `Learner`), its optimizer.
    fn apply_grads(&mut self, grads: &[f32], lr: f64) -> flotilla_engine::Result<()> {
        let every = 0..self.layout.params.len();
        self.apply_grads_to(grads, std::slice::from_ref(&every), lr)
    }

    /// The `Learner`'s optimizer steps and keeps state for what it is given gradients of:
    /// ZeRO by whole parameter.
    fn steps_own_optimizer(&self) -> bool {
        true
    }

    /// [`Self::apply_grads`] with the gradients of `params` only: burn's optimizer steps
    /// those, and its scheduler steps once.
    fn apply_grads_to(
        &mut self,
        grads: &[f32],
        params: &[Range<usize>],
        _lr: f64,
    ) -> flotilla_engine::Result<()> {
        let model = self.model();
        let mut given = GradientsParams::new();
        for range in params.iter().filter(|r| !r.is_empty()) {
            let at = |i: usize| self.layout.params.get(i).map(|p| p.offset);
            let start = at(range.start).ok_or(EngineError::NoGradients)?;
            let end = at(range.end).unwrap_or(self.layout.total);
            let span = grads.get(start..end).ok_or(EngineError::FlatLength {
                expected: self.layout.total,
                got: grads.len(),
            })?;
            any_module::put_grads(&model, &mut given, &self.layout, range.clone(), span)?;
        }
        let mut shared = self.shared.borrow_mut();
        shared.learner.lr_step();
        shared.learner.optimizer_step(given);
        self.grads = None;
        Ok(())
    }

    fn optimizer_state_of(&self, params: &[Range<usize>]) -> flotilla_engine::Result<Vec<u8>> {
        let whole = self.optimizer_state()?;
        let keep = |p: u64| params.iter().any(|r| r.contains(&(p as usize)));
        super::state::combine(&[&whole], &keep)
            .map_err(|e| EngineError::Optimizer(format!("the Learner's state: {e}")))
    }

    fn load_optimizer_parts(
        &mut self,
        parts: &[Vec<u8>],
        keep: &[Range<usize>],
    ) -> flotilla_engine::Result<()> {
        let parts: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
        let keep = |p: u64| keep.iter().any(|r| r.contains(&(p as usize)));
        let state = super::state::combine(&parts, &keep)
            .map_err(|e| EngineError::Optimizer(format!("the Learner's state: {e}")))?;
        self.load_optimizer_state(&state)
    }

    fn drop_grads(&mut self) {
        self.grads = None;
    }

    /// Nothing counted: the `Learner` validates (its own loader, metrics and events); the
    /// run's final evaluation finds no samples.
    fn evaluate(&self, _: &[f32], _: &[i64], _: usize) -> flotilla_engine::Result<EvalStats> {
        Ok(EvalStats::default())
    }
}
