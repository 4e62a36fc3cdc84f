//! `flotilla launch --memory-per-rank SIZE`: each local rank in a memory cgroup of its own
//! (cgroup v1, `memory.limit_in_bytes`, and `memory.memsw.limit_in_bytes` where swap is
//! accounted, so that swap does not stretch the limit), so that one rank cannot take the
//! machine's memory from the others, and a rank the kernel's OOM killer ends at its limit
//! is named as such (its cgroup's `oom_kill` count went up), not as "killed by signal 9".
//!
//! The cgroups live under `/sys/fs/cgroup/memory/flotilla-<launcher pid>/rank-<r>`; a rank
//! enters its own in the forked child before it runs anything (so every page it touches is
//! charged there), a replacement enters its rank's again, and they are removed when the
//! launch ends. Kept here rather than in a crate: the few files of cgroup v1 the launcher
//! writes are not worth a dependency on a cgroup manager (`cgroups-rs` pulls in v2's and
//! systemd's handling, which this machine does not use).

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::sync::{Mutex, OnceLock};

use anyhow::{Context, Result, bail};
use bytesize::ByteSize;

/// Where cgroup v1's memory controller is mounted.
const MEMORY_ROOT: &str = "/sys/fs/cgroup/memory";

/// The launch's limit, once `--memory-per-rank` set it.
static LIMIT: OnceLock<Limit> = OnceLock::new();

/// The job's cgroup, the limit of each rank's, and each rank's OOM kills when it started.
struct Limit {
    dir: PathBuf,
    bytes: u64,
    started: Mutex<HashMap<usize, u64>>,
}

/// The job's memory cgroups while the launch runs; removed when dropped.
pub struct Confinement {
    dir: PathBuf,
}

/// Confines every local rank started from now on to `limit` bytes (see the module).
pub fn confine_ranks(limit: ByteSize) -> Result<Confinement> {
    let root = Path::new(MEMORY_ROOT);
    if !root.join("memory.limit_in_bytes").is_file() {
        bail!(
            "--memory-per-rank needs cgroup v1's memory controller at {MEMORY_ROOT}, which this \
             machine does not have"
        );
    }
    let dir = root.join(format!("flotilla-{}", std::process::id()));
    std::fs::create_dir_all(&dir)
        .with_context(|| format!("--memory-per-rank: creating the cgroup {}", dir.display()))?;
    let limit = Limit {
        dir: dir.clone(),
        bytes: limit.as_u64(),
        started: Mutex::new(HashMap::new()),
    };
    if LIMIT.set(limit).is_err() {
        bail!("--memory-per-rank was set twice in one launch");
    }
    Ok(Confinement { dir })
}

/// `--memory-per-rank` confines the ranks of this host only: refused `on_hosts`.
pub fn refuse_remote(on_hosts: bool) -> Result<()> {
    if on_hosts && limit().is_some() {
        bail!(
            "--memory-per-rank confines the ranks started on this host; with --inventory give \
             each host's limits there"
        );
    }
    Ok(())
}

/// The limit ranks are confined to, if any.
pub fn limit() -> Option<ByteSize> {
    LIMIT.get().map(|l| ByteSize(l.bytes))
}

impl Limit {
    /// Rank `rank`'s cgroup, made with the limit if it is new.
    fn rank_dir(&self, rank: usize) -> Result<PathBuf> {
        let dir = self.dir.join(format!("rank-{rank}"));
        if !dir.is_dir() {
            std::fs::create_dir(&dir).with_context(|| format!("creating {}", dir.display()))?;
            // The swap limit (memory + swap) may not be below the memory limit: memory first.
            write(&dir.join("memory.limit_in_bytes"), self.bytes)?;
            let memsw = dir.join("memory.memsw.limit_in_bytes");
            if memsw.is_file() {
                write(&memsw, self.bytes)?;
            }
        }
        Ok(dir)
    }
}

