//! All-reduce benchmark over a connected [`ProcessGroup`] (used by `flotilla bench allreduce`).
//!
//! Bandwidths follow the nccl-tests conventions: `algbw = bytes / time` and
//! `busbw = algbw * 2 (n - 1) / n`, in GB/s (10^9 bytes per second). The reported time of a
//! size is the median over iterations of the slowest rank's time.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use crate::error::CommError;
use crate::group::ProcessGroup;

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
}

impl Default for BenchOptions {
    fn default() -> Self {
        Self {
            sizes: default_sizes(),
            warmup: 2,
            iters: 20,
            max_bytes_per_size: 4 << 30,
            use_async: false,
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
        let expected = (n * (n + 1) / 2) as f32;
        for it in 0..opts.warmup + iters {
            buf.fill((comm.rank() + 1) as f32);
            comm.barrier()?;
            let t = Instant::now();
            reduce(&mut buf)?;
            let dt = t.elapsed();
            // The slowest rank's time, gathered as the MPI and Gloo scripts gather theirs.
            // Every rank has left its timed all-reduce before any rank gets here, so the
            // check below never takes a core from a rank still being timed (4 ranks on 2
            // cores share them).
            let slowest = comm.all_gather_u64(dt.as_nanos() as u64)?;
            check_sum(&buf, expected)?;
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

/// Fails unless every element of `buf` equals `expected`.
fn check_sum(buf: &[f32], expected: f32) -> Result<(), CommError> {
    // `all` vectorises; the position is looked for only on a failure.
    if buf.iter().all(|&x| x == expected) {
        return Ok(());
    }
    let i = buf.iter().position(|&x| x != expected).unwrap_or(0);
    Err(CommError::InvalidArgument(format!(
        "benchmark result check failed at element {i}: {} != {expected}",
        buf[i]
    )))
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

/// Formats rows as a fixed-width table.
pub fn format_table(rows: &[BenchRow]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:>10} {:>5} {:>6} {:>12} {:>12} {:>12}",
        "size", "world", "iters", "median", "algbw GB/s", "busbw GB/s"
    );
    for r in rows {
        let _ = writeln!(
            s,
            "{:>10} {:>5} {:>6} {:>9.3} ms {:>12.3} {:>12.3}",
            format_bytes(r.bytes),
            r.world_size,
            r.iters,
            r.median.as_secs_f64() * 1e3,
            r.algbw_gbs,
            r.busbw_gbs
        );
    }
    s
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
}
