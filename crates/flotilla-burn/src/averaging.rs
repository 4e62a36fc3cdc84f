//! [`ModelAveraging`]: local SGD for a user's own loop. Every rank steps its own optimizer on
//! its own batches; every `every` steps the ranks' parameters (and, if asked, their buffers)
//! are replaced by their mean over the ranks. Each rank keeps its own optimizer state (as
//! PyTorch's post-local SGD does), so between averagings the ranks exchange nothing.

use burn::module::Module;

use crate::data_parallel::{BufferSync, DataParallel};
use crate::error::{DistError, Result};

/// Local SGD with periodic averaging of the parameters; see the module documentation.
#[derive(Debug)]
pub struct ModelAveraging {
    dp: DataParallel,
    every: u64,
    buffers: bool,
    steps: u64,
    flat: Vec<f32>,
}

impl ModelAveraging {
    /// Averages the parameters of the model `dp` was built for every `every` steps (≥ 1; 1 is
    /// synchronous parameter averaging). Start from rank 0's model
    /// ([`DataParallel::broadcast_model`]) so the ranks begin equal.
    pub fn new(dp: DataParallel, every: u64) -> Result<Self> {
        if every == 0 {
            return Err(DistError::Config(
                "model averaging every 0 steps: give at least 1".into(),
            ));
        }
        let n = dp.layout().total;
        Ok(Self {
            dp,
            every,
            buffers: false,
            steps: 0,
            flat: vec![0.0; n],
        })
    }

    /// Also averages the buffers (batch norm's running statistics) at every averaging.
    pub fn with_buffers(mut self, buffers: bool) -> Self {
        self.buffers = buffers;
        self
    }

    /// The data-parallel wrapper underneath (rank, group, buffers, checkpoints).
    pub fn data_parallel(&self) -> &DataParallel {
        &self.dp
    }

    /// The data-parallel wrapper back (to go on synchronously, or to save).
    pub fn into_data_parallel(self) -> DataParallel {
        self.dp
    }

    /// Counts one local optimizer step of `model`; on every `every`-th, returns it averaged
    /// over the ranks ([`ModelAveraging::average`]), else unchanged. Collective on those steps:
    /// every rank calls it after each of its steps.
    pub fn step<M: Module>(&mut self, model: M) -> Result<M> {
        self.steps += 1;
        if self.steps.is_multiple_of(self.every) {
            self.average(model)
        } else {
            Ok(model)
        }
    }

    /// `model` with every parameter (and, [`ModelAveraging::with_buffers`], every buffer)
    /// replaced by its mean over the ranks, parameter ids kept (the optimizer state stays).
    /// Collective; call it at the end before evaluating or saving.
    pub fn average<M: Module>(&mut self, model: M) -> Result<M> {
        let _span = tracing::info_span!(target: "flotilla::burn", "average_params").entered();
        let layout = self.dp.layout();
        flotilla_engine::any_module::read_params(&model, layout, &mut self.flat)?;
        self.dp.group().all_reduce_sum(&mut self.flat)?;
        let scale = 1.0 / self.dp.size() as f32;
        self.flat.iter_mut().for_each(|v| *v *= scale);
        let model = flotilla_engine::any_module::write_params(model, layout, &self.flat)?;
        if self.buffers {
            self.dp.sync_buffers(model, BufferSync::Average)
        } else {
            Ok(model)
        }
    }
}
