//! [`AsyncAllReduce`]: the engine's asynchronous decentralized data parallelism for a user's
//! own loop. Gradients go by parameter name to the group's background cycle
//! ([`flotilla_group::CycleReducer`], the one `flotilla train`'s async all-reduce runs on), and
//! the optimizer applies the gradient reduced `staleness` steps earlier, so computing step `t`
//! overlaps communicating step `t − staleness`.
//!
//! # The update rule (that of `flotilla-train`'s `strategy/allreduce/async_.rs`)
//!
//! Each [`AsyncAllReduce::step`] submits its gradients, then applies the oldest reduced steps
//! until at most `staleness` are in flight (each averaged over the ranks, applied with the
//! learning rate given to the step that applies it). The first step is synchronous (it applies
//! its own gradient). [`AsyncAllReduce::drain`] applies every step in flight: call it before
//! evaluating or saving, so that every rank holds the same parameters.
//!
//! # Correcting for staleness
//!
//! With [`Correction::Predict`] each step's gradient is computed at the parameters it will be
//! applied to, predicted from the last two updates `Δ_t = w_t − w_{t−1}` and `Δ_{t−1}`:
//! `ŵ = w_t + k·((1 + β)·Δ_t − β·Δ_{t−1})`, with `β` the optimizer's momentum (a first-order
//! `w_t + k·Δ_t` while only one update is known) and `k` the steps still in flight; nothing is
//! predicted right after the start or a drain. [`AsyncAllReduce::gradient_point`] gives that
//! model; the user runs forward and backward on it.

use std::collections::VecDeque;

use burn::module::Module;
use burn::optim::{GradientsParams, ModuleOptimizer};
use flotilla_engine::any_module;
use flotilla_group::{CycleConfig, CycleReducer, CycleStats, Pending, WeightHistory};

use crate::data_parallel::DataParallel;
use crate::error::Result;

/// How gradients computed on parameters `staleness` updates old are corrected.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Correction {
    /// None: the gradient is computed at the current parameters.
    None,
    /// Computed at the parameters predicted for when it is applied (see the module docs).
    Predict {
        /// The optimizer's momentum `β` (SGD's `momentum`, Adam's `beta1`; 0 without).
        momentum: f32,
    },
}

/// The settings of an [`AsyncAllReduce`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AsyncConfig {
    /// Steps whose gradients may still be in flight after a step (0: every step applies its
    /// own gradient, sync all-reduce through the cycle).
    pub staleness: usize,
    /// The staleness correction.
    pub correction: Correction,
    /// The background cycle: period, fusion buffer, stall limits.
    pub cycle: CycleConfig,
}

impl Default for AsyncConfig {
    /// Staleness 1, prediction without momentum, the cycle's defaults (5 ms, 64 MiB fusion).
    fn default() -> Self {
        Self {
            staleness: 1,
            correction: Correction::Predict { momentum: 0.0 },
            cycle: CycleConfig::default(),
        }
    }
}

/// Asynchronous all-reduce of a user's module; see the module documentation.
#[derive(Debug)]
pub struct AsyncAllReduce {
    dp: DataParallel,
    reducer: CycleReducer,
    config: AsyncConfig,
    /// Each step in flight: its gradients' sums, by parameter index.
    in_flight: VecDeque<Vec<Pending<Vec<f32>>>>,
    steps: u64,
    /// This step's gradients, then the averaged gradients applied.
    flat: Vec<f32>,
    /// The parameters of the last updates, for the prediction.
    history: WeightHistory,
}

impl AsyncAllReduce {
    /// Starts the background cycle for `model`, whose parameters (and the optimizer's state)
    /// `dp` has made the same on every rank ([`DataParallel::broadcast_model`]). Collective:
    /// the cycle runs on a group of its own, split from `dp`'s.
    pub fn start<M: Module>(dp: DataParallel, model: &M, config: AsyncConfig) -> Result<Self> {
        let everyone: Vec<usize> = (0..dp.size()).collect();
        let reducer = CycleReducer::start(dp.group().group(&everyone)?, config.cycle)?;
        let n = dp.layout().total;
        let mut this = Self {
            dp,
            reducer,
            config,
            in_flight: VecDeque::new(),
            steps: 0,
            flat: vec![0.0; n],
            history: WeightHistory::new(n),
        };
        this.track(model, false)?;
        Ok(this)
    }

    /// The data-parallel wrapper underneath (rank, group, buffers, checkpoints).
    pub fn data_parallel(&self) -> &DataParallel {
        &self.dp
    }

