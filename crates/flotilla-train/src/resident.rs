//! This process's resident memory as the kernel measures it (not counted by a strategy).

/// This process's peak resident memory (`VmHWM` of `/proc/self/status`), in bytes; `None`
/// where it cannot be read.
pub(crate) fn peak_resident_bytes() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024.0)
}
