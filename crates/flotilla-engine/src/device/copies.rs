//! The spans of the copies between host memory and the device (`flotilla::engine`
//! `device_to_host` and `host_to_device`, with what is copied and how many values), so that a
//! Chrome timeline shows each copy on its own, beside the backward it overlaps. On a CPU
//! backend they are short; on a GPU (wgpu) each is a read-back or an upload.
//!
//! What crosses: gradients leaving a backward group (the bucket they go to is the host buffer
//! the all-reduce works on), parameters and buffers read or written as flat buffers (initial
//! broadcast, parameter-server pulls, checkpoints), the reduced gradients going back before
//! the optimizer steps on the device, batches and a pipeline stage's activations and their
//! gradients.

use tracing::span::EnteredSpan;

/// Enters the span of a copy of `values` values of `what` from the device to the host.
pub(crate) fn to_host(what: &'static str, values: usize) -> EnteredSpan {
    tracing::info_span!(
        target: "flotilla::engine",
        "device_to_host",
        what,
        values = values as u64
    )
    .entered()
}

/// Enters the span of a copy of `values` values of `what` from the host to the device.
pub(crate) fn to_device(what: &'static str, values: usize) -> EnteredSpan {
    tracing::info_span!(
        target: "flotilla::engine",
        "host_to_device",
        what,
        values = values as u64
    )
    .entered()
}
