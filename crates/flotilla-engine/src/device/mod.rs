//! Devices: a device's name ([`device_spec`]) and the burn backend it runs on (here), the GPUs
//! of this machine ([`gpu`]; the Vulkan adapters in `vulkan.rs`, with the feature `wgpu`),
//! where a model's parameters are ([`placement`]) and the spans of host↔device copies
//! ([`copies`]).
//!
//! Here, run-time choice of burn backend by name: `flex` (or `cpu`), `ndarray`, `libtorch`, the
//! GPU backends with an optional device index, `cuda[:I]` and `wgpu[:I]` (burn's wgpu backend
//! on Vulkan adapter `I`; the index picks the GPU, [`crate::local_device`] gives each local
//! rank its own; `gpu.rs`), and `auto[:N]` (the Vulkan GPU `N` when the build has `wgpu` and
//! the machine such a GPU, else Flex; decided once per process, and [`describe_device`] says
//! which and why).

pub(crate) mod copies;
pub(crate) mod device_spec;
pub(crate) mod gpu;
pub(crate) mod placement;
#[cfg(feature = "wgpu")]
mod vulkan;

use std::sync::OnceLock;

use burn::prelude::Device;

use crate::device::device_spec::DeviceSpec;
use crate::error::{EngineError, Result};

/// The backends this build can run on: `flex` (pure-Rust CPU) and `auto` always, `ndarray`
/// (with the `ndarray` feature), `libtorch` (with the `libtorch` feature), `cuda` (with the
/// `cuda` feature; usable only where the driver is), `wgpu` (with the `wgpu` feature; usable
/// only where a Vulkan driver is).
pub fn available_devices() -> Vec<&'static str> {
    let mut names = vec!["flex", "auto"];
    if cfg!(feature = "ndarray") {
        names.push("ndarray");
    }
    if cfg!(feature = "libtorch") {
        names.push("libtorch");
    }
    if cfg!(feature = "cuda") {
        names.push("cuda");
    }
    if cfg!(feature = "wgpu") {
        names.push("wgpu");
    }
    names
}

/// Checks that `name` is a backend this build can run on (see [`available_devices`]); a GPU
/// is checked on this machine's driver too (a missing driver or index is an error naming
/// it), without opening it.
pub fn check_device(name: &str) -> Result<()> {
    let spec = DeviceSpec::parse(name)?;
    match spec.gpu() {
        Some(kind) => gpu::check(kind, name, spec.index.unwrap_or(0)),
        None if spec.kind == "auto" => Ok(()),
        None => resolve(name).map(|_| ()),
    }
}

/// The device for a backend name, without autodiff. A GPU device is opened here, so a
/// missing driver is an error naming it.
pub fn device_by_name(name: &str) -> Result<Device> {
    resolve(name).map(|(device, _)| device)
}

/// What `name` runs on in this process, opening the device: `flex`, `cuda:1`, `wgpu:0
/// (Vulkan adapter 0, discrete GPU 0)`, `flex (auto: ...why...)`; the line a rank logs as it
/// starts. A GPU device without its driver is the error naming the driver.
pub fn describe_device(name: &str) -> Result<String> {
    resolve(name).map(|(_, what)| what)
}

/// The variable burn reads for its default device (`BURN_DEVICE`).
pub const BURN_DEVICE_ENV: &str = "BURN_DEVICE";

/// What `BURN_DEVICE` should say in a process that trains on `name`: `flex` for a CPU device,
/// nothing for a GPU (burn's default is the GPU already). burn loads an optimizer's state on
/// its default device (`ModuleOptimizer::load_record`, moved to the parameters' device at the
/// next step), which in a build with `wgpu` is wgpu's: without this, a rank training on Flex
/// opened Vulkan (Mesa's lavapipe on a machine without a GPU, with its threads and its
/// "XDG_RUNTIME_DIR is invalid" lines) whenever it took optimizer state from a checkpoint or
/// a peer. A name that does not parse says nothing (the rank refuses it itself).
pub fn burn_device_for(name: &str) -> Option<&'static str> {
    let spec = DeviceSpec::parse(name).ok()?;
    spec.gpu().is_none().then_some("flex")
}

