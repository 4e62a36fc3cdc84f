//! Balanced splitting of a flat parameter buffer across shard servers.

use std::ops::Range;

/// Splits `0..total` into `parts` contiguous ranges whose lengths differ by at most one;
/// the first `total % parts` ranges get the extra element. The ranges cover `0..total`
/// exactly, in order; when `total < parts` the trailing ones are empty. `parts == 0`
/// yields no ranges.
///
/// ```
/// let r = flotilla_cluster::balanced_ranges(10, 3);
/// assert_eq!(r, vec![0..4, 4..7, 7..10]);
/// ```
pub fn balanced_ranges(total: usize, parts: usize) -> Vec<Range<usize>> {
    if parts == 0 {
        return Vec::new();
    }
    let base = total / parts;
    let extra = total % parts;
    let mut start = 0;
    (0..parts)
        .map(|i| {
            let len = base + usize::from(i < extra);
            let range = start..start + len;
            start += len;
            range
        })
        .collect()
}
