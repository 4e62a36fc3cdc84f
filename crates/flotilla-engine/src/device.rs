//! Run-time choice of burn backend by name: `flex` (or `cpu`), `ndarray`, `libtorch`, and
//! the GPU backends with an optional device index, `cuda` or `cuda:1` (the index picks the
//! GPU; [`crate::local_device`] gives each local rank its own).

use burn::prelude::Device;

use crate::device_spec::DeviceSpec;
use crate::error::{EngineError, Result};
use crate::gpu;

/// The backends this build can run on: `flex` (pure-Rust CPU, always), `ndarray` (with the
/// `ndarray` feature), `libtorch` (with the `libtorch` feature), `cuda` (with the `cuda`
/// feature; usable only where the driver is).
pub fn available_devices() -> Vec<&'static str> {
    let mut names = vec!["flex"];
    if cfg!(feature = "ndarray") {
        names.push("ndarray");
    }
    if cfg!(feature = "libtorch") {
        names.push("libtorch");
    }
    if cfg!(feature = "cuda") {
        names.push("cuda");
    }
    names
}

/// Checks that `name` is a backend this build can run on (see [`available_devices`]); a GPU
/// is checked on this machine's driver too (a missing driver or index is an error naming it).
pub fn check_device(name: &str) -> Result<()> {
    device_by_name(name).map(|_| ())
}

/// The device for a backend name, without autodiff (`flex`, `ndarray`, `libtorch`, `cuda[:i]`).
pub(crate) fn device_by_name(name: &str) -> Result<Device> {
    let spec = DeviceSpec::parse(name)?;
    if let Some(kind) = spec.gpu() {
        return gpu::device(kind, name, spec.index.unwrap_or(0));
    }
    if spec.index.is_some() {
        return Err(EngineError::UnknownDevice(name.to_string()));
    }
    match spec.kind.as_str() {
        "flex" | "cpu" => Ok(Device::flex()),
        // burn 0.22 deprecates NdArray (in favour of Flex) but still ships it.
        #[cfg(feature = "ndarray")]
        #[allow(deprecated)]
        "ndarray" => Ok(Device::ndarray()),
        #[cfg(feature = "libtorch")]
        "libtorch" => Ok(Device::libtorch()),
        _ => Err(EngineError::UnknownDevice(name.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device_spec::GpuKind;

    #[test]
    fn names_parse_with_and_without_an_index() {
        let s = DeviceSpec::parse("cuda:3").expect("parses");
        assert_eq!((s.kind.as_str(), s.index), ("cuda", Some(3)));
        assert_eq!(s.gpu(), Some(GpuKind::Cuda));
        let s = DeviceSpec::parse("flex").expect("parses");
        assert_eq!((s.kind.as_str(), s.index, s.gpu()), ("flex", None, None));
        assert!(DeviceSpec::parse("cuda:x").is_err());
        // The CPU keeps its names; an index on a CPU backend is refused.
        assert!(check_device("flex").is_ok() && check_device("cpu").is_ok());
        assert!(check_device("flex:1").is_err());
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