    /// The model to compute this step's gradient with: `model` itself, or, with
    /// [`Correction::Predict`] and steps in flight, `model` with the predicted parameters
    /// (same parameter ids, so its gradients go to [`AsyncAllReduce::step`] as they are).
    pub fn gradient_point<M: Module>(&mut self, model: &M) -> Result<M> {
        let Correction::Predict { momentum } = self.config.correction else {
            return Ok(model.clone());
        };
        let Some(predicted) = self.history.predict(self.in_flight.len(), momentum) else {
            return Ok(model.clone());
        };
        let layout = self.dp.layout();
        Ok(any_module::write_params(model.clone(), layout, predicted)?)
    }

    /// Submits `grads` (this rank's gradients, computed on [`AsyncAllReduce::gradient_point`])
    /// and applies the oldest reduced steps with `optim` at `lr` until at most `staleness` are
    /// in flight; returns the updated `model`. `model` is the model itself, never the
    /// gradient point (whose parameters are a prediction). Every rank calls it once per step.
    pub fn step<M: Module>(
        &mut self,
        model: M,
        mut grads: GradientsParams,
        optim: &mut ModuleOptimizer,
        lr: f64,
    ) -> Result<M> {
        let layout = self.dp.layout();
        let all = 0..layout.params.len();
        any_module::take_grads(&model, &mut grads, layout, all, &mut self.flat)?;
        let submitted = layout
            .params
            .iter()
            .map(|p| {
                let g = self.flat[p.offset..p.offset + p.len].to_vec();
                self.reducer.submit(&p.name, g)
            })
            .collect();
        self.in_flight.push_back(submitted);
        let keep = if self.steps == 0 {
            0
        } else {
            self.config.staleness
        };
        self.steps += 1;
        let mut model = model;
        while self.in_flight.len() > keep {
            model = self.apply_oldest(model, optim, lr)?;
        }
        Ok(model)
    }

    /// Applies every step in flight with `optim` at `lr`: afterwards every rank holds the
    /// same parameters (evaluate or save then). The next prediction starts afresh.
    pub fn drain<M: Module>(
        &mut self,
        model: M,
        optim: &mut ModuleOptimizer,
        lr: f64,
    ) -> Result<M> {
        let mut model = model;
        while !self.in_flight.is_empty() {
            model = self.apply_oldest(model, optim, lr)?;
        }
        self.track(&model, false)?;
        Ok(model)
    }

    /// Drains (see [`AsyncAllReduce::drain`]) and stops the cycle, collectively; the model,
    /// the data-parallel wrapper back (to save or go on synchronously) and the cycle's figures.
    pub fn finish<M: Module>(
        mut self,
        model: M,
        optim: &mut ModuleOptimizer,
        lr: f64,
    ) -> Result<(M, DataParallel, CycleStats)> {
        let model = self.drain(model, optim, lr)?;
        let stats = self.reducer.shutdown()?;
        Ok((model, self.dp, stats))
    }

    /// Waits for the oldest step in flight, averages it and applies it.
    fn apply_oldest<M: Module>(
        &mut self,
        model: M,
        optim: &mut ModuleOptimizer,
        lr: f64,
    ) -> Result<M> {
        let Some(step) = self.in_flight.pop_front() else {
            return Ok(model);
        };
        let scale = 1.0 / self.dp.size() as f32;
        let layout = self.dp.layout();
        for (info, pending) in layout.params.iter().zip(step) {
            let summed = pending.wait()?;
            // Lengths agree: the cycle refuses a name submitted with different lengths.
            let dst = &mut self.flat[info.offset..info.offset + info.len];
            for (d, s) in dst.iter_mut().zip(&summed) {
                *d = s * scale;
            }
        }
        let mut averaged = GradientsParams::new();
        let all = 0..layout.params.len();
        any_module::put_grads(&model, &mut averaged, layout, all, &self.flat)?;
        let model = optim.step(lr, model, averaged);
        self.track(&model, true)?;
        Ok(model)
    }

    /// Records `model`'s parameters after an update (`moved`) or the start or a drain (not).
    fn track<M: Module>(&mut self, model: &M, moved: bool) -> Result<()> {
        if self.config.correction == Correction::None {
            return Ok(());
        }
        let layout = self.dp.layout();
        self.history
            .record(moved, |buf| any_module::read_params(model, layout, buf))?;
        Ok(())
    }
}
