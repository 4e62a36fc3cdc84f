//! Gradient fusion buckets: the engine's backward groups (consecutive layers, cut from the
//! last layer backwards at about `bucket_mb` each, see
//! [`flotilla_engine::Engine::backward_groups`]) are the buckets, in the order their
//! gradients become ready — last layers first, as PyTorch DDP's reducer orders them. Each
//! bucket is one all-reduce instead of one per tensor.
//!
//! Invariant: every rank computes the same plan from the same layout and groups, so every
//! rank issues the same all-reduces of the same sizes; the plan is the same whether backward
//! overlaps communication or not, so both reduce the same buffers (and get bitwise the same
//! sums).

use std::ops::Range;

use flotilla_engine::ParamLayout;

use crate::error::{Result, TrainError};

/// A contiguous range of the flat gradient buffer reduced as one all-reduce.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    /// First flat index.
    pub start: usize,
    /// One past the last flat index.
    pub end: usize,
    /// The parameter tensors (indices in the layout) it holds.
    pub params: Range<usize>,
}

impl Bucket {
    /// Number of values.
    pub fn len(&self) -> usize {
        self.end - self.start
    }

    /// Whether the bucket holds nothing.
    pub fn is_empty(&self) -> bool {
        self.start == self.end
    }
}

/// The buckets of a model in the order their gradients become ready.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketPlan {
    /// The buckets.
    pub buckets: Vec<Bucket>,
    /// The bucket of each parameter tensor.
    owner: Vec<usize>,
}

impl BucketPlan {
    /// One bucket per group of parameter indices (`groups` in readiness order; together
    /// they must cover every parameter of `layout` once, each a consecutive range).
    pub fn from_groups(layout: &ParamLayout, groups: &[Range<usize>]) -> Result<Self> {
        let n = layout.params.len();
        let mut owner = vec![usize::MAX; n];
        let mut buckets = Vec::with_capacity(groups.len());
        for (k, g) in groups.iter().enumerate() {
            if g.is_empty() || g.end > n {
                return Err(TrainError::Divergence(format!(
                    "backward group {g:?} is empty or outside the {n} parameters"
                )));
            }
            for o in &mut owner[g.clone()] {
                if *o != usize::MAX {
                    return Err(TrainError::Divergence(format!(
                        "backward groups overlap at {g:?}"
                    )));
                }
                *o = k;
            }
            let first = &layout.params[g.start];
            let last = &layout.params[g.end - 1];
            buckets.push(Bucket {
                start: first.offset,
                end: last.offset + last.len,
                params: g.clone(),
            });
        }
        if let Some(i) = owner.iter().position(|&o| o == usize::MAX) {
            return Err(TrainError::Divergence(format!(
                "parameter {} is in no backward group",
                layout.params[i].name
            )));
        }
        Ok(Self { buckets, owner })
    }

    /// The bucket holding parameter `param`.
    pub fn bucket_of(&self, param: usize) -> usize {
        self.owner[param]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(lens: &[usize]) -> ParamLayout {
        ParamLayout::of_lengths(lens)
    }

    #[test]
    fn buckets_follow_the_groups_last_layers_first() {
        let l = layout(&[10, 20, 5, 100, 1, 1]);
        let plan = BucketPlan::from_groups(&l, &[4..6, 3..4, 0..3]).expect("valid");
        let ranges: Vec<(usize, usize)> = plan.buckets.iter().map(|b| (b.start, b.end)).collect();
        assert_eq!(ranges, vec![(135, 137), (35, 135), (0, 35)]);
        assert_eq!(
            (0..6).map(|i| plan.bucket_of(i)).collect::<Vec<_>>(),
            vec![2, 2, 2, 1, 0, 0]
        );
        let one = BucketPlan::from_groups(&l, std::slice::from_ref(&(0..6))).expect("valid");
        assert_eq!(one.buckets[0].len(), l.total);
    }

    #[test]
    fn groups_that_miss_or_repeat_a_parameter_are_refused() {
        let l = layout(&[1, 2, 3]);
        assert!(BucketPlan::from_groups(&l, std::slice::from_ref(&(0..2))).is_err());
        assert!(BucketPlan::from_groups(&l, &[0..2, 1..3]).is_err());
        assert!(BucketPlan::from_groups(&l, std::slice::from_ref(&(0..4))).is_err());
        assert!(BucketPlan::from_groups(&l, &[0..3, 3..3]).is_err());
    }
}
