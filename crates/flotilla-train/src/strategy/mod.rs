//! The ways of training, in one place: the [`Strategy`] interface every way implements
//! ([`interface`]) and the ways themselves — data parallel over an all-reduce, sync or async
//! ([`allreduce`]), parameter servers ([`ps`]) and pipeline stages ([`pipeline`]). The run
//! loop ([`crate::runloop`]) drives any of them the same way.

pub(crate) mod accumulate;
pub mod allreduce;
pub mod context;
pub mod interface;
pub mod pipeline;
pub mod ps;
pub mod registry;
pub mod resume;

pub use context::{Cx, ModelIo, ModelSource, Setup, StageMaker};
pub use interface::{Evaluation, Step, Strategy};
pub use resume::Resume;
