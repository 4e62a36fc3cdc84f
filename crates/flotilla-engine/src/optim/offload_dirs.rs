//! The names of offloaded optimizer states' directories, and the sweep of those that killed
//! ranks left behind.
//!
//! A rank removes its directory when its optimizer is dropped; one killed (SIGKILL, the OOM
//! killer, a job restarted by `--max-restarts`) leaves it, up to its whole shard of optimizer
//! state on disk each time. So the name says who made it,
//! `flotilla-optimizer-{boot id}-{pid namespace}-{pid}-{random}`, and each new directory
//! first removes the ones under the same directory whose maker is dead ([`sweep`]): only
//! directories of this user, named by this pattern, made on this host since its last boot
//! (the kernel's `boot_id`: the directory may be on a mount other hosts share) in this
//! process's pid namespace, by a process that no longer exists. A maker whose pid was reused
//! since keeps its directory until that process ends too. The shared-memory segments of
//! `flotilla-tcp` are swept the same way (`segment/files.rs`); this one needs the host too.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// The start of every such directory's name.
const PREFIX: &str = "flotilla-optimizer-";

/// This process's maker mark: boot id, pid namespace (`None` without `/proc`).
fn host_mark() -> Option<String> {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let boot: String = boot.trim().chars().filter(|c| *c != '-').collect();
    let ns = std::fs::metadata("/proc/self/ns/pid").ok()?.ino();
    Some(format!("{boot}-{ns:x}"))
}

/// The prefix of this process's directory names (before `tempfile`'s random part).
pub(crate) fn prefix() -> String {
    let mark = host_mark().unwrap_or_else(|| "unknown-0".into());
    format!("{PREFIX}{mark}-{}-", std::process::id())
}

/// The maker of directory `name` if it is one of this host and pid namespace (`mark`): its pid.
fn maker(name: &str, mark: &str) -> Option<u32> {
    let rest = name
        .strip_prefix(PREFIX)?
        .strip_prefix(mark)?
        .strip_prefix('-')?;
    let (pid, random) = rest.split_once('-')?;
    (!random.is_empty()).then_some(())?;
    pid.parse().ok()
}

/// Removes the directories under `base` whose maker is dead (see the module doc); returns
/// how many. Errors (an unreadable directory, one removed meanwhile) skip the directory.
pub(crate) fn sweep(base: &Path) -> usize {
    let (Some(mark), Ok(me), Ok(entries)) = (
        host_mark(),
        std::fs::metadata("/proc/self").map(|m| m.uid()),
        std::fs::read_dir(base),
    ) else {
        return 0;
    };
    let mut removed = 0;
    for e in entries.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| maker(n, &mark)) else {
            continue;
        };
        // `DirEntry::metadata` does not follow a symbolic link: a link is never removed.
        let own_dir = e.metadata().is_ok_and(|m| m.is_dir() && m.uid() == me);
        let dead = !Path::new(&format!("/proc/{pid}")).exists();
        if own_dir && dead && std::fs::remove_dir_all(e.path()).is_ok() {
            tracing::info!(dir = %e.path().display(), pid, "removed an offloaded optimizer state left by a dead rank");
            removed += 1;
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pid that is no process's (a child that ran and was reaped).
    fn dead_pid() -> u32 {
        let mut c = std::process::Command::new("true").spawn().expect("spawn");
        let pid = c.id();
        c.wait().expect("reap");
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists(),
            "pid {pid} reused"
        );
        pid
    }

    #[test]
    fn a_dead_ranks_directory_is_swept_by_the_next_offload_and_no_other() {
        let base = tempfile::tempdir().expect("tmp");
        let mark = host_mark().expect("/proc");
        let dead = dead_pid();
        let make = |name: &str| {
            let dir = base.path().join(name);
            std::fs::create_dir(&dir).expect("dir");
            std::fs::write(dir.join("chunk-00000.bpk"), b"state").expect("file");
            dir
        };
        let gone = make(&format!("{PREFIX}{mark}-{dead}-aB3x9Q"));
        let kept = [
            // A live maker (this process).
            make(&format!("{}aB3x9Q", prefix())),
            // Another host (or boot), another pid namespace.
            make(&format!(
                "{PREFIX}0123456789abcdef0123456789abcdef-{}-{dead}-aB3x9Q",
                &mark[33..]
            )),
            make(&format!("{PREFIX}{}-ffff-{dead}-aB3x9Q", &mark[..32])),
            // Not this pattern.
            make(&format!("{PREFIX}{mark}-{dead}-")),
            make("flotilla-optimizer-notes"),
        ];
        // A new offloaded state sweeps its directory's dead first.
        let spec = crate::OptimizerSpec::default();
        let offload = crate::optim::offload::Offload::new(base.path(), &spec, vec![], &[4], 4)
            .expect("offload");
        let name = offload
            .dir()
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("");
        assert!(name.starts_with(&prefix()), "{name}");
        assert_eq!(maker(name, &mark), Some(std::process::id()));
        assert!(!gone.exists(), "{}", gone.display());
        assert_eq!(sweep(base.path()), 0, "nothing more to sweep");
        for dir in &kept {
            assert!(dir.exists(), "{} swept", dir.display());
        }
        assert_eq!(
            maker(&format!("{PREFIX}{mark}-{dead}-x"), &mark),
            Some(dead)
        );
    }
}
