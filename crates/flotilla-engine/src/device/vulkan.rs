//! burn's wgpu backend pinned to Vulkan (the `wgpu` feature): the adapters the machine's
//! Vulkan driver offers, GPUs first (discrete, integrated, virtual), then a software one
//! (Mesa's lavapipe), counted across kinds; index `N` is the `N`-th of them. Each adapter is
//! opened once per process (wgpu registers a runtime per device) and kept.
//!
//! Tensors live on the device; what crosses to the host (parameters, gradients, buffers as
//! flat `f32` buffers) is read back by burn's `into_data`, and what comes back is uploaded by
//! `from_data`.

use std::sync::Mutex;

use burn::backend::{CubeDevice, DeviceOps, WgpuBackend, WgpuDevice, WgpuDeviceKind};
use burn::prelude::Device;
use burn::tensor::DeviceKind;

use crate::error::{EngineError, Result};

/// The adapters' kinds in the order indices count them: GPUs before a software adapter.
const KINDS: [WgpuDeviceKind; 4] = [
    WgpuDeviceKind::DiscreteGpu(0),
    WgpuDeviceKind::IntegratedGpu(0),
    WgpuDeviceKind::VirtualGpu(0),
    WgpuDeviceKind::Cpu,
];

/// How many Vulkan adapters of each kind of [`KINDS`] the machine offers.
fn counts() -> [usize; 4] {
    KINDS.map(|kind| {
        let seed = CubeDevice::Wgpu(WgpuDevice::new(kind).on(WgpuBackend::Vulkan));
        CubeDevice::enumerate(seed.id()).len()
    })
}

/// How many Vulkan adapters the machine offers: GPUs (discrete, integrated, virtual) and
/// software ones (lavapipe); `(0, 0)` without a driver.
pub(crate) fn adapters() -> (usize, usize) {
    let counts = counts();
    (counts[..3].iter().sum(), counts[3])
}

/// The selector of the `index`-th adapter (of the first `kinds` kinds), and what it is.
fn selector(index: usize, counts: &[usize; 4], kinds: usize) -> Option<(DeviceKind, String)> {
    let mut first = 0;
    for (k, &n) in counts.iter().enumerate().take(kinds) {
        if index < first + n {
            let i = index - first;
            return Some(match k {
                0 => (DeviceKind::DiscreteGpu(i), format!("discrete GPU {i}")),
                1 => (DeviceKind::IntegratedGpu(i), format!("integrated GPU {i}")),
                2 => (DeviceKind::VirtualGpu(i), format!("virtual GPU {i}")),
                _ => (
                    DeviceKind::Cpu,
                    "software adapter (e.g. lavapipe)".to_string(),
                ),
            });
        }
        first += n;
    }
    None
}

/// An opened adapter: the device and what it is.
pub(crate) type Opened = (Device, String);

/// The adapters opened so far, by index.
static OPENED: Mutex<Vec<(usize, Opened)>> = Mutex::new(Vec::new());

/// Opens (once) the adapter `index`, of `selector`.
fn open(index: usize, (selector, what): (DeviceKind, String)) -> Result<Opened> {
    let mut opened = OPENED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some((_, found)) = opened.iter().find(|(i, _)| *i == index) {
        return Ok(found.clone());
    }
    let device = Device::wgpu_options()
        .device_kind(selector)
        .graphics_api(WgpuBackend::Vulkan)
        .init()
        .map_err(|e| EngineError::VulkanInit {
            index,
            message: e.to_string(),
        })?;
    let found = (device, format!("Vulkan adapter {index}, {what}"));
    opened.push((index, found.clone()));
    Ok(found)
}

/// The `index`-th Vulkan adapter (GPUs first, then a software one), opened.
pub(crate) fn device(index: usize) -> Result<Opened> {
    let counts = counts();
    let selector = selector(index, &counts, KINDS.len()).ok_or(EngineError::NoVulkanAdapter {
        index,
        found: counts.iter().sum(),
    })?;
    open(index, selector)
}

/// The `index`-th Vulkan GPU, opened, or why there is none usable (a software adapter such
/// as lavapipe does not count: the CPU backend is faster than it).
pub(crate) fn gpu(index: usize) -> std::result::Result<Opened, String> {
    let counts = counts();
    let gpus: usize = counts[..3].iter().sum();
    let Some(selector) = selector(index, &counts, 3) else {
        let software = if counts[3] > 0 {
            "; a software Vulkan adapter (lavapipe) is slower than the CPU backend: name `device: wgpu` to use it anyway"
        } else {
            ""
        };
        return Err(format!(
            "{gpus} Vulkan GPU(s), none at index {index}{software}"
        ));
    };
    open(index, selector).map_err(|e| e.to_string())
}
