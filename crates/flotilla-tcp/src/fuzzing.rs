//! Hooks for the fuzz targets in `fuzz/` (feature `fuzzing`): the private message decoders,
//! each checking its own round trip. Not a public API. (The stall watcher's report is
//! `flotilla_group`'s, behind its own `fuzzing` feature.)

/// Decodes `bytes` as a control-channel message (JSON); a decoded message must survive
/// encode → decode. Returns whether it decoded.
pub fn ctrl(bytes: &[u8]) -> bool {
    crate::wire::fuzz_ctrl(bytes)
}
