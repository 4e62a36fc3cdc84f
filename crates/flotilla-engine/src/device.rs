//! Run-time choice of burn backend by name.

use burn::prelude::Device;

use crate::error::{EngineError, Result};

/// The backends this build can run on: `flex` (pure-Rust CPU, always), `ndarray` (with the
/// `ndarray` feature), `libtorch` (with the `libtorch` feature).
pub fn available_devices() -> Vec<&'static str> {
    let mut names = vec!["flex"];
    if cfg!(feature = "ndarray") {
        names.push("ndarray");
    }
    if cfg!(feature = "libtorch") {
        names.push("libtorch");
    }
    names
}

/// Checks that `name` is a backend this build can run on (see [`available_devices`]).
pub fn check_device(name: &str) -> Result<()> {
    device_by_name(name).map(|_| ())
}

/// The device for a backend name, without autodiff (`flex`, `ndarray`, `libtorch`).
pub(crate) fn device_by_name(name: &str) -> Result<Device> {
    match name {
        "flex" | "cpu" => Ok(Device::flex()),
        // burn 0.22 deprecates NdArray (in favour of Flex) but still ships it.
        #[cfg(feature = "ndarray")]
        #[allow(deprecated)]
        "ndarray" => Ok(Device::ndarray()),
        #[cfg(feature = "libtorch")]
        "libtorch" => Ok(Device::libtorch()),
        other => Err(EngineError::UnknownDevice(other.to_string())),
    }
}
