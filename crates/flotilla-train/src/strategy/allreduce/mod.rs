//! Data-parallel strategies: how peers that all hold the model cooperate on one optimizer
//! step. Each is a [`crate::strategy::Strategy`]; it sees the engine only through
//! [`flotilla_engine::Engine`] (flat `f32` buffers) and the other ranks only through a
//! [`flotilla_comm::ProcessGroup`]; it never touches sockets.

mod async_;
mod sync;

#[cfg(test)]
mod async_tests;
#[cfg(test)]
mod sync_tests;

pub use async_::AsyncAllReduce;
pub use sync::SyncAllReduce;

use flotilla_comm::ProcessGroup;
use flotilla_engine::{Engine, ModelState};

use crate::error::Result;
use crate::strategy::Cx;

/// Makes every rank start from rank 0's parameters and optimizer state.
pub fn synchronize_initial_state(comm: &dyn ProcessGroup, engine: &mut dyn Engine) -> Result<()> {
    let rank = comm.rank();
    let mut params = vec![0.0; engine.num_params()];
    engine.read_params(&mut params)?;
    comm.broadcast_f32(&mut params, 0)?;
    let mut state = if rank == 0 {
        engine.optimizer_state()?
    } else {
        Vec::new()
    };
    comm.broadcast_bytes(&mut state, 0)?;
    if rank != 0 {
        engine.write_params(&params)?;
        engine.load_optimizer_state(&state)?;
    }
    Ok(())
}

/// Checks at the end of a run that every peer holds the same parameters as this one's `model`,
/// says so in the log and returns their hash.
fn verify_identical(
    model: &dyn ModelState,
    comm: &dyn ProcessGroup,
    cx: &mut Cx<'_>,
) -> Result<u64> {
    let hash = crate::eval::verify_identical(model, comm)?;
    cx.log(&format!(
        "parameters identical on all {} ranks (xxh3 {hash:016x})",
        comm.size()
    ))?;
    Ok(hash)
}
