//! Checkpoints of a user's module: safetensors under the module's own names.

use std::path::Path;

use burn::module::Module;
use flotilla_engine::any_module;

use crate::error::{DistError, Result};

/// Writes `model`'s parameters as safetensors under the module's own names (PyTorch's
/// layout), atomically (a temporary file renamed into place): what [`crate::DataParallel::save`] does
/// on rank 0, for a rank that holds the model alone (a parameter server's rank 0).
pub fn save<M: Module>(model: &M, path: &Path) -> Result<()> {
    let tmp = path.with_extension("safetensors.tmp");
    any_module::save_module(model, &tmp, &[])?;
    std::fs::rename(&tmp, path).map_err(|source| DistError::Write {
        path: path.to_path_buf(),
        source,
    })
}
