//! The GPUs of this machine, per backend: how many the driver reports, how much memory
//! each has, and which one a local rank takes (round-robin, as torchrun users expect:
//! local rank `l` of a host with `G` GPUs runs on GPU `l mod G`).
//!
//! `cuda` asks the CUDA driver through cudarc, loaded at run time (module `cuda`, in every
//! build: [`cuda_driver_count`] is what the NCCL backend places ranks by, and the `cuda`
//! feature's [`gpu_count`]): the driver is probed before burn sees the device, so a machine
//! without it gets one error naming `libcuda.so`, never a panic inside cubecl.
//!
//! `wgpu` counts the Vulkan adapters (`vulkan.rs`, feature `wgpu`: GPUs first, then a
//! software one); none at all is one error naming the Vulkan driver. A software adapter
//! (Mesa's lavapipe) is a CPU driver, not a GPU: when it is all there is, every local rank
//! shares adapter 0 ([`software_only`]), and there is no GPU to oversubscribe. wgpu reports
//! no memory size ([`gpu_memory`] is `None`), so a pipeline stage on it takes the CPU's rule.

use burn::prelude::Device;

use crate::device::device_spec::{DeviceSpec, GpuKind};
use crate::error::{EngineError, Result};

mod cuda;

/// How many GPUs of `kind` the driver reports (for `wgpu`: Vulkan adapters, a software one
/// included); an error names a missing feature or driver.
pub fn gpu_count(kind: GpuKind) -> Result<usize> {
    match kind {
        #[cfg(feature = "cuda")]
        GpuKind::Cuda => cuda_driver_count(),
        #[cfg(not(feature = "cuda"))]
        GpuKind::Cuda => Err(feature_missing(kind.name(), "cuda")),
        #[cfg(feature = "wgpu")]
        GpuKind::Wgpu => match crate::device::vulkan::adapters() {
            (0, 0) => Err(EngineError::NoVulkanAdapter { index: 0, found: 0 }),
            (gpus, software) => Ok(gpus + software),
        },
        #[cfg(not(feature = "wgpu"))]
        GpuKind::Wgpu => Err(feature_missing(kind.name(), "wgpu")),
    }
}

/// How many CUDA devices the driver reports, in any build (cudarc loads the driver at run
/// time): what the NCCL backend places ranks by, with or without burn's CUDA backend.
pub fn cuda_driver_count() -> Result<usize> {
    cuda::count().map_err(|detail| driver_error(GpuKind::Cuda.name(), detail))
}

/// Whether the only devices of `kind` are software ones (a Vulkan CPU driver such as
/// lavapipe): the local ranks then share device 0 and no launch oversubscribes a GPU.
/// Always `false` for `cuda`.
pub fn software_only(kind: GpuKind) -> Result<bool> {
    match kind {
        GpuKind::Cuda => Ok(false),
        #[cfg(feature = "wgpu")]
        GpuKind::Wgpu => {
            let (gpus, software) = crate::device::vulkan::adapters();
            Ok(gpus == 0 && software > 0)
        }
        #[cfg(not(feature = "wgpu"))]
        GpuKind::Wgpu => Err(feature_missing(kind.name(), "wgpu")),
    }
}

/// The memory GPU `index` of `kind` reports (bytes in total, what the partitioner may fill);
/// `None` for `wgpu`, which reports no memory size (a stage on it takes the CPU's rule).
pub fn gpu_memory(kind: GpuKind, index: usize) -> Result<Option<u64>> {
    let name = format!("{}:{index}", kind.name());
    check_index(kind, &name, index)?;
    match kind {
        #[cfg(feature = "cuda")]
        GpuKind::Cuda => cuda::total_memory(index)
            .map(Some)
            .map_err(|detail| driver_error(&name, detail)),
        #[cfg(not(feature = "cuda"))]
        GpuKind::Cuda => Err(feature_missing(&name, "cuda")),
        GpuKind::Wgpu => Ok(None),
    }
}

/// The device index local rank `local_rank` takes among `gpus` GPUs: round-robin.
pub fn device_index(local_rank: usize, gpus: usize) -> usize {
    local_rank % gpus.max(1)
}

/// The device a rank runs on: a GPU device named without an index (`cuda`, `wgpu`) gets its
/// local rank's GPU ([`device_index`] over the driver's count: `cuda:2`; adapter 0 for every
/// rank when [`software_only`]); anything else (an explicit index, a CPU backend) is kept
/// as named.
pub fn local_device(name: &str, local_rank: usize) -> Result<String> {
    let spec = DeviceSpec::parse(name)?;
    match (spec.gpu(), spec.index) {
        (Some(kind), None) => {
            let count = gpu_count(kind)?;
            if count == 0 {
                return Err(driver_error(name, "the driver reports no GPU".into()));
            }
            let index = if software_only(kind)? {
                0
            } else {
                device_index(local_rank, count)
            };
            Ok(format!("{}:{index}", kind.name()))
        }
        _ => Ok(name.to_string()),
    }
}

