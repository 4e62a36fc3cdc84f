//! How the stages of a pipeline talk, whatever computes them (a spec model's stage in
//! `flotilla-train`, a user's burn module in `flotilla-burn`): the order in which a stage runs
//! its micro-batches' forward and backward passes ([`schedule`]: GPipe, 1F1B) and the tags
//! and payloads of the activations and gradients it sends ([`wire`]).

pub mod schedule;
pub mod wire;

pub use schedule::{Action, Schedule, micro_batches};
