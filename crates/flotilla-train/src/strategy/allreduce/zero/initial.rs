//! ZeRO-3's start without the whole model: the shard of the initial parameters a rank keeps
//! as its engine draws them one layer at a time ([`flotilla_engine::BurnEngine::new_released`]),
//! and the check that every rank drew the same model.
//!
//! Every rank draws the whole model's values from the run's seed on the CPU, as an unsharded
//! run's ranks do before rank 0's broadcast, but holds one layer of them at a time and keeps
//! its own pieces only; instead of the broadcast, the ranks compare the hash of every value
//! they drew (the hash [`crate::eval::param_hash`] gives the whole model).

use std::ops::Range;

use flotilla_engine::{EngineError, ParamLayout, ShardPiece, ShardSink, shard_pieces};
use flotilla_tcp::ProcessGroup;

use super::owned_ranges;
use crate::bucket::BucketPlan;
use crate::error::{Result, TrainError};

/// This rank's shard of the initial parameters, filled as they are drawn.
pub struct InitialShard {
    world: usize,
    rank: usize,
    /// Each parameter's first flat index.
    offsets: Vec<usize>,
    /// This rank's pieces, in flat order, and the next one to fill.
    pieces: Vec<ShardPiece>,
    next: usize,
    /// The pieces' values one after the other (the layout of `Zero::params`).
    values: Vec<f32>,
    /// XXH3 of every value drawn, in flat order.
    hasher: xxhash_rust::xxh3::Xxh3,
}

impl InitialShard {
    /// Rank `rank` of `world`'s, empty until the engine plans.
    pub fn new(world: usize, rank: usize) -> Self {
        Self {
            world,
            rank,
            offsets: Vec::new(),
            pieces: Vec::new(),
            next: 0,
            values: Vec::new(),
            hasher: xxhash_rust::xxh3::Xxh3::new(),
        }
    }

    /// The shard's values, once every parameter was drawn, and the hash of the whole model.
    pub fn finish(self) -> Result<(Vec<f32>, u64)> {
        if self.next != self.pieces.len() {
            return Err(TrainError::Divergence(format!(
                "ZeRO-3: {} of this rank's {} initial pieces were drawn",
                self.next,
                self.pieces.len()
            )));
        }
        Ok((self.values, self.hasher.digest()))
    }
}

impl ShardSink for InitialShard {
    fn plan(
        &mut self,
        layout: &ParamLayout,
        groups: &[Range<usize>],
    ) -> flotilla_engine::Result<()> {
        let plan = BucketPlan::from_groups(layout, groups)
            .map_err(|e| EngineError::Callback(e.to_string()))?;
        self.pieces = shard_pieces(layout, &owned_ranges(&plan, self.world, self.rank))?;
        self.values = Vec::with_capacity(self.pieces.iter().map(|p| p.range.len()).sum());
        self.offsets = layout.params.iter().map(|p| p.offset).collect();
        Ok(())
    }

    fn values(&mut self, param: usize, values: &[f32]) -> flotilla_engine::Result<()> {
        let mut bytes = Vec::with_capacity(4 * 4096);
        for chunk in values.chunks(4096) {
            bytes.clear();
            bytes.extend(chunk.iter().flat_map(|v| v.to_le_bytes()));
            self.hasher.update(&bytes);
        }
        let offset = self
            .offsets
            .get(param)
            .copied()
            .ok_or(EngineError::FlatLength {
                expected: self.offsets.len(),
                got: param + 1,
            })?;
        while let Some(piece) = self.pieces.get(self.next).filter(|p| p.param == param) {
            let start = piece.range.start - offset;
            let piece =
                values
                    .get(start..start + piece.range.len())
                    .ok_or(EngineError::FlatLength {
                        expected: start + piece.range.len(),
                        got: values.len(),
                    })?;
            self.values.extend_from_slice(piece);
            self.next += 1;
        }
        Ok(())
    }
}

/// Checks that every rank of `comm` drew the model of hash `mine` (collective); a rank that
/// drew another is named.
pub fn check_same_draw(comm: &dyn ProcessGroup, mine: u64) -> Result<()> {
    match crate::eval::differing_hashes(comm, mine, "drew")? {
        None => Ok(()),
        Some(which) => Err(TrainError::Divergence(format!(
            "ZeRO-3: the ranks drew different initial models from the seed: {which}"
        ))),
    }
}
