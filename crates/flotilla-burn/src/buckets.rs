//! Fusion buckets over a user's parameter list: consecutive parameter tensors, cut from the
//! last tensor backwards at about `bucket_bytes` each (the order in which backward produces
//! gradients, as PyTorch DDP's reducer orders them). Each bucket is one all-reduce instead of
//! one per tensor; every rank computes the same plan from the same (checked) layout.

use std::ops::Range;

use flotilla_engine::ParamLayout;

/// PyTorch DDP's default bucket size (25 MiB).
pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

/// The buckets of `layout`, last parameters first; each a range of parameter indices holding
/// at most `bucket_bytes` of `f32`s unless one tensor alone is larger.
pub fn plan(layout: &ParamLayout, bucket_bytes: usize) -> Vec<Range<usize>> {
    let limit = (bucket_bytes / 4).max(1);
    let mut buckets = Vec::new();
    let mut end = layout.params.len();
    let mut values = 0usize;
    for i in (0..layout.params.len()).rev() {
        let len = layout.params[i].len;
        if values > 0 && values + len > limit {
            buckets.push(i + 1..end);
            end = i + 1;
            values = 0;
        }
        values += len;
    }
    if end > 0 {
        buckets.push(0..end);
    }
    buckets
}

#[cfg(test)]
mod tests {
    use super::plan;
    use flotilla_engine::ParamLayout;

    fn layout(lens: &[usize]) -> ParamLayout {
        ParamLayout::of_lengths(lens)
    }

    #[test]
    fn cuts_from_the_last_tensor_backwards() {
        // 4 bytes per value: a 40-byte bucket holds 10 values.
        assert_eq!(plan(&layout(&[4, 4, 4, 4]), 40), vec![2..4, 0..2]);
        assert_eq!(plan(&layout(&[30, 2, 3]), 40), vec![1..3, 0..1]);
        assert_eq!(plan(&layout(&[3, 3]), 1 << 20), vec![0..2]);
        assert_eq!(plan(&layout(&[]), 40), Vec::<std::ops::Range<usize>>::new());
    }
}
