//! Loading an MNIST-layout data set (MNIST, Fashion-MNIST, KMNIST, ...) from a directory.

use std::path::Path;

use crate::dataset::{ImageDataset, Normalization};
use crate::error::{DataError, Result};
use crate::files::{MnistFile, Split};
use crate::idx;
use crate::image_file::ImageFile;

/// The train and test splits of a data set.
#[derive(Debug, Clone, PartialEq)]
pub struct MnistSplits {
    /// The training split.
    pub train: ImageDataset,
    /// The test split.
    pub test: ImageDataset,
}

/// The train and test splits of a data set, read by sample from their files.
#[derive(Debug)]
pub struct MnistFiles {
    /// The training split.
    pub train: ImageFile,
    /// The test split.
    pub test: ImageFile,
}

/// Loader for any directory holding the four MNIST-layout IDX files.
///
/// Accepted names per file (see [`MnistFile::candidate_names`]):
/// `train-images-idx3-ubyte`, `train-images.idx3-ubyte`, each optionally with `.gz`, and
/// likewise for `train-labels-idx1-ubyte`, `t10k-images-idx3-ubyte` and
/// `t10k-labels-idx1-ubyte`. Gzip is detected from content.
#[derive(Debug, Clone, Copy, Default)]
pub struct Mnist;

impl Mnist {
    /// Loads both splits from `dir`, to be normalised with [`Normalization::MNIST`].
    ///
    /// # Errors
    /// Any [`DataError`] from locating, reading or parsing the files, or
    /// [`DataError::CountMismatch`] if a split's images and labels disagree.
    pub fn load(dir: impl AsRef<Path>) -> Result<MnistSplits> {
        Self::load_with(dir, Normalization::MNIST)
    }

    /// Loads both splits from `dir`, to be normalised with `norm`.
    ///
    /// # Errors
    /// As [`Mnist::load`].
    pub fn load_with(dir: impl AsRef<Path>, norm: Normalization) -> Result<MnistSplits> {
        let dir = dir.as_ref();
        Ok(MnistSplits {
            train: Self::load_split(dir, Split::Train, norm)?,
            test: Self::load_split(dir, Split::Test, norm)?,
        })
    }

    /// Opens both splits of `dir` to be read by sample ([`ImageFile`]), normalised with
    /// `norm`: only the labels are read now; a gzipped images file is read through its raw
    /// copy in `cache` ([`crate::raw_idx()`]).
    ///
    /// # Errors
    /// As [`Mnist::load`], and [`DataError::Io`] if the raw copy cannot be written.
    pub fn open(dir: impl AsRef<Path>, norm: Normalization, cache: &Path) -> Result<MnistFiles> {
        let dir = dir.as_ref();
        let split = |split: Split| -> Result<ImageFile> {
            let images_path = MnistFile::images(split).locate(dir)?;
            let labels = idx::read_labels(&MnistFile::labels(split).locate(dir)?)?;
            ImageFile::open(&crate::raw_idx(&images_path, cache)?, labels, norm)
        };
        Ok(MnistFiles {
            train: split(Split::Train)?,
            test: split(Split::Test)?,
        })
    }

    /// Loads one split from `dir`: its `u8` pixels, to be normalised with `norm` as they are
    /// gathered.
    ///
    /// # Errors
    /// As [`Mnist::load`].
    pub fn load_split(
        dir: impl AsRef<Path>,
        split: Split,
        norm: Normalization,
    ) -> Result<ImageDataset> {
        let dir = dir.as_ref();
        let images_path = MnistFile::images(split).locate(dir)?;
        let labels_path = MnistFile::labels(split).locate(dir)?;
        let labels = idx::read_labels(&labels_path)?;
        let images = idx::read_images(&images_path)?;
        if images.count != labels.len() {
            return Err(DataError::CountMismatch {
                images_path,
                images: images.count,
                labels_path,
                labels: labels.len(),
            });
        }
        ImageDataset::new(images.pixels, labels, images.rows, images.cols, norm)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::idx::{IMAGES_MAGIC, LABELS_MAGIC};
    use crate::testutil::{
        Style, file_name, idx_bytes, pixel, vendored_mnist_dir, write_dataset, write_file,
    };

    fn check_synthetic(splits: &MnistSplits, train: usize, test: usize) {
        assert_eq!(splits.train.len(), train);
        assert_eq!(splits.test.len(), test);
        assert_eq!((splits.train.rows(), splits.train.cols()), (3, 2));
        let ds = &splits.train;
        assert_eq!(ds.label(7), Some(7));
        assert_eq!(ds.label(12), Some(2));
        assert_eq!(ds.image(7).unwrap()[4], pixel(7, 4));
        assert_eq!(ds.normalization(), Normalization::MNIST);
    }

    #[test]
    fn both_naming_styles_raw_and_gz() {
        for style in [Style::Hyphen, Style::Dot] {
            for gz in [false, true] {
                let dir = tempfile::tempdir().unwrap();
                write_dataset(dir.path(), style, gz, 13, 4, 3, 2);
                let splits = Mnist::load(dir.path()).unwrap();
                check_synthetic(&splits, 13, 4);
            }
        }
    }

    #[test]
    fn count_mismatch_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        write_dataset(dir.path(), Style::Hyphen, true, 13, 4, 3, 2);
        let labels = file_name(MnistFile::TestLabels, Style::Hyphen, true);
        write_file(
            dir.path(),
            &labels,
            &idx_bytes(LABELS_MAGIC, &[5], &[0; 5]),
            true,
        );
        let err = Mnist::load(dir.path()).unwrap_err();
        assert!(
            matches!(
                err,
                DataError::CountMismatch {
                    images: 4,
                    labels: 5,
                    ..
                }
            ),
            "{err:?}"
        );
        let msg = err.to_string();
        assert!(
            msg.contains("t10k-images-idx3-ubyte.gz") && msg.contains("t10k-labels-idx1-ubyte.gz"),
            "{msg}"
        );
        assert!(
            msg.contains("4 images") && msg.contains("5 labels"),
            "{msg}"
        );
    }

