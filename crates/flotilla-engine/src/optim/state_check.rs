//! The shapes of optimizer state checked before burn takes it: a state of another model or
//! of another shard cut would otherwise reach burn's optimizer, which panics on the first
//! step whose tensors do not match (or silently pairs the wrong moments with a parameter of
//! the same size).
//!
//! burn keys a [`burn::optim::ModuleOptimizer`]'s state tensors `"{id}.{field}"` by parameter
//! id (see [`crate::optim::reshard`]); Flotilla's ids are positions in flat order, so the id says
//! which parameter (or shard piece) the tensor belongs to and which shape it must have.

use burn::store::burn_pack::{Bytes, Reader};

use crate::error::{EngineError, Result};

/// What an optimizer's parameter id `k` must hold: a name for messages and its shape.
pub(crate) struct Expected {
    /// The parameter (or shard piece) named for a user.
    pub(crate) name: String,
    /// Its shape, which every state tensor of its id has.
    pub(crate) shape: Vec<usize>,
}

/// Checks that every tensor of the optimizer state `bytes` belongs to one of `expected`
/// (indexed by parameter id) and has its shape; the first that does not is
/// [`EngineError::StateShape`], naming the tensor and both shapes.
pub(crate) fn check_state_shapes(bytes: &Bytes, expected: &[Expected]) -> Result<()> {
    let unreadable = |e| EngineError::Optimizer(format!("loading state: {e:?}"));
    // A shared `Bytes` clones without copying its data.
    let reader = Reader::from_bytes(bytes.clone()).map_err(unreadable)?;
    for tensor in reader.into_tensors().map_err(unreadable)? {
        let got = tensor.shape.to_vec();
        let id = tensor
            .name
            .split_once('.')
            .and_then(|(id, _)| id.parse::<usize>().ok());
        let Some(want) = id.and_then(|id| expected.get(id)) else {
            return Err(EngineError::StateShape {
                param: format!("no parameter (this optimizer has {})", expected.len()),
                tensor: tensor.name,
                expected: Vec::new(),
                got,
            });
        };
        if got != want.shape {
            return Err(EngineError::StateShape {
                tensor: tensor.name,
                param: want.name.clone(),
                expected: want.shape.clone(),
                got,
            });
        }
    }
    Ok(())
}
