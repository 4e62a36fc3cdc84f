//! Where a model's parameter tensors are, as the tensors themselves report it: each
//! parameter's `Tensor::device()`, which burn reads off the tensor's backend primitive (a Flex
//! tensor, a cubecl tensor on a wgpu or CUDA device, ...), never from the device name a
//! configuration asked for. It is the evidence that an engine (or a pipeline stage) built for
//! `device: wgpu` trains on wgpu, and not on a CPU backend that would give the same numbers
//! within rounding ([`crate::ModelState::param_placement`]).

use std::fmt;

use burn::backend::DispatchDevice;
use burn::module::{Module, ModuleVisitor, Param};
use burn::prelude::*;

use crate::buffers::{Only, Tensors};
use crate::error::{EngineError, Result};
use crate::params::ParamLayout;

/// Where every parameter tensor of a model is, read from the tensors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamPlacement {
    /// The backend and device every parameter tensor's primitive belongs to: `flex`,
    /// `ndarray`, `libtorch`, `cuda:1`, `wgpu (Cpu on Vulkan)` (the wgpu adapter's kind and
    /// graphics API); an autodiff tensor names the device it wraps.
    pub device: String,
    /// How many parameter tensors were read (every one of the model's).
    pub tensors: usize,
}

impl ParamPlacement {
    /// The backend alone: [`ParamPlacement::device`] up to its first `:` or space (`flex`,
    /// `wgpu`, `cuda`).
    pub fn backend(&self) -> &str {
        self.device.split([':', ' ']).next().unwrap_or(&self.device)
    }
}

impl fmt::Display for ParamPlacement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (all {} parameter tensors)",
            self.device, self.tensors
        )
    }
}

/// Where the parameters of `model` (laid out as `layout`) are: `None` for a model without
/// parameters; [`EngineError::MixedDevices`] when a tensor is not where the first one is.
pub(crate) fn of<M: Module>(model: &M, layout: &ParamLayout) -> Result<Option<ParamPlacement>> {
    struct Devices(Vec<String>);
    impl ModuleVisitor for Devices {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push(device_label(&param.val().device()));
        }
    }
    let mut seen = Devices(Vec::new());
    model.visit(&mut Only::new(&mut seen, Tensors::Params));
    let seen = seen.0;
    let Some(first) = seen.first() else {
        return Ok(None);
    };
    let name = |i: usize| {
        layout
            .params
            .get(i)
            .map_or_else(|| format!("#{i}"), |p| p.name.clone())
    };
    if let Some((i, other)) = seen.iter().enumerate().find(|(_, d)| *d != first) {
        return Err(EngineError::MixedDevices {
            first_tensor: name(0),
            first: first.clone(),
            tensor: name(i),
            device: other.clone(),
        });
    }
    Ok(Some(ParamPlacement {
        device: first.clone(),
        tensors: seen.len(),
    }))
}

/// The backend and device of `device` (see [`ParamPlacement::device`]).
pub(crate) fn device_label(device: &Device) -> String {
    dispatch_label(device.as_dispatch())
}

fn dispatch_label(device: &DispatchDevice) -> String {
    match device {
        DispatchDevice::Autodiff(inner) => dispatch_label(inner),
        DispatchDevice::Flex(_) => "flex".to_string(),
        #[cfg(feature = "ndarray")]
        DispatchDevice::NdArray(_) => "ndarray".to_string(),
        #[cfg(feature = "libtorch")]
        DispatchDevice::LibTorch(_) => "libtorch".to_string(),
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        DispatchDevice::Cube(cube) => cube_label(cube),
        // A backend this crate does not build (a feature another crate turned on).
        #[allow(unreachable_patterns)]
        other => format!("{other:?}"),
    }
}

/// A cubecl device: `wgpu (KIND on API)`, `cuda:I`, else burn's own spelling.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn cube_label(device: &burn::backend::CubeDevice) -> String {
    use burn::backend::CubeDevice;
    match device {
        CubeDevice::Wgpu(d) => format!("wgpu ({:?} on {:?})", d.kind, d.backend),
        CubeDevice::Cuda(d) => format!("cuda:{}", d.index),
        other => format!("{other:?}"),
    }
}
