//! This process's resident memory as the kernel measures it (not counted by a strategy).

/// This process's peak resident memory (`VmHWM` of `/proc/self/status`), in bytes; `None`
/// where it cannot be read.
pub(crate) fn peak_resident_bytes() -> Option<f64> {
    status_bytes("VmHWM:")
}

/// This process's resident memory now (`VmRSS` of `/proc/self/status`), in bytes; `None`
/// where it cannot be read.
pub(crate) fn resident_bytes() -> Option<f64> {
    status_bytes("VmRSS:")
}

/// The figure of `/proc/self/status` whose line starts with `key` (in KiB there), in bytes.
fn status_bytes(key: &str) -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(key))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024.0)
}

/// ` rss=<MiB>MiB`, this process's resident memory now, for a run.log line (empty where the
/// kernel does not say).
pub(crate) fn rss_field(bytes: Option<f64>) -> String {
    bytes.map_or(String::new(), |b| {
        format!(" rss={:.1}MiB", b / (1u64 << 20) as f64)
    })
}
