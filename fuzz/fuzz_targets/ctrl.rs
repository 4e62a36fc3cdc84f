//! The control-channel decoder (rendezvous, mesh handshake, abort: JSON). Properties: garbage
//! is an error, never a panic; a decoded message survives encode → decode.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    flotilla_tcp::fuzzing::ctrl(data);
});
