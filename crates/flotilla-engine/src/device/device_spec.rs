//! Device names: a backend and, for a GPU, an optional index (`cuda`, `cuda:1`, `wgpu:0`).

use crate::error::{EngineError, Result};

/// A device name taken apart: the backend and, for a GPU, the device index (`cuda:1`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceSpec {
    /// The backend's name (`flex`, `cuda`, ...).
    pub kind: String,
    /// The device index after a `:`; `None` when not given (a GPU then takes index 0).
    pub index: Option<usize>,
}

impl DeviceSpec {
    /// Parses `kind` or `kind:index`.
    pub fn parse(name: &str) -> Result<Self> {
        let (kind, index) = match name.split_once(':') {
            Some((kind, i)) => {
                let index = i
                    .trim()
                    .parse()
                    .map_err(|_| EngineError::UnknownDevice(name.into()))?;
                (kind, Some(index))
            }
            None => (name, None),
        };
        Ok(Self {
            kind: kind.trim().to_string(),
            index,
        })
    }

    /// The GPU backend this names, if any.
    pub fn gpu(&self) -> Option<GpuKind> {
        GpuKind::from_name(&self.kind)
    }
}

/// A GPU backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuKind {
    /// NVIDIA GPUs through burn's CUDA backend (feature `cuda`).
    Cuda,
    /// Vulkan adapters through burn's wgpu backend (feature `wgpu`): GPUs first, then a
    /// software adapter such as Mesa's lavapipe.
    Wgpu,
}

impl GpuKind {
    /// The GPU backend a device's kind names (`cuda`, `wgpu`), if any.
    pub fn from_name(kind: &str) -> Option<Self> {
        match kind {
            "cuda" => Some(Self::Cuda),
            "wgpu" => Some(Self::Wgpu),
            _ => None,
        }
    }

    /// The backend's device name (`cuda`, `wgpu`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Cuda => "cuda",
            Self::Wgpu => "wgpu",
        }
    }
}
