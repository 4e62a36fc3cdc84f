//! The all-reduce benchmark's loop over any connected [`ProcessGroup`] (the TCP transport,
//! MPI, raw `MPI_Allreduce`; `flotilla bench allreduce`). It is the command's, not the
//! interface's: nothing but the benchmark times collectives this way.
//!
//! Bandwidths follow the nccl-tests conventions: `algbw = bytes / time` and
//! `busbw = algbw * 2 (n - 1) / n`, in GB/s (10^9 bytes per second). The reported time of a
//! size is the median over iterations of the slowest rank's time.

use std::time::{Duration, Instant};

use flotilla_tcp::{CommError, ProcessGroup};

/// One row of benchmark results.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BenchRow {
    /// Buffer size in bytes.
    pub bytes: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// Timed iterations.
    pub iters: usize,
    /// Median time of one all-reduce (slowest rank).
    pub median: Duration,
    /// Algorithm bandwidth in GB/s.
    pub algbw_gbs: f64,
    /// Bus bandwidth in GB/s.
    pub busbw_gbs: f64,
}

/// Benchmark parameters.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Buffer sizes in bytes (rounded down to whole f32s).
    pub sizes: Vec<usize>,
    /// Untimed iterations per size.
    pub warmup: usize,
    /// Timed iterations per size (upper bound, see `max_bytes_per_size`).
    pub iters: usize,
    /// Caps timed iterations so that `iters * bytes` stays below this (at least 3 iterations).
    pub max_bytes_per_size: u64,
    /// Measure [`ProcessGroup::all_reduce_start`] + `wait` instead of the blocking call.
    pub use_async: bool,
    /// Significant bits the wire keeps of each value: 24 for f32, 8 for bf16 (whose
    /// partial sums are rounded before they are sent). The values the result check sums are
    /// integers whose every partial sum fits them, so that the check is exact.
    pub exact_bits: u32,
}

impl Default for BenchOptions {
    fn default() -> Self {
        Self {
            sizes: default_sizes(),
            warmup: 2,
            iters: 20,
            max_bytes_per_size: 4 << 30,
            use_async: false,
            exact_bits: 24,
        }
    }
}

/// 4 KiB, 16 KiB, ..., 256 MiB.
pub fn default_sizes() -> Vec<usize> {
    (0..10)
        .map(|k| 4096usize << (2 * k))
        .take_while(|&b| b <= 256 << 20)
        .collect()
}

/// Runs the all-reduce benchmark. Every rank of the group must call it with the same
/// options. Also checks that each result equals the expected sum.
pub fn run_allreduce(
    comm: &dyn ProcessGroup,
    opts: &BenchOptions,
) -> Result<Vec<BenchRow>, CommError> {
    let use_async = opts.use_async;
    measure_allreduce(comm, opts, &mut |buf: &mut Vec<f32>| {
        if use_async {
            *buf = comm.all_reduce_start(std::mem::take(buf)).wait()?;
            Ok(())
        } else {
            comm.all_reduce_sum(buf)
        }
    })
}

/// The benchmark loop of [`run_allreduce`] around any all-reduce `reduce` of the members of
/// `comm` (which synchronises the iterations and gathers the times): e.g. a raw MPI call to
/// compare with. Each result is checked against the expected sum.
pub fn measure_allreduce(
    comm: &dyn ProcessGroup,
    opts: &BenchOptions,
    reduce: &mut dyn FnMut(&mut Vec<f32>) -> Result<(), CommError>,
) -> Result<Vec<BenchRow>, CommError> {
    let n = comm.size();
    let mut rows = Vec::with_capacity(opts.sizes.len());
    for &size in &opts.sizes {
        let elems = size / 4;
        let bytes = elems * 4;
        let iters = opts
            .iters
            .min((opts.max_bytes_per_size / bytes.max(1) as u64) as usize)
            .max(3);
        let mut buf = vec![0f32; elems];
        let mut times = Vec::with_capacity(iters);
        for it in 0..opts.warmup + iters {
            fill(&mut buf, comm.rank(), n, opts.exact_bits);
            comm.barrier()?;
            let t = Instant::now();
            reduce(&mut buf)?;
            let dt = t.elapsed();
            // The slowest rank's time, gathered as the MPI and Gloo scripts gather theirs.
            // Every rank has left its timed all-reduce before any rank gets here, so the
            // check below never takes a core from a rank still being timed (4 ranks on 2
            // cores share them).
            let slowest = comm.all_gather_u64(dt.as_nanos() as u64)?;
            check_sum(&buf, n, opts.exact_bits)?;
            if it >= opts.warmup {
                times.push(Duration::from_nanos(slowest.into_iter().max().unwrap_or(0)));
            }
        }
        times.sort();
        let median = times[times.len() / 2];
        let secs = median.as_secs_f64().max(1e-12);
        let algbw = bytes as f64 / secs / 1e9;
        let busbw = algbw * 2.0 * (n as f64 - 1.0) / n as f64;
        rows.push(BenchRow {
            bytes,
            world_size: n,
            iters,
            median,
            algbw_gbs: algbw,
            busbw_gbs: busbw,
        });
    }
    Ok(rows)
}

