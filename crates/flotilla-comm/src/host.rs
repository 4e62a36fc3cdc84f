//! The identity of this process's host, as the rendezvous reports it: ranks whose keys are
//! equal share memory, so their groups may exchange through a shared segment (`shm`).

use std::os::unix::fs::MetadataExt;

/// This process's host key: host name, boot id and the inode of its network namespace
/// (`/proc/self/ns/net`), so two boots of one machine, or two network namespaces used as
/// "hosts" (tests, containers), never count as one host. Empty where any part is unknown
/// (not Linux): such a rank is never local to another.
pub(crate) fn host_key() -> String {
    let read = |p: &str| std::fs::read_to_string(p).map(|s| s.trim().to_string());
    let (Ok(name), Ok(boot), Ok(ns)) = (
        read("/proc/sys/kernel/hostname"),
        read("/proc/sys/kernel/random/boot_id"),
        std::fs::metadata("/proc/self/ns/net"),
    ) else {
        return String::new();
    };
    if boot.is_empty() {
        return String::new();
    }
    format!("{name}/{boot}/net:{}", ns.ino())
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
        let k = host_key();
        assert_eq!(k, host_key());
        assert!(!k.is_empty(), "Linux has a host key");
        let hosts = vec![k.clone(), k.clone(), "other".to_string(), String::new()];
        assert!(all_local(&hosts, &[0, 1]));
        assert!(!all_local(&hosts, &[0, 2]));
        assert!(!all_local(&hosts, &[3]));
        assert!(!all_local(&hosts, &[0, 7]));
    }
}
