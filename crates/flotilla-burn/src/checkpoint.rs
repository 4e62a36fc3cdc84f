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

/// `model` with its parameters read from `path`: a file [`save`] wrote, a run's
/// [`crate::Session::save_model`] or a checkpoint's `model.safetensors` (or PyTorch's, under
/// the same names). Every parameter of the module must be in the file; a missing or misshapen
/// one is an error and leaves nothing half loaded.
pub fn load<M: Module>(model: &M, path: &Path) -> Result<M> {
    Ok(any_module::load_module(model, path)?)
}

#[cfg(test)]
mod tests {
    use burn::module::Module;
    use burn::nn::{Linear, LinearConfig};
    use burn::prelude::*;

    /// A module's parameters in visiting order.
    fn values(l: &Linear) -> Vec<f32> {
        let mut v = l.weight.val().into_data().try_to_vec::<f32>().expect("f32");
        if let Some(b) = &l.bias {
            v.extend(b.val().into_data().try_to_vec::<f32>().expect("f32"));
        }
        v
    }

    #[test]
    fn a_saved_module_loads_into_another_of_its_shape_and_not_into_a_misshapen_one() {
        let device = Device::default();
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("net.safetensors");
        let trained = LinearConfig::new(3, 2).init(&device);
        super::save(&trained, &path).expect("saved");
        let fresh = LinearConfig::new(3, 2).init(&device);
        assert_ne!(values(&fresh), values(&trained));
        let loaded = super::load(&fresh, &path).expect("loaded");
        assert_eq!(values(&loaded), values(&trained));
        assert_eq!(loaded.num_params(), trained.num_params());
        let wider = LinearConfig::new(4, 2).init(&device);
        assert!(super::load(&wider, &path).is_err());
    }
}
