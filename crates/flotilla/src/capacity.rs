//! What this machine can run: a local job larger than that is refused before any rank starts
//! (`flotilla launch -n 100000` once started thousands of processes and took the launcher
//! down). `--oversubscribe` lifts the limits.
//!
//! - **Cores**: at most [`RANKS_PER_CORE`] ranks per core (`std::thread::available_parallelism`,
//!   which honours CPU affinity and cgroup quotas).
//! - **Memory**: the ranks' estimated footprint must fit in `MemAvailable` (`/proc/meminfo`;
//!   no check where it cannot be read). A rank holds its data set as `f32` (four bytes per
//!   byte of the IDX files) plus [`RANK_BASE_BYTES`] for the runtime, model, gradients and
//!   buffers; a LeNet-5 rank on MNIST measured 240 MB resident against 316 MB estimated.

use std::path::Path;

use anyhow::{Result, bail};

/// Most ranks per core a local launch starts without `--oversubscribe`.
pub const RANKS_PER_CORE: usize = 8;

/// A rank's footprint besides its data set.
pub const RANK_BASE_BYTES: u64 = 96 << 20;

/// Bytes one rank is expected to hold, from the size of the files in its data directory.
pub fn rank_footprint(data_dir: &Path) -> u64 {
    // A text data set is one file.
    let file = std::fs::metadata(data_dir).ok().filter(|m| m.is_file());
    let data: u64 = file.map(|m| m.len()).unwrap_or_else(|| {
        std::fs::read_dir(data_dir)
            .map(|entries| {
                entries
                    .filter_map(|e| e.ok()?.metadata().ok())
                    .filter(|m| m.is_file())
                    .map(|m| m.len())
                    .sum()
            })
            .unwrap_or(0)
    });
    RANK_BASE_BYTES + 4 * data
}

/// `MemAvailable` of `/proc/meminfo`, in bytes.
pub fn memory_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Refuses `n` local ranks of `footprint` bytes each on a machine of `cores` cores and
/// `available` bytes of memory, naming the limit and the way past it.
pub fn check(n: usize, cores: usize, footprint: u64, available: Option<u64>) -> Result<()> {
    let max_ranks = RANKS_PER_CORE * cores.max(1);
    if n > max_ranks {
        bail!(
            "{n} local ranks is more than this machine runs: at most {RANKS_PER_CORE} ranks per \
             core ({cores} cores: {max_ranks} ranks). Use fewer ranks (-n), spread them over \
             hosts (--inventory), or pass --oversubscribe to start them anyway"
        );
    }
    if let Some(available) = available {
        let needed = footprint.saturating_mul(n as u64);
        if needed > available {
            bail!(
                "{n} local ranks need about {} of memory ({} each: the data set as f32 and \
                 {} for the rest) but {} is available. Use fewer ranks (-n), spread them over \
                 hosts (--inventory), or pass --oversubscribe to start them anyway",
                mib(needed),
                mib(footprint),
                mib(RANK_BASE_BYTES),
                mib(available)
            );
        }
    }
    Ok(())
}

/// Refuses a launch whose ranks' estimated footprint (`footprint` bytes each) is above the
/// memory each may use (`--memory-per-rank`), naming the ranks and the estimate.
pub fn check_limit(n: usize, footprint: u64, limit: bytesize::ByteSize) -> Result<()> {
    if footprint <= limit.as_u64() {
        return Ok(());
    }
    bail!(
        "every rank (0 to {}) is estimated to need about {} ({} for the data set as f32, {} for \
         the rest), above --memory-per-rank {}; no rank was started. Give a larger limit, or \
         drop it",
        n.saturating_sub(1),
        mib(footprint),
        mib(footprint.saturating_sub(RANK_BASE_BYTES)),
        mib(RANK_BASE_BYTES),
        limit.display().iec()
    );
}

/// Checks a local launch of `n` ranks reading `data_dir` against this machine.
pub fn check_local(n: usize, data_dir: &Path) -> Result<()> {
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    check(n, cores, rank_footprint(data_dir), memory_available())
}

fn mib(bytes: u64) -> String {
    format!("{} MiB", bytes >> 20)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_name_the_numbers() {
        assert!(check(16, 2, 300 << 20, Some(24 << 30)).is_ok());
        let cores = check(100_000, 2, 300 << 20, None).map_err(|e| e.to_string());
        assert!(
            cores
                .as_ref()
                .is_err_and(|e| e.contains("at most 8 ranks per core (2 cores: 16 ranks)")),
            "{cores:?}"
        );
        let memory = check(16, 2, 2 << 30, Some(8 << 30)).map_err(|e| e.to_string());
        assert!(
            memory.as_ref().is_err_and(|e| e
                .contains("16 local ranks need about 32768 MiB of memory (2048 MiB each")
                && e.contains("but 8192 MiB is available")),
            "{memory:?}"
        );
    }

    #[test]
    fn the_footprint_counts_the_data_as_f32() -> std::io::Result<()> {
        let dir = tempfile::tempdir()?;
        std::fs::write(dir.path().join("a"), vec![0u8; 1000])?;
        std::fs::write(dir.path().join("b"), vec![0u8; 24])?;
        assert_eq!(rank_footprint(dir.path()), RANK_BASE_BYTES + 4096);
        assert_eq!(rank_footprint(&dir.path().join("none")), RANK_BASE_BYTES);
        Ok(())
    }
}
