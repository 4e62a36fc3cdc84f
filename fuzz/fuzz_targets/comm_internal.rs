//! The process-group layer's small internal messages: the stall watcher's report (binary).
//! Properties: garbage is an error, never a
//! panic; what decodes survives encode → decode.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    flotilla_group::fuzzing::stall_report(data);
});
