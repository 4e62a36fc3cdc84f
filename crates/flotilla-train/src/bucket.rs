//! Gradient fusion buckets: consecutive parameters (in flat order) grouped so that each
//! all-reduce moves up to `bucket_bytes`, instead of one all-reduce per tensor.

use flotilla_engine::ParamLayout;

/// A contiguous range of the flat gradient buffer reduced as one all-reduce.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    /// First flat index.
    pub start: usize,
    /// One past the last flat index.
    pub end: usize,
    /// Index of the last parameter tensor in the bucket: when its gradient is in, the bucket
    /// is full and its all-reduce can start.
    pub last_param: usize,
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

/// The buckets of a model, in flat order. Every rank computes the same plan from the same
/// layout, so every rank issues the same all-reduces in the same order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketPlan {
    /// The buckets.
    pub buckets: Vec<Bucket>,
}

impl BucketPlan {
    /// Groups whole parameter tensors into buckets of at most `bucket_bytes` (a tensor larger
    /// than that gets a bucket of its own).
    pub fn new(layout: &ParamLayout, bucket_bytes: usize) -> Self {
        let cap = (bucket_bytes / 4).max(1);
        let mut buckets: Vec<Bucket> = Vec::new();
        for (i, p) in layout.params.iter().enumerate() {
            match buckets.last_mut() {
                Some(b) if b.len() + p.len <= cap => {
                    b.end = p.offset + p.len;
                    b.last_param = i;
                }
                _ => buckets.push(Bucket {
                    start: p.offset,
                    end: p.offset + p.len,
                    last_param: i,
                }),
            }
        }
        Self { buckets }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_engine::ParamInfo;

    fn layout(lens: &[usize]) -> ParamLayout {
        let mut l = ParamLayout::default();
        for (i, &len) in lens.iter().enumerate() {
            l.params.push(ParamInfo {
                name: format!("p{i}"),
                shape: vec![len],
                offset: l.total,
                len,
            });
            l.total += len;
        }
        l
    }

    #[test]
    fn buckets_cover_the_buffer_in_order() {
        let l = layout(&[10, 20, 5, 100, 1, 1]);
        let plan = BucketPlan::new(&l, 30 * 4);
        let ranges: Vec<(usize, usize, usize)> = plan
            .buckets
            .iter()
            .map(|b| (b.start, b.end, b.last_param))
            .collect();
        assert_eq!(
            ranges,
            vec![(0, 30, 1), (30, 35, 2), (35, 135, 3), (135, 137, 5)]
        );
        let one = BucketPlan::new(&l, 1 << 30);
        assert_eq!(one.buckets.len(), 1);
        assert_eq!(one.buckets[0].len(), l.total);
    }
}
