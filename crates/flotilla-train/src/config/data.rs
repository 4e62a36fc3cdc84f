//! The `data:` section: the data set and batching. `path` names an MNIST-layout directory,
//! or a text file as `text:FILE` ([`DataSource`]).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The prefix of a text data set's `data.path`.
pub const TEXT_PREFIX: &str = "text:";

/// The data set and batching.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataSection {
    /// Directory holding the four MNIST-layout IDX files, or `text:FILE`: a text file as
    /// next-token windows of bytes (the model's input length is the window).
    pub path: PathBuf,
    /// Samples per step on each rank (the global batch is `batch_size * world_size`); for a
    /// text, windows.
    pub batch_size: usize,
    /// Use only the first `train_limit` training samples (for quick runs and tests).
    pub train_limit: Option<usize>,
    /// Evaluate on only the first `test_limit` test samples (or validation windows of a
    /// text): quicker evaluations, on a subset.
    pub test_limit: Option<usize>,
}

impl Default for DataSection {
    fn default() -> Self {
        Self {
            path: PathBuf::from("data/mnist"),
            batch_size: 64,
            train_limit: None,
            test_limit: None,
        }
    }
}

/// What `data.path` names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DataSource {
    /// A directory of the four MNIST-layout IDX files.
    Mnist(PathBuf),
    /// A text file (`text:FILE`): byte tokens, its last tenth validates.
    Text(PathBuf),
}

impl DataSource {
    /// The file or directory read.
    pub fn path(&self) -> &Path {
        match self {
            DataSource::Mnist(p) | DataSource::Text(p) => p,
        }
    }

    /// The same kind of source at `path` (e.g. made absolute).
    pub fn at(&self, path: PathBuf) -> DataSource {
        match self {
            DataSource::Mnist(_) => DataSource::Mnist(path),
            DataSource::Text(_) => DataSource::Text(path),
        }
    }

    /// How `data.path` writes this source.
    pub fn to_path(&self) -> PathBuf {
        match self {
            DataSource::Mnist(p) => p.clone(),
            DataSource::Text(p) => {
                let mut s = std::ffi::OsString::from(TEXT_PREFIX);
                s.push(p);
                PathBuf::from(s)
            }
        }
    }
}

impl DataSection {
    /// The data set `path` names.
    pub fn source(&self) -> DataSource {
        match self.path.to_str().and_then(|s| s.strip_prefix(TEXT_PREFIX)) {
            Some(file) => DataSource::Text(PathBuf::from(file)),
            None => DataSource::Mnist(self.path.clone()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_text_path_is_prefixed_and_round_trips() {
        let mut d = DataSection::default();
        assert_eq!(d.source(), DataSource::Mnist("data/mnist".into()));
        d.path = "text:data/text/kjv.txt".into();
        let s = d.source();
        assert_eq!(s, DataSource::Text("data/text/kjv.txt".into()));
        assert_eq!(s.path(), Path::new("data/text/kjv.txt"));
        let abs = s.at("/w/kjv.txt".into());
        assert_eq!(abs.to_path(), PathBuf::from("text:/w/kjv.txt"));
    }
}
