//! Pipeline stages: cutting a model into contiguous stages ([`cut`]), measuring what each
//! layer costs ([`profile`]) and choosing where to cut ([`partition`]); a stage of a spec's
//! layers ([`stage`]) or of a user's own modules ([`module_stage`], with their tensors by name,
//! [`named_tensors`]), both run through [`stage_engine`]; and the loss a pipeline's user
//! computes on the last stage's logits ([`loss`]).

pub(crate) mod cut;
pub(crate) mod loss;
pub(crate) mod module_stage;
pub(crate) mod named_tensors;
pub(crate) mod partition;
pub(crate) mod profile;
pub(crate) mod stage;
pub(crate) mod stage_engine;

#[cfg(test)]
mod module_stage_tests;
#[cfg(test)]
mod sharded_stage_tests;
#[cfg(test)]
mod stage_tests;
