//! Pipeline parallelism over the user's own burn modules: one module per stage, the GPipe and
//! 1F1B schedules of `flotilla train`'s pipelines, and data-parallel replicas of every stage.
//!
//! A user writes each stage as a burn module implementing [`PipelineStage`]: a forward over
//! named [`Tensors`] and the names it takes and gives. Names let any tensor travel between
//! stages: an output goes straight to every later stage that takes that name (a skip tensor
//! from stage 0 to stage 2 does not pass through stage 1), from the nearest earlier stage that
//! gives it. The last stage gives its loss under [`LOSS`] (and may give more,
//! such as a count of correct predictions, which [`Pipeline::evaluate`] hands back). The loop stays as plain as
//! PyTorch's pipelining API:
//!
//! ```no_run
//! # use burn::prelude::*;
//! # use burn::nn::{Linear, LinearConfig};
//! # use burn::optim::SgdConfig;
//! # use flotilla_burn::{Pipeline, PipelineOptions, PipelineStage, Tensors, LOSS};
//! #[derive(Module, Debug)]
//! struct Front { fc: Linear }
//! impl PipelineStage for Front {
//!     fn inputs(&self) -> Vec<String> { vec!["x".into()] }
//!     fn outputs(&self) -> Vec<String> { vec!["h".into()] }
//!     fn forward(&self, mut t: Tensors) -> flotilla_burn::Result<Tensors> {
//!         Ok(Tensors::new().with("h", self.fc.forward(t.take::<2>("x")?)))
//!     }
//! }
//! #[derive(Module, Debug)]
//! struct Back { fc: Linear }
//! impl PipelineStage for Back {
//!     fn inputs(&self) -> Vec<String> { vec!["h".into()] }
//!     fn outputs(&self) -> Vec<String> { vec![LOSS.into()] }
//!     fn forward(&self, mut t: Tensors) -> flotilla_burn::Result<Tensors> {
//!         let y = self.fc.forward(t.take::<2>("h")?);
//!         let loss = (y - t.take::<2>("y")?).powf_scalar(2.0).mean();
//!         Ok(Tensors::new().with(LOSS, loss))
//!     }
//! }
//! # fn batch(replica: usize, step: usize) -> (Tensor<2>, Tensor<2>) { unimplemented!() }
//! fn train<M: PipelineStage>(pipe: &mut Pipeline, stage: M) -> flotilla_burn::Result<M> {
//!     let mut stage = pipe.broadcast_model(stage)?;
//!     let mut optim = pipe.broadcast_optimizer(SgdConfig::new().init())?;
//!     for step in 0..100 {
//!         let (x, y) = batch(pipe.replica(), step); // this replica's shard
//!         let out = pipe.step(&stage, Tensors::new().with("x", x), Tensors::new().with("y", y))?;
//!         stage = optim.step(0.1, stage, out.grads);
//!     }
//!     Ok(stage)
//! }
//! let group = flotilla_burn::init()?;
//! let device = Device::default().autodiff();
//! let options = PipelineOptions::new(2, 4); // 2 stages, 4 micro-batches, 1F1B
//! match options.place(group.as_ref())?.stage {
//!     0 => {
//!         let front = Front { fc: LinearConfig::new(4, 8).init(&device) };
//!         let mut pipe = Pipeline::new(group, &front, &device, options)?;
//!         train(&mut pipe, front)?;
//!     }
//!     _ => {
//!         let back = Back { fc: LinearConfig::new(8, 1).init(&device) };
//!         let mut pipe = Pipeline::new(group, &back, &device, options)?;
//!         train(&mut pipe, back)?;
//!     }
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod options;
mod pipe;
mod routes;
mod tensors;

use burn::module::Module;

pub use options::{PipelineOptions, Place};
pub use pipe::{Pipeline, StepOutput};
pub use routes::LOSS;
pub use tensors::Tensors;

use crate::error::Result;

/// One stage of a pipeline: the user's burn module for the layers it runs.
pub trait PipelineStage: Module {
    /// The names of the tensors [`PipelineStage::forward`] takes: on the first stage, from
    /// the batch given to [`Pipeline::step`]; on later stages, from earlier stages' outputs
    /// (the last stage also gets the targets, under their own names, undeclared).
    fn inputs(&self) -> Vec<String>;

    /// The names of the tensors [`PipelineStage::forward`] gives, each taken by a later
    /// stage; the last stage gives [`LOSS`] and may give more (handed back by
    /// [`Pipeline::evaluate`], not sent anywhere).
    fn outputs(&self) -> Vec<String>;

    /// Runs the stage on one micro-batch: every tensor batch-first, float tensors to cross
    /// stages (integers, such as token ids or labels, may be read from the batch or targets).
    /// The last stage's loss is the mean over the micro-batch's samples.
    fn forward(&self, inputs: Tensors) -> Result<Tensors>;
}
