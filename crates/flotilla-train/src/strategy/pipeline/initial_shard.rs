//! A ZeRO-3 pipeline stage's start without its whole parameters: the shard of the initial
//! values a replica keeps as its stage draws them one layer at a time
//! ([`flotilla_engine::Stage::new_released`]), cut as [`super::zero3::ReplicaParams`] cuts
//! its groups (each group's flat values split evenly over the replicas, `shard`). Every
//! replica draws the same values from the run's seed, as one building its stage whole does.

use std::ops::Range;

use flotilla_engine::{EngineError, ParamLayout, ShardSink};

use super::zero3::{group_flat, group_pieces};

/// Replica `rank` of `replicas`' pieces of its stage's initial parameters, filled as they
/// are drawn.
pub(super) struct StageShard {
    replicas: usize,
    rank: usize,
    /// This replica's piece of each group, as flat ranges of the stage, in flat order.
    pieces: Vec<Range<usize>>,
    /// Each parameter's first flat index.
    offsets: Vec<usize>,
    /// The values of the pieces, one after the other.
    values: Vec<f32>,
    /// The flat values drawn so far (they come in flat order).
    drawn: usize,
}

impl StageShard {
    /// Replica `rank` of `replicas`'s, empty until the stage plans.
    pub(super) fn new(replicas: usize, rank: usize) -> Self {
        Self {
            replicas,
            rank,
            pieces: Vec::new(),
            offsets: Vec::new(),
            values: Vec::new(),
            drawn: 0,
        }
    }

    /// The shard's values, once every parameter was drawn.
    pub(super) fn finish(self) -> Result<Vec<f32>, EngineError> {
        let end = self.pieces.last().map_or(0, |p| p.end);
        if self.drawn < end {
            return Err(EngineError::Callback(format!(
                "a ZeRO-3 stage's initial shard: {} of {end} values drawn",
                self.drawn
            )));
        }
        Ok(self.values)
    }
}

impl ShardSink for StageShard {
    fn plan(
        &mut self,
        layout: &ParamLayout,
        groups: &[Range<usize>],
    ) -> flotilla_engine::Result<()> {
        let mut groups: Vec<Range<usize>> = (groups.iter())
            .map(|params| group_flat(layout, params))
            .collect();
        groups.sort_by_key(|g| g.start);
        self.pieces = group_pieces(&groups, self.replicas, self.rank);
        let len = self.pieces.iter().map(|p| p.len()).sum();
        self.values = Vec::with_capacity(len);
        self.offsets = layout.params.iter().map(|p| p.offset).collect();
        Ok(())
    }

    fn values(&mut self, param: usize, values: &[f32]) -> flotilla_engine::Result<()> {
        let start = self.offsets.get(param).copied().ok_or_else(|| {
            EngineError::Callback(format!(
                "initial values of parameter {param}, past the stage's"
            ))
        })?;
        if start != self.drawn {
            return Err(EngineError::Callback(format!(
                "parameter {param}'s initial values start at {start}, {} drawn before",
                self.drawn
            )));
        }
        let end = start + values.len();
        for p in &self.pieces {
            let (a, b) = (p.start.max(start), p.end.min(end));
            if a < b {
                self.values.extend_from_slice(&values[a - start..b - start]);
            }
        }
        self.drawn = end;
        Ok(())
    }
}
