//! The identity of this process's host, as the rendezvous reports it: ranks whose keys are
//! equal share memory, so their groups may exchange through a shared segment (`shm`), and
//! the hierarchical all-reduce counts them as one host.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// The directory whose identity is the host key: the configured segment directory, else
/// `/dev/shm` when there is one, else the system temporary directory (where segments go).
fn segment_root(shm_dir: Option<&Path>) -> std::path::PathBuf {
    match shm_dir {
        Some(d) => d.to_path_buf(),
        None if Path::new("/dev/shm").is_dir() => "/dev/shm".into(),
        None => std::env::temp_dir(),
    }
}

/// This process's host key: what a segment needs, the boot id and the device and inode of
/// the directory its segments are made in (`shm_dir` when configured, else `/dev/shm`, else
/// the temporary directory). Two processes with equal keys see the same directory of the
/// same running kernel: containers sharing the host's network but each with a private
/// `/dev/shm` get different keys, two with one `/dev/shm` (or one bind-mounted `shm_dir`)
/// equal ones, whatever their host names and network namespaces. What a key cannot see (a
/// segment made in the temporary directory because `/dev/shm` is full) the setup's verdict
/// covers (`shm/setup.rs`). Empty where any part is unknown (not Linux): such a rank is
/// never local to another.
pub(crate) fn host_key(shm_dir: Option<&Path>) -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    let dir = match std::fs::metadata(segment_root(shm_dir)) {
        Ok(d) => d,
        Err(e) => {
            if let Some(d) = shm_dir {
                tracing::warn!(shm_dir = %d.display(), error = %e, "the shared-memory directory is unreadable: no group shares memory");
            }
            return String::new();
        }
    };
    if boot.is_empty() {
        return String::new();
    }
    format!("{boot}/shm:{:x}:{}", dir.dev(), dir.ino())
}

/// Whether every member (world ranks) of a group reported the same, known host key.
pub(crate) fn all_local(hosts: &[String], members: &[usize]) -> bool {
    let mut keys = members.iter().map(|&w| hosts.get(w));
    match keys.next() {
        Some(Some(first)) if !first.is_empty() => keys.all(|k| k == Some(first)),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_is_stable_and_locality_needs_equal_known_keys() {
        let k = host_key(None);
        assert_eq!(k, host_key(None));
        assert!(!k.is_empty(), "Linux has a host key");
        let hosts = vec![k.clone(), k.clone(), "other".to_string(), String::new()];
        assert!(all_local(&hosts, &[0, 1]));
        assert!(!all_local(&hosts, &[0, 2]));
        assert!(!all_local(&hosts, &[3]));
        assert!(!all_local(&hosts, &[0, 7]));
    }

    #[test]
    fn the_key_is_the_segment_directory_of_this_boot() {
        let (a, b) = (
            tempfile::tempdir().expect("dir"),
            tempfile::tempdir().expect("dir"),
        );
        let (ka, kb) = (host_key(Some(a.path())), host_key(Some(b.path())));
        assert_ne!(ka, kb, "two directories are two hosts");
        // The same directory under another name (a link, as a bind mount would be) is one.
        let link = b.path().join("link");
        std::os::unix::fs::symlink(a.path(), &link).expect("symlink");
        assert_eq!(host_key(Some(&link)), ka);
        assert_eq!(host_key(Some(Path::new("/no/such/dir"))), "");
        if Path::new("/dev/shm").is_dir() {
            assert_eq!(host_key(None), host_key(Some(Path::new("/dev/shm"))));
        }
    }
}
