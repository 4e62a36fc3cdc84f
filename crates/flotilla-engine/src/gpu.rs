//! The GPUs of this machine, per backend: how many the driver reports, how much memory
//! each has, and which one a local rank takes (round-robin, as torchrun users expect:
//! local rank `l` of a host with `G` GPUs runs on GPU `l mod G`).
//!
//! `cuda` asks the CUDA driver through cudarc, loaded at run time (module `cuda`, under
//! the `cuda-driver` feature, which `cuda` and the NCCL backend turn on): the driver is
//! probed before burn sees the device, so a machine without it gets one error naming
//! `libcuda.so`, never a panic inside cubecl.

use burn::prelude::Device;

use crate::device_spec::{DeviceSpec, GpuKind};
use crate::error::{EngineError, Result};

#[cfg(feature = "cuda-driver")]
mod cuda;

/// How many GPUs of `kind` the driver reports; an error names a missing feature or driver.
pub fn gpu_count(kind: GpuKind) -> Result<usize> {
    match kind {
        #[cfg(feature = "cuda-driver")]
        GpuKind::Cuda => cuda::count().map_err(|detail| driver_error(kind.name(), detail)),
        #[cfg(not(feature = "cuda-driver"))]
        GpuKind::Cuda => Err(feature_missing(kind.name(), "cuda")),
    }
}

/// The memory GPU `index` of `kind` reports (bytes in total, what the partitioner may fill).
pub fn gpu_memory(kind: GpuKind, index: usize) -> Result<u64> {
    let name = format!("{}:{index}", kind.name());
    check_index(kind, &name, index)?;
    match kind {
        #[cfg(feature = "cuda-driver")]
        GpuKind::Cuda => cuda::total_memory(index).map_err(|detail| driver_error(&name, detail)),
        #[cfg(not(feature = "cuda-driver"))]
        GpuKind::Cuda => Err(feature_missing(&name, "cuda")),
    }
}

/// The device index local rank `local_rank` takes among `gpus` GPUs: round-robin.
pub fn device_index(local_rank: usize, gpus: usize) -> usize {
    local_rank % gpus.max(1)
}

/// The device a rank runs on: a GPU device named without an index (`cuda`) gets its local
/// rank's GPU ([`device_index`] over the driver's count: `cuda:2`); anything else (an
/// explicit index, a CPU backend) is kept as named.
pub fn local_device(name: &str, local_rank: usize) -> Result<String> {
    let spec = DeviceSpec::parse(name)?;
    match (spec.gpu(), spec.index) {
        (Some(kind), None) => {
            let count = gpu_count(kind)?;
            if count == 0 {
                return Err(driver_error(name, "the driver reports no GPU".into()));
            }
            Ok(format!(
                "{}:{}",
                kind.name(),
                device_index(local_rank, count)
            ))
        }
        _ => Ok(name.to_string()),
    }
}

/// burn's device for GPU `index` of `kind`, after the driver was probed and the index checked.
pub(crate) fn device(kind: GpuKind, name: &str, index: usize) -> Result<Device> {
    match kind {
        #[cfg(feature = "cuda")]
        GpuKind::Cuda => {
            check_index(kind, name, index)?;
            Ok(Device::cuda(index))
        }
        #[cfg(not(feature = "cuda"))]
        GpuKind::Cuda => {
            let _ = index;
            Err(feature_missing(name, "cuda"))
        }
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

    /// The driver is probed for real (`--features cuda-driver`, CI): on a machine without
    /// NVIDIA's driver the count is one error naming `libcuda.so`, not cudarc's panic; in a
    /// build without the feature, one naming the feature.
    #[test]
    fn the_driver_probe_names_what_is_missing() {
        match gpu_count(GpuKind::Cuda) {
            Ok(n) => assert_eq!(local_device("cuda", 0).is_ok(), n > 0),
            Err(e) => {
                let e = e.to_string();
                let missing = if cfg!(feature = "cuda-driver") {
                    "device `cuda`: the CUDA driver (libcuda.so) cannot be loaded"
                } else {
                    "device `cuda` needs a binary built with the `cuda` feature"
                };
                assert!(e.starts_with(missing), "{e}");
                let e = local_device("cuda", 1).expect_err("no GPU").to_string();
                assert!(e.starts_with(missing), "{e}");
            }
        }
    }
}
