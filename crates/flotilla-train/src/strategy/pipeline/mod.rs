//! Pipeline (model) parallelism: a model's layers cut into stages on different ranks,
//! activations sent forward and gradients backward point to point, micro-batches scheduled
//! by GPipe or 1F1B, and data-parallel replicas of every stage.
//!
//! The engine side (what a stage computes: a spec's layers or a program's stage module) is
//! [`flotilla_engine::StageEngine`]; the cut is [`flotilla_engine::StageCut`]. How stages
//! talk: the tags and payloads of the tensors between stages ([`wire`], over any
//! [`flotilla_tcp::ProcessGroup`]) and the order of the micro-batches ([`schedule`]). This
//! module gives a user the loop ([`Pipeline`]); the CLI's
//! `strategy: pipeline` plans the cut ([`plan()`]), runs each rank as a [`PipelineStage`] of the one
//! run loop and writes the stages' checkpoints ([`state`]).

mod elastic;
mod initial_shard;
mod merged;
pub mod pipe;
pub mod plan;
mod recut;
mod restore;
pub mod schedule;
mod source;
pub mod stage;
pub mod state;
pub mod wire;
mod zero;
mod zero3;

pub use pipe::{Pipeline, PipelineOptions};
pub use plan::{PipelinePlan, plan};
pub(crate) use recut::model_flat_state;
pub use schedule::{Action, Schedule, micro_batches};
pub use stage::PipelineStage;

#[cfg(test)]
mod batch_norm_tests;
#[cfg(test)]
mod seq_tests;
#[cfg(test)]
mod state_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod zero_checkpoint_tests;
#[cfg(test)]
mod zero_tests;
