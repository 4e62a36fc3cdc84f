//! [`ParamShards`]: ZeRO stage 1 for a burn optimizer, as PyTorch's `ZeroRedundancyOptimizer`
//! does it: the parameters are cut among the ranks, each rank's optimizer steps only its own
//! (so only it holds their optimizer state: one copy of the state over the job, not one per
//! rank), and the stepped parameters go from their owner to every rank.
//!
//! The one stack's ZeRO (`allreduce.zero` of a config job, `flotilla_burn::train`) shards flat
//! buffers under Flotilla's own optimizer; a burn optimizer (a user's own loop, burn's
//! `Learner`) steps whole parameters by id, so the cut here is by whole parameters: ranks
//! own consecutive parameters of about equal size (one tensor larger than the rest stays on
//! one rank).

use std::ops::Range;
use std::sync::Arc;

use burn::module::Module;
use burn::optim::GradientsParams;
use flotilla_engine::{ParamLayout, any_module};
use flotilla_group::ProcessGroup;

use crate::data_parallel::DataParallel;
use crate::error::{DistError, Result};

/// The parameters of a model cut among the ranks for ZeRO stage 1 (see the module docs).
#[derive(Debug, Clone)]
pub struct ParamShards {
    group: Arc<dyn ProcessGroup>,
    layout: ParamLayout,
    /// Rank `r`'s parameters: indices into the layout, consecutive; some may be empty.
    ranges: Vec<Range<usize>>,
}

impl ParamShards {
    /// The cut of `dp`'s model among its ranks: parameter `i` goes to the rank whose equal
    /// share of the values holds the middle of it (so every rank's parameters are consecutive
    /// and about `1/N` of the values, as whole tensors allow).
    pub fn new(dp: &DataParallel) -> Self {
        let layout = dp.layout().clone();
        let ranges = layout.whole_param_cut(dp.size());
        Self {
            group: dp.group().clone(),
            layout,
            ranges,
        }
    }

    /// The parameters rank `rank` steps (indices into the layout, in flat order).
    pub fn range_of(&self, rank: usize) -> Range<usize> {
        self.ranges.get(rank).cloned().unwrap_or(0..0)
    }

    /// This rank's parameters.
    pub fn owned(&self) -> Range<usize> {
        self.range_of(self.group.rank())
    }

    /// Only this rank's parameters' gradients of `grads` (the averaged gradients of every
    /// parameter): what its optimizer steps.
    pub fn own_grads<M: Module>(
        &self,
        mut grads: GradientsParams,
        model: &M,
    ) -> Result<GradientsParams> {
        let owned = self.owned();
        let mut values = vec![0.0f32; self.values_in(&owned)];
        any_module::take_grads(model, &mut grads, &self.layout, owned.clone(), &mut values)?;
        let mut mine = GradientsParams::new();
        any_module::put_grads(model, &mut mine, &self.layout, owned, &values)?;
        Ok(mine)
    }

    /// `model` with every parameter as its owner stepped it (bitwise): each rank's own
    /// parameters are gathered to every rank. Collective.
    pub fn gather<M: Module>(&self, model: M) -> Result<M> {
        let mut flat = vec![0.0f32; self.layout.total];
        any_module::read_params(&model, &self.layout, &mut flat)?;
        let mine = self.span(&self.owned());
        let bytes: Vec<u8> = flat[mine].iter().flat_map(|v| v.to_le_bytes()).collect();
        let all = self.group.all_gather_bytes(&bytes)?;
        for (rank, got) in all.iter().enumerate() {
            let span = self.span(&self.range_of(rank));
            if got.len() != span.len() * 4 {
                return Err(DistError::ModelsDiffer(format!(
                    "rank {rank} sent {} bytes of its parameters, its part holds {} values",
                    got.len(),
                    span.len()
                )));
            }
            for (v, b) in flat[span].iter_mut().zip(got.chunks_exact(4)) {
                *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        Ok(any_module::write_params(model, &self.layout, &flat)?)
    }

    /// The flat values of the parameters `params`.
    fn span(&self, params: &Range<usize>) -> Range<usize> {
        match (
            self.layout.params.get(params.start),
            params
                .end
                .checked_sub(1)
                .and_then(|i| self.layout.params.get(i)),
        ) {
            (Some(first), Some(last)) if !params.is_empty() => first.offset..last.offset + last.len,
            _ => 0..0,
        }
    }

    fn values_in(&self, params: &Range<usize>) -> usize {
        self.span(params).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cut_gives_every_parameter_to_one_rank_in_consecutive_parts_of_about_equal_size() {
        // burn's guide MNIST model: one tensor holds 99 % of the values.
        let guide = ParamLayout::of_lengths(&[72, 8, 1152, 16, 524_288, 512, 5120, 10]);
        assert_eq!(guide.whole_param_cut(2), vec![0..5, 5..8]);
        let even = ParamLayout::of_lengths(&[10; 8]);
        assert_eq!(even.whole_param_cut(4), vec![0..2, 2..4, 4..6, 6..8]);
        // More ranks than parameters: some own none, every parameter is owned once.
        let few = ParamLayout::of_lengths(&[5, 5]);
        let parts = few.whole_param_cut(3);
        assert_eq!(parts.iter().map(|r| r.len()).sum::<usize>(), 2);
        assert!(
            parts.windows(2).all(|w| w[0].end == w[1].start),
            "{parts:?}"
        );
    }
}