    #[test]
    fn bad_magic_in_dataset_dir() {
        let dir = tempfile::tempdir().unwrap();
        write_dataset(dir.path(), Style::Dot, false, 3, 3, 3, 2);
        // Images and labels swapped.
        let name = file_name(MnistFile::TrainImages, Style::Dot, false);
        write_file(
            dir.path(),
            &name,
            &idx_bytes(LABELS_MAGIC, &[3], &[1, 2, 3]),
            false,
        );
        let msg = Mnist::load(dir.path()).unwrap_err().to_string();
        assert!(
            msg.contains("train-images.idx3-ubyte") && msg.contains("0x00000801"),
            "{msg}"
        );
    }

    #[test]
    fn truncated_file_in_dataset_dir() {
        let dir = tempfile::tempdir().unwrap();
        write_dataset(dir.path(), Style::Hyphen, true, 3, 3, 3, 2);
        let name = file_name(MnistFile::TrainImages, Style::Hyphen, true);
        write_file(
            dir.path(),
            &name,
            &idx_bytes(IMAGES_MAGIC, &[3, 3, 2], &[0; 10]),
            true,
        );
        let err = Mnist::load(dir.path()).unwrap_err();
        assert!(
            matches!(
                err,
                DataError::Truncated {
                    expected: 18,
                    actual: 10,
                    ..
                }
            ),
            "{err:?}"
        );
    }

    #[test]
    fn missing_file_in_dataset_dir() {
        let dir = tempfile::tempdir().unwrap();
        write_dataset(dir.path(), Style::Hyphen, false, 3, 3, 3, 2);
        std::fs::remove_file(dir.path().join("train-labels-idx1-ubyte")).unwrap();
        let err = Mnist::load(dir.path()).unwrap_err();
        let msg = err.to_string();
        assert!(
            matches!(
                err,
                DataError::MissingFile {
                    what: "train labels",
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(msg.contains("train-labels.idx1-ubyte.gz"), "{msg}");
    }

    #[test]
    fn opened_files_read_what_the_loaded_sets_hold() {
        for gz in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            write_dataset(dir.path(), Style::Hyphen, gz, 13, 4, 3, 2);
            let loaded = Mnist::load(dir.path()).unwrap();
            let files =
                Mnist::open(dir.path(), Normalization::MNIST, &dir.path().join("c")).unwrap();
            for (file, set) in [(&files.train, &loaded.train), (&files.test, &loaded.test)] {
                let all: Vec<usize> = (0..set.len()).collect();
                assert_eq!(&file.load(&all).unwrap(), set);
            }
        }
    }

    #[test]
    fn vendored_mnist_loads() {
        let splits = Mnist::load(vendored_mnist_dir()).unwrap();
        assert_eq!(splits.train.len(), 60_000);
        assert_eq!(splits.test.len(), 10_000);
        for ds in [&splits.train, &splits.test] {
            assert_eq!((ds.rows(), ds.cols()), (28, 28));
            assert_eq!(ds.pixels().len(), ds.len() * 784);
            assert_eq!(ds.num_classes(), 10);
        }
        assert_eq!(splits.train.label(0), Some(5));
        assert_eq!(splits.test.label(0), Some(7));
        // Mean/std of the normalised training pixels are ~0/~1 by construction.
        let px = splits.train.normalized_images();
        let n = px.len() as f64;
        let mean = px.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
        let var = px
            .iter()
            .map(|&x| (f64::from(x) - mean).powi(2))
            .sum::<f64>()
            / n;
        assert!(mean.abs() < 1e-3, "mean {mean}");
        assert!((var.sqrt() - 1.0).abs() < 1e-3, "std {}", var.sqrt());
    }
}
