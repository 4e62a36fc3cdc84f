//! What the fault-injection suite reads from `/proc` (Linux): a launcher's rank processes,
//! the TCP ports a process listens on, whether a process is gone; and the signals it sends.
#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// The direct children of `pid` (every thread's `children` file).
pub fn children_of(pid: u32) -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    let mut kids = BTreeSet::new();
    for task in tasks.flatten() {
        let text = std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
        kids.extend(
            text.split_whitespace()
                .filter_map(|s| s.parse::<u32>().ok()),
        );
    }
    kids.into_iter().collect()
}

/// The value of `key` in the environment `pid` started with.
pub fn env_of(pid: u32, key: &str) -> Option<String> {
    let raw = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    let prefix = format!("{key}=");
    raw.split(|b| *b == 0)
        .map(String::from_utf8_lossy)
        .find_map(|kv| kv.strip_prefix(&prefix).map(str::to_string))
}

/// The rank processes of the launcher `launcher` (its children, by their `RANK`), once all
/// `n` are there; `None` if they are not within `limit`.
pub fn rank_pids(launcher: u32, n: usize, limit: Duration) -> Option<BTreeMap<usize, u32>> {
    let started = Instant::now();
    loop {
        let ranks: BTreeMap<usize, u32> = children_of(launcher)
            .into_iter()
            .filter_map(|pid| Some((env_of(pid, "RANK")?.parse().ok()?, pid)))
            .collect();
        if ranks.len() == n {
            return Some(ranks);
        }
        if started.elapsed() > limit {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether `pid` still runs (a zombie, which only waits to be reaped, does not).
pub fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            // The state follows the command name, which is in parentheses.
            let state = s.rsplit_once(')').map(|(_, rest)| rest.trim_start());
            !matches!(state.and_then(|r| r.chars().next()), Some('Z') | Some('X'))
        })
        .unwrap_or(false)
}

/// Waits until none of `pids` runs; returns those still running after `limit`.
pub fn wait_gone(pids: &[u32], limit: Duration) -> Vec<u32> {
    let started = Instant::now();
    loop {
        let left: Vec<u32> = pids.iter().copied().filter(|p| alive(*p)).collect();
        if left.is_empty() || started.elapsed() > limit {
            return left;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Sends `signal` to `pid`; an error if the process is not there to get it.
pub fn signal(pid: u32, signal: i32) -> std::io::Result<()> {
    let pid = libc::pid_t::try_from(pid).map_err(std::io::Error::other)?;
    // SAFETY: kill(2) has no memory-safety preconditions.
    if unsafe { libc::kill(pid, signal) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The socket inodes among `pid`'s open files.
fn socket_inodes(pid: u32) -> BTreeSet<u64> {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return BTreeSet::new();
    };
    fds.flatten()
        .filter_map(|fd| std::fs::read_link(fd.path()).ok())
        .filter_map(|target| {
            let t = target.to_string_lossy().into_owned();
            t.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok()
        })
        .collect()
}

/// The TCP ports `pid` listens on: the listening sockets of its network namespace
/// (`/proc/<pid>/net/tcp` and `tcp6`, state `0A`) whose inode is one of its open files.
pub fn listening_ports(pid: u32) -> BTreeSet<u16> {
    let mine = socket_inodes(pid);
    let mut ports = BTreeSet::new();
    for table in ["tcp", "tcp6"] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).unwrap_or_default();
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            if f.len() < 10 || f[3] != "0A" {
                continue;
            }
            let inode = f[9].parse::<u64>().unwrap_or(0);
            let port = f[1]
                .rsplit_once(':')
                .and_then(|(_, p)| u16::from_str_radix(p, 16).ok());
            if let Some(port) = port.filter(|_| mine.contains(&inode)) {
                ports.insert(port);
            }
        }
    }
    ports
}

/// Waits until `pid` listens on at least `n` TCP ports (at most `limit`) and returns them.
pub fn wait_listening(pid: u32, n: usize, limit: Duration) -> BTreeSet<u16> {
    let started = Instant::now();
    loop {
        let ports = listening_ports(pid);
        if ports.len() >= n || started.elapsed() > limit {
            return ports;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
