//! A segment's file name, and the sweep of the files that killed creators left behind.
//!
//! A segment's file exists only from its creation until every member has mapped it; a
//! creator killed in between (SIGKILL, the OOM killer) leaves it behind, holding its size of
//! memory in `/dev/shm` until the next reboot. So the name says who made it,
//! `flotilla-{pid}-{pid namespace}-{session}-{group key}.shm`, and each creation first
//! removes the files of its directory whose creator is dead ([`sweep`]): only regular files
//! of this user, named by this pattern, made in this process's pid namespace (a pid names
//! nothing in another: containers sharing `/dev/shm` with pid namespaces of their own would
//! take each other's live creators for dead). A creator whose pid was reused by another
//! process since keeps its file until that process ends too.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use rustix::process::{Pid, geteuid, test_kill_process};

const PREFIX: &str = "flotilla-";
const SUFFIX: &str = ".shm";

/// The inode of this process's pid namespace (`None`: unknown, no `/proc`).
fn pid_namespace() -> Option<u64> {
    std::fs::metadata("/proc/self/ns/pid").ok().map(|m| m.ino())
}

/// The name of this process's segment file of group `key` of job `session`.
pub(crate) fn file_name(session: u64, key: u64) -> String {
    let (pid, ns) = (std::process::id(), pid_namespace().unwrap_or(0));
    format!("{PREFIX}{pid}-{ns:x}-{session:016x}-{key:016x}{SUFFIX}")
}

/// The creator (pid, pid namespace) of a segment file named `name`, if it is one.
fn creator(name: &str) -> Option<(i32, u64)> {
    let rest = name.strip_prefix(PREFIX)?.strip_suffix(SUFFIX)?;
    let mut parts = rest.split('-');
    let pid = parts.next()?.parse().ok()?;
    let ns = u64::from_str_radix(parts.next()?, 16).ok()?;
    let ids: Vec<&str> = parts.collect();
    let ids_ok = ids.len() == 2
        && ids
            .iter()
            .all(|s| s.len() == 16 && u64::from_str_radix(s, 16).is_ok());
    ids_ok.then_some((pid, ns))
}

/// Whether process `pid` (of this pid namespace) is gone: `kill(pid, 0)` finds none. A
/// process of another user answers `EPERM`: alive.
fn dead(pid: i32) -> bool {
    Pid::from_raw(pid).is_some_and(|p| test_kill_process(p) == Err(rustix::io::Errno::SRCH))
}

/// Removes the segment files of `dir` whose creator is dead (see the module doc); returns
/// how many. Errors (an unreadable directory, a file removed meanwhile) skip the file.
pub(crate) fn sweep(dir: &Path) -> usize {
    let (Some(ns), Ok(entries)) = (pid_namespace(), std::fs::read_dir(dir)) else {
        return 0;
    };
    let me = geteuid().as_raw();
    let mut removed = 0;
    for e in entries.flatten() {
        let name = e.file_name();
        let Some((pid, their_ns)) = name.to_str().and_then(creator) else {
            continue;
        };
        // `DirEntry::metadata` does not follow a symbolic link: a link is never removed.
        let own_file = e.metadata().is_ok_and(|m| m.is_file() && m.uid() == me);
        if own_file && their_ns == ns && dead(pid) && std::fs::remove_file(e.path()).is_ok() {
            tracing::info!(file = %e.path().display(), pid, "removed a shared-memory segment left by a dead process");
            removed += 1;
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pid that is no process's (a child that ran and was reaped).
    fn dead_pid() -> i32 {
        let mut c = std::process::Command::new("true")
            .spawn()
            .expect("spawn true");
        let pid = c.id() as i32;
        c.wait().expect("reap");
        assert!(dead(pid), "pid {pid} was reused at once");
        pid
    }

    /// A user id that is not this process's.
    fn me_plus_one() -> u32 {
        geteuid().as_raw().wrapping_add(1)
    }

    fn name_of(pid: i32, ns: u64, session: u64) -> String {
        format!("{PREFIX}{pid}-{ns:x}-{session:016x}-{:016x}{SUFFIX}", 7u64)
    }

    #[test]
    fn names_carry_their_creator_and_nothing_else_parses() {
        let ns = pid_namespace().expect("Linux has /proc");
        let mine = file_name(0xab, 0xcd);
        assert_eq!(creator(&mine), Some((std::process::id() as i32, ns)));
        for other in [
            "flotilla-0000000000000001-0000000000000002.shm",
            "flotilla-12-ab-0000000000000001-0000000000000002.txt",
            "flotilla-x-ab-0000000000000001-0000000000000002.shm",
            "flotilla-12-ab-0000000000000001-02.shm",
            "flotilla-12-ab-0000000000000001-0000000000000002-3.shm",
            "other-12-ab-0000000000000001-0000000000000002.shm",
        ] {
            assert_eq!(creator(other), None, "{other}");
        }
    }

    #[test]
    fn only_own_files_of_dead_creators_of_this_pid_namespace_are_swept() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let ns = pid_namespace().expect("Linux has /proc");
        let (dead, alive) = (dead_pid(), std::process::id() as i32);
        let write = |name: &str| {
            let p = dir.path().join(name);
            std::fs::write(&p, b"segment").expect("write");
            p
        };
        let stale = write(&name_of(dead, ns, 1));
        let live = write(&name_of(alive, ns, 2));
        let foreign_ns = write(&name_of(dead, ns ^ 1, 3));
        let unrelated = write(&format!("notflotilla-{dead}"));
        let others = write(&name_of(dead, ns, 5));
        // Another user's file (root can give one away; others skip that case).
        let given_away = std::os::unix::fs::chown(&others, Some(me_plus_one()), None).is_ok();
        let link = dir.path().join(name_of(dead, ns, 4));
        std::os::unix::fs::symlink(&live, &link).expect("symlink");
        assert_eq!(sweep(dir.path()), if given_away { 1 } else { 2 });
        assert!(!stale.exists(), "the dead creator's file is removed");
        assert_eq!(others.exists(), given_away, "another user's file is kept");
        for kept in [&live, &foreign_ns, &unrelated] {
            assert!(kept.exists(), "{} is kept", kept.display());
        }
        assert!(link.symlink_metadata().is_ok(), "a link is not removed");
    }
}
