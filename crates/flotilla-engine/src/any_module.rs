//! The bridge between a burn user's own module and Flotilla's flat buffers.
//!
//! Flotilla's own spec models go through [`crate::Engine`]; a user who writes a model in plain
//! burn (`#[derive(Module)]`) and runs their own loop needs the same flat views of *their*
//! module: its parameter layout (names as PyTorch would give them, shapes, offsets), its
//! parameters read into and written from a flat `f32` buffer, its gradients (burn's
//! [`GradientsParams`]) gathered into and scattered from flat buckets, and its weights saved in
//! safetensors under the module's own names. This is the one place where burn types cross the
//! engine's public boundary, on purpose: it is what `flotilla-burn` (the user-facing data
//! parallel API) is built on, and the functions are generic over any [`Module`].

use std::ops::Range;
use std::path::Path;

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::store::{BurnToPyTorchAdapter, ModuleSnapshot, PyTorchToBurnAdapter, SafetensorsStore};
use burn::tensor::TensorData;

use crate::buffers::{Only, Tensors};
use crate::error::{EngineError, Result};
use crate::params::ParamLayout;

pub use crate::params::{param_ids, renumber};

/// Copies every parameter of `model` (not its buffers) into `out`, in the flat order of
/// `layout` ([`ParamLayout::of`]).
pub fn read_params<M: Module>(model: &M, layout: &ParamLayout, out: &mut [f32]) -> Result<()> {
    crate::params::read_values(model, layout, out, Tensors::Params)
}

/// `model` with every parameter replaced by the values of `src` (flat order of `layout`),
/// keeping parameter ids (so optimizer state stays attached) and gradient requirements.
pub fn write_params<M: Module>(model: M, layout: &ParamLayout, src: &[f32]) -> Result<M> {
    crate::params::write_values(model, layout, src, Tensors::Params)
}

/// The layout of `model`'s buffers (batch norm's running statistics), empty without any.
pub fn buffer_layout<M: Module>(model: &M) -> ParamLayout {
    ParamLayout::of_tensors(model, Tensors::Buffers)
}

/// Copies every buffer of `model` into `out`, in the order of [`buffer_layout`].
pub fn read_buffers<M: Module>(model: &M, layout: &ParamLayout, out: &mut [f32]) -> Result<()> {
    crate::params::read_values(model, layout, out, Tensors::Buffers)
}

/// `model` with every buffer replaced by the values of `src` (order of [`buffer_layout`]).
pub fn write_buffers<M: Module>(model: M, layout: &ParamLayout, src: &[f32]) -> Result<M> {
    crate::params::write_values(model, layout, src, Tensors::Buffers)
}

/// Moves the gradients of the parameters with index in `params` (flat order) out of `grads`
/// into `out`, which holds exactly those parameters' values, in flat order. A parameter with
/// no gradient (unused in the forward pass, or frozen) gives zeros, so every rank fills the
/// same buffer whatever its batch used.
pub fn take_grads<M: Module>(
    model: &M,
    grads: &mut GradientsParams,
    layout: &ParamLayout,
    params: Range<usize>,
    out: &mut [f32],
) -> Result<()> {
    let expected = span_len(layout, &params)?;
    if out.len() != expected {
        return Err(EngineError::FlatLength {
            expected,
            got: out.len(),
        });
    }
    struct Taker<'a> {
        grads: &'a mut GradientsParams,
        params: Range<usize>,
        index: usize,
        out: &'a mut [f32],
        offset: usize,
        error: Option<EngineError>,
    }
    impl ModuleVisitor for Taker<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let index = self.index;
            self.index += 1;
            if self.error.is_some() || !self.params.contains(&index) {
                return;
            }
            let len = param.lazy_shape().num_elements();
            let dst = &mut self.out[self.offset..self.offset + len];
            self.offset += len;
            match self.grads.remove::<D>(param.id) {
                Some(g) => {
                    if let Err(e) = crate::params::copy_tensor(g, dst) {
                        self.error = Some(e);
                    }
                }
                None => dst.fill(0.0),
            }
        }
    }
    let mut taker = Taker {
        grads,
        params,
        index: 0,
        out,
        offset: 0,
        error: None,
    };
    // Buffers (batch norm's running statistics) are not parameters and have no gradient.
    model.visit(&mut Only::new(&mut taker, Tensors::Params));
    taker.error.map_or(Ok(()), Err)
}