/// The device of `name` and what it is.
fn resolve(name: &str) -> Result<(Device, String)> {
    let spec = DeviceSpec::parse(name)?;
    if let Some(kind) = spec.gpu() {
        return gpu::device(kind, name, spec.index.unwrap_or(0));
    }
    if spec.kind == "auto" {
        return Ok(auto(spec.index.unwrap_or(0)));
    }
    if spec.index.is_some() {
        return Err(EngineError::UnknownDevice(name.to_string()));
    }
    let not_built = |feature| EngineError::FeatureMissing {
        device: name.to_string(),
        feature,
    };
    match spec.kind.as_str() {
        "flex" | "cpu" => Ok((Device::flex(), "flex".into())),
        // burn 0.22 deprecates NdArray (in favour of Flex) but still ships it.
        #[cfg(feature = "ndarray")]
        #[allow(deprecated)]
        "ndarray" => Ok((Device::ndarray(), "ndarray".into())),
        #[cfg(not(feature = "ndarray"))]
        "ndarray" => Err(not_built("ndarray")),
        #[cfg(feature = "libtorch")]
        #[allow(deprecated)]
        "libtorch" => Ok((Device::libtorch(), "libtorch".into())),
        #[cfg(not(feature = "libtorch"))]
        "libtorch" => Err(not_built("libtorch")),
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
    match crate::device::vulkan::gpu(index) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::device_spec::GpuKind;

    #[test]
    fn names_parse_with_and_without_an_index() {
        let s = DeviceSpec::parse("cuda:3").expect("parses");
        assert_eq!((s.kind.as_str(), s.index), ("cuda", Some(3)));
        assert_eq!(s.gpu(), Some(GpuKind::Cuda));
        let s = DeviceSpec::parse("wgpu:1").expect("parses");
        assert_eq!((s.gpu(), s.index), (Some(GpuKind::Wgpu), Some(1)));
        let s = DeviceSpec::parse("flex").expect("parses");
        assert_eq!((s.kind.as_str(), s.index, s.gpu()), ("flex", None, None));
        assert!(DeviceSpec::parse("cuda:x").is_err());
        // The CPU keeps its names; an index on a CPU backend is refused; auto takes one.
        assert!(check_device("flex").is_ok() && check_device("cpu").is_ok());
        assert!(check_device("flex:1").is_err());
        assert!(check_device("auto").is_ok() && check_device("auto:1").is_ok());
        assert!(check_device("auto:x").is_err());
    }

    /// burn's default device in a rank: Flex for every CPU name (and `auto`, whose GPU takes
    /// the state at its first step), burn's own (the GPU) for a GPU name.
    #[test]
    fn burns_default_device_is_flex_unless_the_rank_trains_on_a_gpu() {
        for cpu in ["flex", "cpu", "auto", "auto:1"] {
            assert_eq!(burn_device_for(cpu), Some("flex"), "{cpu}");
        }
        for gpu in ["wgpu", "wgpu:1", "cuda", "cuda:0"] {
            assert_eq!(burn_device_for(gpu), None, "{gpu}");
        }
        assert_eq!(burn_device_for("cuda:x"), None);
    }

    /// Without the feature, `device: cuda` is one error naming the feature; with it on a
    /// machine without the driver (CI), one error naming `libcuda.so`, never a panic.
    #[test]
    fn cuda_names_the_missing_feature_or_driver() {
        let e = check_device("cuda:999")
            .expect_err("no GPU 999")
            .to_string();
        if !cfg!(feature = "cuda") {
            assert_eq!(
                e,
                "device `cuda:999` needs a binary built with the `cuda` feature (cargo build --release --features cuda)"
            );
            return;
        }
        match gpu::gpu_count(GpuKind::Cuda) {
            Err(_) => assert!(e.contains("libcuda.so") && e.contains("`cuda:999`"), "{e}"),
            Ok(n) => assert!(e.contains(&format!("reports {n} GPU(s)")), "{e}"),
        }
    }
}
