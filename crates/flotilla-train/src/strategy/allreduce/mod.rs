//! Data-parallel strategies: how peers that all hold the model cooperate on one optimizer
//! step. Each is a [`crate::strategy::Strategy`]; it sees the engine only through
//! [`flotilla_engine::Engine`] (flat `f32` buffers) and the other ranks only through a
//! [`flotilla_tcp::ProcessGroup`]; it never touches sockets.

mod async_;
pub(crate) mod clip;
pub mod cycle;
mod scatter;
mod sync;
mod zero;

#[cfg(test)]
mod async_tests;
#[cfg(test)]
mod shard_file_tests;
#[cfg(test)]
mod sync_tests;
#[cfg(test)]
mod zero_batch_norm_tests;
#[cfg(test)]
mod zero_elastic_tests;
#[cfg(test)]
mod zero_reshard_tests;
#[cfg(test)]
mod zero_tests;

pub use async_::AsyncAllReduce;
pub use sync::SyncAllReduce;

use flotilla_engine::{Engine, ModelState};
use flotilla_tcp::ProcessGroup;

use crate::error::Result;
use crate::strategy::Cx;

/// Makes every rank start from rank 0's parameters, buffers and optimizer state.
pub fn synchronize_initial_state(comm: &dyn ProcessGroup, engine: &mut dyn Engine) -> Result<()> {
    synchronize_model(comm, engine)?;
    let rank = comm.rank();
    let mut state = if rank == 0 {
        engine.optimizer_state()?
    } else {
        Vec::new()
    };
    let bound = flotilla_engine::optimizer_state_bound(engine.layout());
    comm.broadcast_bytes(&mut state, 0, bound)?;
    if rank != 0 {
        engine.load_optimizer_state(&state)?;
    }
    Ok(())
}

/// Rank 0's buffers and parameters to every rank (collective): [`synchronize_initial_state`]
/// without the optimizer state, for a ZeRO whose ranks each hold a part of it.
pub(crate) fn synchronize_model(comm: &dyn ProcessGroup, engine: &mut dyn Engine) -> Result<()> {
    let mut buffers = vec![0.0; engine.buffer_layout().total];
    if !buffers.is_empty() {
        engine.read_buffers(&mut buffers)?;
        comm.broadcast_f32(&mut buffers, 0)?;
        engine.write_buffers(&buffers)?;
    }
    let mut params = vec![0.0; engine.num_params()];
    engine.read_params(&mut params)?;
    comm.broadcast_f32(&mut params, 0)?;
    if comm.rank() != 0 {
        engine.write_params(&params)?;
    }
    Ok(())
}

/// Replaces every peer's buffers (batch norm's running statistics, which each rank's forward
/// passes update from its own shard) with their mean over the peers, so that evaluation,
/// the final check and checkpoints see one model. Collective; free without buffers.
pub fn average_buffers(comm: &dyn ProcessGroup, model: &mut dyn ModelState) -> Result<()> {
    let mut buffers = vec![0.0; model.buffer_layout().total];
    if buffers.is_empty() {
        return Ok(());
    }
    model.read_buffers(&mut buffers)?;
    comm.all_reduce_sum(&mut buffers)?;
    let scale = 1.0 / comm.size() as f32;
    buffers.iter_mut().for_each(|v| *v *= scale);
    model.write_buffers(&buffers)?;
    Ok(())
}

/// One step's samples over the `world` ranks and this rank's weight: `data`'s batch is its
/// share of a global batch (an elastic job's members, [`crate::batches::Batches::sliced`]);
/// where the shares differ, each rank's mean gradient and loss are scaled by its share times
/// the ranks, so that their sum over the ranks is the mean over the global batch. 1
/// (untouched, bitwise today's step) where the shares are equal.
pub(crate) fn share_weight(data: &crate::batches::Batches, world: u64) -> (u64, f32) {
    // Samples, not labels: a text window has a label per position.
    let mine = data.batch_size() as u64;
    let samples = data.global_batch().map_or(mine * world, |g| g as u64);
    let weight = if mine * world == samples {
        1.0
    } else {
        (mine * world) as f32 / samples as f32
    };
    (samples, weight)
}

/// The dropout seed of `rank`'s step `step` in a run seeded with `seed`: every rank draws its
/// own masks, and a resumed run draws the ones it would have. (SplitMix64's finaliser over
/// the three, so nearby steps and ranks get unrelated seeds; a hash crate would do the same.)
pub fn dropout_seed(seed: u64, rank: usize, step: u64) -> u64 {
    let mut z = seed
        ^ (rank as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ step.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
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