/// Checks that GPU `index` of `kind` exists (feature, driver, index) without opening it.
#[cfg_attr(not(any(feature = "cuda", feature = "wgpu")), allow(unused_variables))]
pub(crate) fn check(kind: GpuKind, name: &str, index: usize) -> Result<()> {
    match kind {
        #[cfg(feature = "cuda")]
        GpuKind::Cuda => check_index(kind, name, index),
        #[cfg(not(feature = "cuda"))]
        GpuKind::Cuda => Err(feature_missing(name, "cuda")),
        #[cfg(feature = "wgpu")]
        GpuKind::Wgpu => {
            let (gpus, software) = crate::device::vulkan::adapters();
            if index >= gpus + software {
                return Err(EngineError::NoVulkanAdapter {
                    index,
                    found: gpus + software,
                });
            }
            Ok(())
        }
        #[cfg(not(feature = "wgpu"))]
        GpuKind::Wgpu => Err(feature_missing(name, "wgpu")),
    }
}

/// burn's device for GPU `index` of `kind`, after the driver was probed and the index
/// checked, and what it is (`cuda:1`, `wgpu:0 (Vulkan adapter 0, software adapter ...)`).
pub(crate) fn device(kind: GpuKind, name: &str, index: usize) -> Result<(Device, String)> {
    check(kind, name, index)?;
    match kind {
        #[cfg(feature = "cuda")]
        GpuKind::Cuda => Ok((Device::cuda(index), format!("cuda:{index}"))),
        #[cfg(feature = "wgpu")]
        GpuKind::Wgpu => {
            let (device, what) = crate::device::vulkan::device(index)?;
            Ok((device, format!("wgpu:{index} ({what})")))
        }
        // `check` refused a backend this build lacks.
        #[allow(unreachable_patterns)]
        _ => Err(feature_missing(name, kind.name())),
    }
}

fn check_index(kind: GpuKind, name: &str, index: usize) -> Result<()> {
    let count = gpu_count(kind).map_err(|e| rename(e, name))?;
    if index >= count {
        return Err(EngineError::NoSuchGpu {
            device: name.to_string(),
            index,
            count,
        });
    }
    Ok(())
}

/// The error of [`gpu_count`] under the device name the caller used (`cuda:1`).
fn rename(e: EngineError, name: &str) -> EngineError {
    match e {
        EngineError::FeatureMissing { feature, .. } => feature_missing(name, feature),
        EngineError::GpuDriver { detail, .. } => driver_error(name, detail),
        e => e,
    }
}

fn feature_missing(device: &str, feature: &'static str) -> EngineError {
    EngineError::FeatureMissing {
        device: device.to_string(),
        feature,
    }
}

fn driver_error(device: &str, detail: String) -> EngineError {
    EngineError::GpuDriver {
        device: device.to_string(),
        detail,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_ranks_take_the_gpus_round_robin() {
        let on_two: Vec<usize> = (0..5).map(|l| device_index(l, 2)).collect();
        assert_eq!(on_two, [0, 1, 0, 1, 0]);
        assert_eq!(device_index(3, 4), 3);
        // An explicit index and the CPU stay as named.
        assert_eq!(local_device("cuda:1", 0).expect("kept"), "cuda:1");
        assert_eq!(local_device("flex", 3).expect("kept"), "flex");
    }

    /// The driver is probed for real in every build: on a machine without NVIDIA's driver
    /// (CI) the count is one error naming `libcuda.so`, not cudarc's panic; `gpu_count` and
    /// `local_device` say the same with the `cuda` feature and name the feature without it.
    #[test]
    fn the_driver_probe_names_what_is_missing() {
        let driver = "device `cuda`: the CUDA driver (libcuda.so) cannot be loaded";
        let n = match cuda_driver_count() {
            Ok(n) => n,
            Err(e) => {
                assert!(e.to_string().starts_with(driver), "{e}");
                0
            }
        };
        let missing = if cfg!(feature = "cuda") {
            driver
        } else {
            "device `cuda` needs a binary built with the `cuda` feature"
        };
        match gpu_count(GpuKind::Cuda) {
            Ok(count) => assert_eq!((count, local_device("cuda", 0).is_ok()), (n, n > 0)),
            Err(e) => {
                assert!(e.to_string().starts_with(missing), "{e}");
                let e = local_device("cuda", 1).expect_err("no GPU").to_string();
                assert!(e.starts_with(missing), "{e}");
            }
        }
    }

    /// `wgpu`: without the feature one error naming it; with it, the adapters counted, a
    /// software-only machine (lavapipe) puts every local rank on adapter 0, and no memory
    /// size is reported.
    #[test]
    fn wgpu_counts_vulkan_adapters_and_shares_a_software_one() {
        let count = gpu_count(GpuKind::Wgpu);
        if !cfg!(feature = "wgpu") {
            let e = count.expect_err("no feature").to_string();
            assert!(e.contains("the `wgpu` feature"), "{e}");
            return;
        }
        let Ok(n) = count else {
            let e = local_device("wgpu", 0).expect_err("no driver").to_string();
            assert!(e.contains("install a Vulkan driver"), "{e}");
            return;
        };
        let software = software_only(GpuKind::Wgpu).expect("counted");
        let local = local_device("wgpu", 3).expect("placed");
        let want = if software { 0 } else { device_index(3, n) };
        assert_eq!(local, format!("wgpu:{want}"));
        assert_eq!(gpu_memory(GpuKind::Wgpu, 0).expect("adapter 0"), None);
    }
}