fn write(file: &Path, value: u64) -> Result<()> {
    std::fs::write(file, value.to_string()).with_context(|| format!("writing {}", file.display()))
}

/// The OOM kills counted in the cgroup `dir` (`oom_kill` of `memory.oom_control`).
fn oom_kills(dir: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(dir.join("memory.oom_control")).ok()?;
    let line = text.lines().find(|l| l.starts_with("oom_kill "))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Makes the process `cmd` starts as rank `rank` enter the rank's cgroup before it runs
/// anything; returns the open `cgroup.procs` file, to keep until the process has started.
pub fn confine_child(cmd: &mut Command, rank: usize) -> Result<Option<File>> {
    let Some(limit) = LIMIT.get() else {
        return Ok(None);
    };
    let dir = limit.rank_dir(rank)?;
    let kills = oom_kills(&dir).unwrap_or(0);
    if let Ok(mut started) = limit.started.lock() {
        started.insert(rank, kills);
    }
    let procs = dir.join("cgroup.procs");
    let file = OpenOptions::new()
        .write(true)
        .open(&procs)
        .with_context(|| format!("opening {}", procs.display()))?;
    enter_before_exec(cmd, &file);
    Ok(Some(file))
}

/// Writes the child's pid into `procs` (a cgroup's `cgroup.procs`) before it execs.
fn enter_before_exec(cmd: &mut Command, procs: &File) {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    let fd = procs.as_raw_fd();
    // SAFETY: runs in the forked child before exec, where only async-signal-safe calls are
    // allowed: getpid and write(2) on a descriptor opened before the fork (it stays open in
    // the child until exec, and the parent keeps the file until the child has started), with
    // the pid's digits formatted into a stack buffer; nothing allocates.
    unsafe {
        cmd.pre_exec(move || {
            let mut digits = [0u8; 20];
            let mut at = digits.len();
            let mut pid = libc::getpid() as u64;
            loop {
                at -= 1;
                digits[at] = b'0' + (pid % 10) as u8;
                pid /= 10;
                if pid == 0 {
                    break;
                }
            }
            let len = digits.len() - at;
            let wrote = libc::write(fd, digits[at..].as_ptr().cast(), len);
            if wrote != len as isize {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Why rank `rank` ended with `status`, when its cgroup says: the kernel's OOM killer took
/// it at its limit.
pub fn oom_cause(rank: usize, status: ExitStatus) -> Option<String> {
    use std::os::unix::process::ExitStatusExt;
    let limit = LIMIT.get()?;
    if status.signal() != Some(libc::SIGKILL) {
        return None;
    }
    let dir = limit.dir.join(format!("rank-{rank}"));
    let kills = oom_kills(&dir)?;
    let before = limit
        .started
        .lock()
        .ok()
        .and_then(|s| s.get(&rank).copied())
        .unwrap_or(0);
    (kills > before).then(|| {
        format!(
            "the kernel's OOM killer took it at its memory limit of {} (--memory-per-rank; \
             cgroup {}: oom_kill {kills})",
            ByteSize(limit.bytes).display().iec(),
            dir.display()
        )
    })
}

impl Drop for Confinement {
    /// Stops what is left in the ranks' cgroups (processes a rank started, which outlive it)
    /// and removes them and the job's (a cgroup goes once its processes have: waited for,
    /// bounded).
    fn drop(&mut self) {
        let ranks: Vec<PathBuf> = std::fs::read_dir(&self.dir)
            .map(|entries| {
                (entries.flatten())
                    .filter(|e| e.file_name().to_string_lossy().starts_with("rank-"))
                    .map(|e| e.path())
                    .collect()
            })
            .unwrap_or_default();
        let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
        for dir in &ranks {
            while std::fs::remove_dir(dir).is_err() && std::time::Instant::now() < until {
                let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
                for pid in procs
                    .lines()
                    .filter_map(|l| l.trim().parse::<libc::pid_t>().ok())
                {
                    // SAFETY: kill(2) of a process in this launch's own cgroup.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}
