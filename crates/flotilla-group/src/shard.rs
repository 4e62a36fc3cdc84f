//! Where a flat buffer splits over a group's ranks: the ring's segments, and which rank owns
//! which one after a reduce-scatter. Defined once here, so that the TCP ring
//! (`flotilla-tcp`), the MPI backend and sharded training (ZeRO) cut the same boundaries.
//!
//! A buffer of `len` values splits into `n` contiguous [`segment`]s whose sizes differ by at
//! most one (the first ones may be shorter). The ring all-reduce reduces segment `s` starting
//! at rank `s` and ending, after `n - 1` additions, at rank `s - 1` (mod `n`), which then holds
//! its full sum: rank `r` owns segment `(r + 1) mod n` ([`shard`]). A reduce-scatter that
//! leaves every rank its [`shard`] therefore sums each value in exactly the order the ring
//! all-reduce does, bit for bit.

use std::ops::Range;

/// Element range of segments `lo..hi` of `n` over `len` elements: the union of those
/// segments (Rabenseifner's halving works on such runs).
pub fn segments(len: usize, n: usize, lo: usize, hi: usize) -> Range<usize> {
    let at = |i: usize| ((i as u128 * len as u128) / n.max(1) as u128) as usize;
    at(lo)..at(hi)
}

/// Element range of segment `i` of `n` over `len` elements.
pub fn segment(len: usize, n: usize, i: usize) -> Range<usize> {
    segments(len, n, i, i + 1)
}

/// The segment that rank `rank` of `n` owns after a reduce-scatter of `len` values, and
/// contributes to an all-gather: segment `(rank + 1) mod n`.
pub fn shard(len: usize, n: usize, rank: usize) -> Range<usize> {
    segment(len, n, (rank + 1) % n.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_cover_the_buffer() {
        for len in [0usize, 1, 2, 7, 13, 1_000_003] {
            for n in 1..=6 {
                let mut next = 0;
                for i in 0..n {
                    let s = segment(len, n, i);
                    assert_eq!(s.start, next);
                    assert!(s.len() <= len / n + 1);
                    next = s.end;
                }
                assert_eq!(next, len);
            }
        }
    }

    #[test]
    fn a_run_of_segments_is_their_union() {
        for len in [0usize, 1, 3, 8, 1001] {
            for n in [1usize, 2, 4, 8] {
                assert_eq!(segments(len, n, 0, n), 0..len);
                for lo in 0..n {
                    for hi in lo + 1..=n {
                        let run = segments(len, n, lo, hi);
                        assert_eq!(run.start, segment(len, n, lo).start);
                        assert_eq!(run.end, segment(len, n, hi - 1).end);
                    }
                }
            }
        }
    }

    #[test]
    fn shards_are_the_segments_one_each() {
        for len in [0usize, 2, 5, 11] {
            for n in 1..=5 {
                let mut owned: Vec<Range<usize>> = (0..n).map(|r| shard(len, n, r)).collect();
                owned.sort_by_key(|r| (r.start, r.end));
                let segments: Vec<Range<usize>> = (0..n).map(|i| segment(len, n, i)).collect();
                let mut sorted = segments.clone();
                sorted.sort_by_key(|r| (r.start, r.end));
                assert_eq!(owned, sorted);
                assert_eq!(shard(len, n, n - 1), segments[0]);
            }
        }
    }
}
