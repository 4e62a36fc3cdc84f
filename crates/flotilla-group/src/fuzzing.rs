//! Hooks for the fuzz targets in `fuzz/` (feature `fuzzing`): the private message decoders,
//! each checking its own round trip. Not a public API.

/// Decodes `bytes` as a stall watcher's report; a decoded report must survive
/// encode → decode. Returns whether it decoded.
pub fn stall_report(bytes: &[u8]) -> bool {
    crate::stall::fuzz_report(bytes)
}
