//! Variables that programs read before the settings had one schema, each with the key that
//! replaced it: setting one is refused with the new name (and unit), never ignored.

/// `(old variable, new variable, what the new one takes)`.
const RETIRED: &[(&str, &str, &str)] = &[
    (
        "FLOTILLA_COMM_TIMEOUT_SECS",
        "FLOTILLA_COMM__TIMEOUT_S",
        "seconds",
    ),
    (
        "FLOTILLA_JOIN_TIMEOUT_SECS",
        "FLOTILLA_COMM__JOIN_TIMEOUT_S",
        "seconds",
    ),
    (
        "FLOTILLA_COMM_COMPRESSION",
        "FLOTILLA_COMM__COMPRESSION",
        "none or lz4",
    ),
    (
        "FLOTILLA_COMM_WIRE",
        "FLOTILLA_COMM__WIRE_FORMAT",
        "f32 or bf16",
    ),
    (
        "FLOTILLA_COMM_CHUNK_BYTES",
        "FLOTILLA_COMM__CHUNK_KB",
        "KiB",
    ),
    (
        "FLOTILLA_COMM_SMALL_ALL_REDUCE_BYTES",
        "FLOTILLA_COMM__SMALL_ALL_REDUCE_KB",
        "KiB",
    ),
    (
        "FLOTILLA_COMM_MID_ALL_REDUCE_BYTES",
        "FLOTILLA_COMM__MID_ALL_REDUCE_KB",
        "KiB",
    ),
    ("FLOTILLA_COMM_THREADS", "FLOTILLA_COMM__THREADS", "threads"),
    (
        "FLOTILLA_COMM_SOCKET_BUFFER_BYTES",
        "FLOTILLA_COMM__SOCKET_BUFFER_KB",
        "KiB",
    ),
    (
        "FLOTILLA_COMM_MAX_QUEUED_BYTES",
        "FLOTILLA_COMM__MAX_QUEUED_MB",
        "MiB",
    ),
    (
        "FLOTILLA_COMM_TRANSPORT",
        "FLOTILLA_COMM__TRANSPORT",
        "auto, tcp or shm",
    ),
    (
        "FLOTILLA_COMM_HIERARCHICAL",
        "FLOTILLA_COMM__HIERARCHICAL",
        "auto or off",
    ),
    (
        "FLOTILLA_COMM_SHM_DIR",
        "FLOTILLA_COMM__SHM_DIR",
        "a directory",
    ),
    (
        "FLOTILLA_COMM_SHM_CHUNK_BYTES",
        "FLOTILLA_COMM__SHM_CHUNK_KB",
        "KiB",
    ),
];

/// Why `name` is not read any more and what to set instead, if it is a retired variable.
pub(crate) fn replacement(name: &str) -> Option<String> {
    RETIRED
        .iter()
        .find(|(old, _, _)| *old == name)
        .map(|(old, new, unit)| format!("{old} is no longer read: set {new} ({unit}) instead"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::keys;

    #[test]
    fn every_replacement_is_a_declared_key() {
        for (_, new, _) in RETIRED {
            let path = new["FLOTILLA_".len()..]
                .replace("__", ".")
                .to_ascii_lowercase();
            assert!(keys::KEYS.iter().any(|k| k.path == path), "{new}");
        }
    }
}
