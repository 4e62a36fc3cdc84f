//! The `data:` section: the data set and batching.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// The data set and batching.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataSection {
    /// Directory holding the four MNIST-layout IDX files.
    pub path: PathBuf,
    /// Samples per step on each rank (the global batch is `batch_size * world_size`).
    pub batch_size: usize,
    /// Use only the first `train_limit` training samples (for quick runs and tests).
    pub train_limit: Option<usize>,
}

impl Default for DataSection {
    fn default() -> Self {
        Self {
            path: PathBuf::from("data/mnist"),
            batch_size: 64,
            train_limit: None,
        }
    }
}
