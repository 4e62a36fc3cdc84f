//! Fusion: the tensors ready in a cycle, in id order, packed into buffers of at most
//! `all_reduce_buffer_size` bytes, one all-reduce per buffer.

use std::ops::Range;

/// Groups consecutive tensors of `lens` values into buffers of at most `cap_bytes` (a tensor
/// larger than that is a buffer of its own; `cap_bytes == 0` means no fusion: one buffer per
/// tensor). Returns the index ranges into `lens`, in order.
pub fn pack(lens: &[usize], cap_bytes: usize) -> Vec<Range<usize>> {
    let cap = cap_bytes / 4;
    let mut out: Vec<Range<usize>> = Vec::new();
    let mut filled = 0;
    for (i, &len) in lens.iter().enumerate() {
        match out.last_mut() {
            Some(r) if cap > 0 && filled + len <= cap => {
                r.end = i + 1;
                filled += len;
            }
            _ => {
                out.push(i..i + 1);
                filled = len;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packs_in_order_up_to_the_cap() {
        assert_eq!(
            pack(&[10, 20, 5, 100, 1, 1], 30 * 4),
            vec![0..2, 2..3, 3..4, 4..6]
        );
        assert_eq!(pack(&[10, 20, 5], 0), vec![0..1, 1..2, 2..3]);
        assert_eq!(pack(&[10, 20, 5], 1 << 30), vec![0..3]);
        assert!(pack(&[], 100).is_empty());
    }
}
