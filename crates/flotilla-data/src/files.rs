//! The four files of an MNIST-layout data set and how to find them on disk.

use std::fmt;
use std::path::{Path, PathBuf};

use crate::error::{DataError, Result};

/// Which part of a data set a file or dataset belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Split {
    /// The training split (`train-*`, 60 000 samples for MNIST).
    Train,
    /// The test split (`t10k-*`, 10 000 samples for MNIST).
    Test,
}

/// One of the four files of an MNIST-layout data set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MnistFile {
    /// `train-images-idx3-ubyte`
    TrainImages,
    /// `train-labels-idx1-ubyte`
    TrainLabels,
    /// `t10k-images-idx3-ubyte`
    TestImages,
    /// `t10k-labels-idx1-ubyte`
    TestLabels,
}

impl MnistFile {
    /// All four files, in the order train images, train labels, test images, test labels.
    pub const ALL: [MnistFile; 4] = [
        MnistFile::TrainImages,
        MnistFile::TrainLabels,
        MnistFile::TestImages,
        MnistFile::TestLabels,
    ];

    /// The images file of `split`.
    pub fn images(split: Split) -> Self {
        match split {
            Split::Train => MnistFile::TrainImages,
            Split::Test => MnistFile::TestImages,
        }
    }

    /// The labels file of `split`.
    pub fn labels(split: Split) -> Self {
        match split {
            Split::Train => MnistFile::TrainLabels,
            Split::Test => MnistFile::TestLabels,
        }
    }

    /// Short description used in messages, e.g. `"train images"`.
    pub fn describe(self) -> &'static str {
        match self {
            MnistFile::TrainImages => "train images",
            MnistFile::TrainLabels => "train labels",
            MnistFile::TestImages => "test images",
            MnistFile::TestLabels => "test labels",
        }
    }

    /// The two accepted uncompressed base names: the original hyphenated one
    /// (`train-images-idx3-ubyte`) and the dotted variant (`train-images.idx3-ubyte`).
    pub fn base_names(self) -> [&'static str; 2] {
        match self {
            MnistFile::TrainImages => ["train-images-idx3-ubyte", "train-images.idx3-ubyte"],
            MnistFile::TrainLabels => ["train-labels-idx1-ubyte", "train-labels.idx1-ubyte"],
            MnistFile::TestImages => ["t10k-images-idx3-ubyte", "t10k-images.idx3-ubyte"],
            MnistFile::TestLabels => ["t10k-labels-idx1-ubyte", "t10k-labels.idx1-ubyte"],
        }
    }

    /// Every file name tried by [`MnistFile::locate`], in order of preference: each base
    /// name uncompressed first, then with `.gz`.
    pub fn candidate_names(self) -> Vec<String> {
        self.base_names()
            .iter()
            .flat_map(|b| [(*b).to_owned(), format!("{b}.gz")])
            .collect()
    }

    /// Finds this file in `dir`, trying [`MnistFile::candidate_names`] in order.
    ///
    /// Whether the file is actually compressed is decided later from its content, not
    /// from its name.
    ///
    /// # Errors
    /// [`DataError::MissingFile`] listing the directory and every name tried.
    pub fn locate(self, dir: &Path) -> Result<PathBuf> {
        let tried = self.candidate_names();
        tried
            .iter()
            .map(|name| dir.join(name))
            .find(|p| p.is_file())
            .ok_or_else(|| DataError::MissingFile {
                what: self.describe(),
                dir: dir.to_path_buf(),
                tried,
            })
    }
}

impl fmt::Display for MnistFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.base_names()[0])
    }
}

impl fmt::Display for Split {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Split::Train => "train",
            Split::Test => "test",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_file_lists_names_and_dir() {
        let dir = tempfile::tempdir().unwrap();
        let err = MnistFile::TestLabels.locate(dir.path()).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("test labels"), "{msg}");
        assert!(msg.contains(&dir.path().display().to_string()), "{msg}");
        for name in [
            "t10k-labels-idx1-ubyte",
            "t10k-labels-idx1-ubyte.gz",
            "t10k-labels.idx1-ubyte",
            "t10k-labels.idx1-ubyte.gz",
        ] {
            assert!(msg.contains(name), "{msg}");
        }
    }

    #[test]
    fn locate_prefers_uncompressed_hyphenated() {
        let dir = tempfile::tempdir().unwrap();
        for name in ["train-images.idx3-ubyte.gz", "train-images-idx3-ubyte.gz"] {
            std::fs::write(dir.path().join(name), b"x").unwrap();
        }
        let p = MnistFile::TrainImages.locate(dir.path()).unwrap();
        assert!(p.ends_with("train-images-idx3-ubyte.gz"));
        std::fs::write(dir.path().join("train-images-idx3-ubyte"), b"x").unwrap();
        let p = MnistFile::TrainImages.locate(dir.path()).unwrap();
        assert!(p.ends_with("train-images-idx3-ubyte"));
    }
}