/// Registers in `grads` one gradient per parameter with index in `params` that requires a
/// gradient, read from `flat` (exactly those parameters' values, flat order), on the
/// parameter's own device (without autodiff, as burn's optimizers expect).
pub fn put_grads<M: Module>(
    model: &M,
    grads: &mut GradientsParams,
    layout: &ParamLayout,
    params: Range<usize>,
    flat: &[f32],
) -> Result<()> {
    let expected = span_len(layout, &params)?;
    if flat.len() != expected {
        return Err(EngineError::FlatLength {
            expected,
            got: flat.len(),
        });
    }
    struct Putter<'a> {
        grads: &'a mut GradientsParams,
        params: Range<usize>,
        index: usize,
        flat: &'a [f32],
        offset: usize,
    }
    impl ModuleVisitor for Putter<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let index = self.index;
            self.index += 1;
            if !self.params.contains(&index) {
                return;
            }
            let shape = param.lazy_shape();
            let len = shape.num_elements();
            let values = self.flat[self.offset..self.offset + len].to_vec();
            self.offset += len;
            if !param.is_require_grad() {
                return;
            }
            let device = param.lazy_device().inner();
            let tensor = Tensor::<D>::from_data(TensorData::new(values, shape), &device);
            self.grads.register(param.id, tensor);
        }
    }
    let mut putter = Putter {
        grads,
        params,
        index: 0,
        flat,
        offset: 0,
    };
    model.visit(&mut Only::new(&mut putter, Tensors::Params));
    Ok(())
}

/// Number of values of the parameters with index in `params`.
fn span_len(layout: &ParamLayout, params: &Range<usize>) -> Result<usize> {
    layout
        .params
        .get(params.clone())
        .map(|ps| ps.iter().map(|p| p.len).sum())
        .ok_or(EngineError::FlatLength {
            expected: layout.params.len(),
            got: params.end,
        })
}

/// Writes `model`'s parameters as safetensors in PyTorch's layout (linear weights
/// `[out, in]`), each under the module's own dotted name (`encoder.0.weight`), with the
/// given metadata entries.
pub fn save_module<M: Module>(model: &M, path: &Path, metadata: &[(String, String)]) -> Result<()> {
    let store = SafetensorsStore::from_file(path).overwrite(true);
    save_into(model, store, metadata, path).map(|_| ())
}

/// [`save_module`] into memory: the bytes of the safetensors file it would write.
pub fn module_bytes<M: Module>(model: &M, metadata: &[(String, String)]) -> Result<Vec<u8>> {
    let store = save_into(
        model,
        SafetensorsStore::from_bytes(None),
        metadata,
        in_memory(),
    )?;
    store.get_bytes().map_err(|e| EngineError::Checkpoint {
        path: in_memory().to_path_buf(),
        message: e.to_string(),
    })
}

/// The name of weights kept in memory, in errors.
fn in_memory() -> &'static Path {
    Path::new("<weights in memory>")
}

/// Saves `model` into `store` (PyTorch's layout and names, `metadata` added); `path` names
/// it in errors.
fn save_into<M: Module>(
    model: &M,
    store: SafetensorsStore,
    metadata: &[(String, String)],
    path: &Path,
) -> Result<SafetensorsStore> {
    let mut store = store
        .with_to_adapter(BurnToPyTorchAdapter)
        .skip_enum_variants(true);
    for (key, value) in metadata {
        store = store.metadata(key, value.clone());
    }
    // `valid()` settles pending updates of buffers such as batch norm's running statistics.
    model
        .valid()
        .save_into(&mut store)
        .map_err(|e| EngineError::Checkpoint {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
    Ok(store)
}

/// `model` with its parameters read from a safetensors file written by [`save_module`] (or
/// by PyTorch, same names). Every parameter of the model must be in the file; tensors the
/// model does not have are ignored. The model is loaded into a copy, returned only on success;
/// but burn's copies share batch norm's running statistics, so a failed load may have changed
/// those in `model` too (the engine's own `load_weights` puts them back).
pub fn load_module<M: Module>(model: &M, path: &Path) -> Result<M> {
    load_from(model, SafetensorsStore::from_file(path), path)
}

/// [`load_module`] from the bytes of a safetensors file ([`module_bytes`]).
pub fn load_module_bytes<M: Module>(model: &M, bytes: &[u8]) -> Result<M> {
    let store = SafetensorsStore::from_bytes(Some(bytes.to_vec()));
    load_from(model, store, in_memory())
}

/// `model` with its parameters read from `store`; `path` names it in errors.
fn load_from<M: Module>(model: &M, store: SafetensorsStore, path: &Path) -> Result<M> {
    let mut store = store
        .with_from_adapter(PyTorchToBurnAdapter)
        .skip_enum_variants(true)
        .validate(true)
        .allow_partial(false);
    let mut candidate = model.clone();
    let applied = candidate
        .load_from(&mut store)
        .map_err(|e| EngineError::Checkpoint {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
    if !applied.errors.is_empty() || !applied.missing.is_empty() {
        return Err(EngineError::Checkpoint {
            path: path.to_path_buf(),
            message: format!("{applied}"),
        });
    }
    Ok(candidate)
}
