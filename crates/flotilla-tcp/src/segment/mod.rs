//! A group's shared-memory segment on its own: the mapping and its layout (`mapping.rs`),
//! its file's name and the sweep of files left by killed creators (`files.rs`), the barrier
//! and abort of its header (`sync.rs`), and the collectives over it (`ops.rs`).
//! It knows nothing of groups or connections: what a wait watches comes in as a [`Watch`];
//! [`crate::shm`] sets segments up for groups and runs their collectives.

mod files;
mod mapping;
mod ops;
mod sync;

pub(crate) use files::{file_name, sweep};
pub(crate) use mapping::{Layout, OpenError, Segment};
pub(crate) use sync::Watch;