/// The period of the values [`fill`] writes for a world of `n` on a wire that keeps `bits`
/// significant bits: odd, so that it divides no power of two (no chunk boundary of a
/// power-of-two split lines up with it), and small enough that the sum of `n` values stays
/// an integer below `2^bits`, which the wire holds exactly (on a world too large for that,
/// 1: every element the same, rank by rank).
fn period(n: usize, bits: u32) -> usize {
    let n = n.max(1);
    let top = (1usize << bits.min(24)).saturating_sub(n * (n + 1) / 2) / n;
    (top.max(2) - 1) | 1
}

/// Rank `rank` of `n`'s contribution: element `i` is `(i mod p) + rank + 1` (`p` =
/// [`period`]), small integers that differ from element to element and from rank to rank,
/// so that a chunk summed at another offset, or a rank's contribution counted twice and
/// another's left out, gives a different sum.
fn fill(buf: &mut [f32], rank: usize, n: usize, bits: u32) {
    let own = (rank + 1) as f32;
    for chunk in buf.chunks_mut(period(n, bits)) {
        for (j, x) in chunk.iter_mut().enumerate() {
            *x = j as f32 + own;
        }
    }
}

/// Fails unless every element of `buf` is the exact sum of every rank's [`fill`] of a world
/// of `n`: `n (i mod p) + n (n + 1) / 2`.
fn check_sum(buf: &[f32], n: usize, bits: u32) -> Result<(), CommError> {
    let p = period(n, bits);
    let ranks = (n * (n + 1) / 2) as f32;
    let expected = |j: usize| (n * j) as f32 + ranks;
    for (k, chunk) in buf.chunks(p).enumerate() {
        // `all` vectorises; the position is looked for only on a failure.
        if chunk.iter().enumerate().all(|(j, &x)| x == expected(j)) {
            continue;
        }
        let j = chunk
            .iter()
            .enumerate()
            .position(|(j, &x)| x != expected(j))
            .unwrap_or(0);
        return Err(CommError::InvalidArgument(format!(
            "benchmark result check failed at element {}: {} != {}",
            k * p + j,
            chunk[j],
            expected(j)
        )));
    }
    Ok(())
}

/// Human-readable size (B, KiB, MiB, GiB).
pub fn format_bytes(b: usize) -> String {
    match b {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_format() {
        let s = default_sizes();
        assert_eq!(s.first(), Some(&4096));
        assert_eq!(s.last(), Some(&(256 << 20)));
        assert_eq!(format_bytes(64 << 20), "64 MiB");
        assert_eq!(format_bytes(1000), "1000 B");
    }

    /// Every rank's [`fill`] of a world of `n`, summed element by element in rank order.
    fn summed(elems: usize, n: usize, bits: u32) -> Vec<Vec<f32>> {
        (0..n)
            .map(|r| {
                let mut b = vec![0.0; elems];
                fill(&mut b, r, n, bits);
                b
            })
            .collect()
    }

    fn sum(parts: &[Vec<f32>]) -> Vec<f32> {
        let mut out = vec![0.0f32; parts[0].len()];
        for p in parts {
            for (o, x) in out.iter_mut().zip(p) {
                *o += x;
            }
        }
        out
    }

    /// The right sum passes, on worlds of 1 to 9 ranks, on an f32 and a bf16 wire, over
    /// buffers longer than the values' period (which is odd and keeps every sum exact).
    #[test]
    fn the_sum_of_every_ranks_values_passes_and_is_exact() {
        for bits in [24, 8] {
            for n in 1..=9 {
                let p = period(n, bits);
                assert_eq!(p % 2, 1, "{n} ranks, {bits} bits");
                assert!(n * (p - 1) + n * (n + 1) / 2 < 1 << bits, "{n}, {bits}");
                let elems = if bits == 8 { 3 * p + 5 } else { 1000 };
                let parts = summed(elems, n, bits);
                if let Err(e) = check_sum(&sum(&parts), n, bits) {
                    panic!("{n} ranks, {bits} bits: {e}");
                }
            }
        }
    }

    /// What a broken all-reduce leaves fails the check: one rank's chunk summed at the
    /// offset of another chunk (as a ring that misplaces a segment would), and one rank's
    /// values counted twice while another's are left out.
    #[test]
    fn a_chunk_summed_at_another_offset_or_a_rank_counted_twice_fails() {
        let (n, elems) = (3, 999);
        let chunk = elems / n;
        let mut parts = summed(elems, n, 24);
        // Rank 1's chunk 1 lands where its chunk 2 belongs, and the other way round.
        let (a, b) = parts[1].split_at_mut(2 * chunk);
        a[chunk..].swap_with_slice(&mut b[..chunk]);
        let err = check_sum(&sum(&parts), n, 24).expect_err("a misplaced chunk passed");
        assert!(
            err.to_string().contains(&format!("element {chunk}:")),
            "{err}"
        );

        let mut parts = summed(elems, n, 24);
        parts[2] = parts[0].clone();
        assert!(
            check_sum(&sum(&parts), n, 24).is_err(),
            "rank 0 twice passed"
        );
    }
}
