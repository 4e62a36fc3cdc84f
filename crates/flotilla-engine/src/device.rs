//! Run-time choice of burn backend by name: `flex` (or `cpu`), `ndarray`, `libtorch`,
//! `wgpu[:N]` (burn's wgpu backend on Vulkan, adapter `N`, default 0) and `auto[:N]` (the
//! Vulkan GPU `N` when the build has `wgpu` and the machine such a GPU, else Flex; decided
//! once per process, and [`describe_device`] says which and why).

use std::sync::OnceLock;

use burn::prelude::Device;

use crate::error::{EngineError, Result};

/// The backends this build can run on: `flex` (pure-Rust CPU) and `auto` always, `ndarray`
/// (with the `ndarray` feature), `libtorch` (with the `libtorch` feature), `wgpu` (with the
/// `wgpu` feature).
pub fn available_devices() -> Vec<&'static str> {
    let mut names = vec!["flex", "auto"];
    if cfg!(feature = "ndarray") {
        names.push("ndarray");
    }
    if cfg!(feature = "libtorch") {
        names.push("libtorch");
    }
    if cfg!(feature = "wgpu") {
        names.push("wgpu");
    }
    names
}

/// A parsed device name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DeviceName {
    Flex,
    NdArray,
    LibTorch,
    /// burn's wgpu backend on the Vulkan adapter of this index (only parsed, never built,
    /// without the `wgpu` feature).
    #[cfg_attr(not(feature = "wgpu"), allow(dead_code))]
    Wgpu(usize),
    /// The Vulkan GPU of this index when there is one, else Flex.
    Auto(usize),
}

/// Parses `name` (`wgpu` and `auto` take an optional `:index`), checking that this build has
/// its backend.
fn parse(name: &str) -> Result<DeviceName> {
    let (base, index) = match name.split_once(':') {
        Some((base, index)) if matches!(base, "wgpu" | "auto") => {
            let index = index
                .parse::<usize>()
                .map_err(|_| EngineError::UnknownDevice(name.to_string()))?;
            (base, index)
        }
        _ => (name, 0),
    };
    let not_built = |feature| EngineError::DeviceNotBuilt {
        device: name.to_string(),
        feature,
    };
    match base {
        "flex" | "cpu" => Ok(DeviceName::Flex),
        "auto" => Ok(DeviceName::Auto(index)),
        "ndarray" if cfg!(feature = "ndarray") => Ok(DeviceName::NdArray),
        "ndarray" => Err(not_built("ndarray")),
        "libtorch" if cfg!(feature = "libtorch") => Ok(DeviceName::LibTorch),
        "libtorch" => Err(not_built("libtorch")),
        "wgpu" if cfg!(feature = "wgpu") => Ok(DeviceName::Wgpu(index)),
        "wgpu" => Err(not_built("wgpu")),
        _ => Err(EngineError::UnknownDevice(name.to_string())),
    }
}

/// Checks that `name` is a backend this build can run on (see [`available_devices`]); whether
/// a Vulkan adapter answers is found when an engine is built on it.
pub fn check_device(name: &str) -> Result<()> {
    parse(name).map(|_| ())
}

/// The device for a backend name, without autodiff. A `wgpu` device is opened here, so a
/// missing driver is an error naming it.
pub(crate) fn device_by_name(name: &str) -> Result<Device> {
    resolve(name).map(|(device, _)| device)
}

/// What `name` runs on in this process, opening the device: `flex`, `wgpu:0 (Vulkan adapter
/// 0, discrete GPU 0)`, `flex (auto: ...why...)`; the line a rank logs as it starts. A
/// `wgpu` device without a Vulkan driver is the error naming the driver.
pub fn describe_device(name: &str) -> Result<String> {
    resolve(name).map(|(_, what)| what)
}

/// The device of `name` and what it is.
fn resolve(name: &str) -> Result<(Device, String)> {
    match parse(name)? {
        DeviceName::Flex => Ok((Device::flex(), "flex".into())),
        // burn 0.22 deprecates NdArray (in favour of Flex) but still ships it.
        #[cfg(feature = "ndarray")]
        #[allow(deprecated)]
        DeviceName::NdArray => Ok((Device::ndarray(), "ndarray".into())),
        #[cfg(feature = "libtorch")]
        #[allow(deprecated)]
        DeviceName::LibTorch => Ok((Device::libtorch(), "libtorch".into())),
        #[cfg(feature = "wgpu")]
        DeviceName::Wgpu(index) => {
            let (device, what) = crate::vulkan::device(index)?;
            Ok((device, format!("wgpu:{index} ({what})")))
        }
        DeviceName::Auto(index) => Ok(auto(index)),
        #[allow(unreachable_patterns)]
        _ => Err(EngineError::UnknownDevice(name.to_string())),
    }
}

/// `auto:index`: the Vulkan GPU of that index, else Flex, with the reason; decided once per
/// process.
fn auto(index: usize) -> (Device, String) {
    static CHOICE: OnceLock<(Device, String)> = OnceLock::new();
    CHOICE.get_or_init(|| auto_choice(index)).clone()
}

#[cfg(feature = "wgpu")]
fn auto_choice(index: usize) -> (Device, String) {
    match crate::vulkan::gpu(index) {
        Ok((device, what)) => (device, format!("wgpu:{index} (auto: {what})")),
        Err(reason) => (Device::flex(), format!("flex (auto: {reason})")),
    }
}

#[cfg(not(feature = "wgpu"))]
fn auto_choice(_index: usize) -> (Device, String) {
    (
        Device::flex(),
        "flex (auto: this build has no GPU backend, `cargo build --features wgpu`)".to_string(),
    )
}
