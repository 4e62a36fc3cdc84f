//! An image split read by sample from its IDX file: the file stays on disk (in the page
//! cache, shared by every process that reads it), the process holds only the labels and
//! the samples it loads ([`ImageFile::load`]: a rank's shard of an epoch, as `u8`).
//!
//! Reads are positioned (`pread`), so one open file serves any thread without a shared
//! cursor; a gzipped file is read through its raw copy ([`mod@crate::raw_idx`]).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::dataset::{ImageDataset, Normalization};
use crate::error::{DataError, Result};
use crate::idx::{self, IMAGES_MAGIC, MAX_HEADER_BYTES};

/// Single-channel `rows × cols` images with `u8` class labels, read from an IDX images file
/// by position; see the [module docs](self).
#[derive(Debug)]
pub struct ImageFile {
    file: File,
    path: PathBuf,
    /// Where the first image starts in the file.
    offset: u64,
    rows: usize,
    cols: usize,
    labels: Vec<u8>,
    norm: Normalization,
}

impl ImageFile {
    /// Opens the raw IDX images file `images` (checked: magic, dimensions, length) with the
    /// labels `labels` (one per image), to be normalised with `norm` as samples are read.
    ///
    /// # Errors
    /// [`DataError::Io`] if the file cannot be read, the header errors of
    /// [`idx::parse_header`], [`DataError::BadDimensions`] for an image without pixels,
    /// [`DataError::InconsistentBuffers`] if the counts of images and labels differ.
    pub fn open(images: &Path, labels: Vec<u8>, norm: Normalization) -> Result<Self> {
        let io = |source| DataError::Io {
            path: images.to_path_buf(),
            source,
        };
        let file = File::open(images).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        let mut head = vec![0u8; MAX_HEADER_BYTES.min(usize::try_from(len).unwrap_or(0))];
        file.read_exact_at(&mut head, 0).map_err(io)?;
        let (dims, offset) = idx::parse_header_of(&head, len, IMAGES_MAGIC, images)?;
        let &[count, rows, cols] = dims.as_slice() else {
            return Err(bad_dims(images, &dims, "images must be 3-D"));
        };
        if rows == 0 || cols == 0 {
            return Err(bad_dims(images, &dims, "images must have pixels"));
        }
        if count != labels.len() {
            return Err(DataError::InconsistentBuffers(format!(
                "{} holds {count} images but there are {} labels",
                images.display(),
                labels.len()
            )));
        }
        Ok(ImageFile {
            file,
            path: images.to_path_buf(),
            offset: offset as u64,
            rows,
            cols,
            labels,
            norm,
        })
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// `true` if there are no samples.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Rows per image.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns per image.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Pixels per image.
    pub fn image_size(&self) -> usize {
        self.rows * self.cols
    }

    /// The normalisation readers apply.
    pub fn normalization(&self) -> Normalization {
        self.norm
    }

    /// All labels, one per sample (the only part of the set held in memory).
    pub fn labels(&self) -> &[u8] {
        &self.labels
    }

    /// Number of classes, `max(label) + 1`.
    pub fn num_classes(&self) -> usize {
        self.labels.iter().max().map_or(0, |&m| usize::from(m) + 1)
    }

    /// Keeps only the first `n` samples (no-op if `n >= len`).
    pub fn truncate(&mut self, n: usize) {
        self.labels.truncate(n);
        self.labels.shrink_to_fit();
    }

    /// Reads the samples `indices` into a data set of their own: its sample `i` is sample
    /// `indices[i]` of the file. The file is read in ascending position whatever the order
    /// of `indices`.
    ///
    /// # Errors
    /// [`DataError::IndexOutOfRange`] for an index `>= len()`, [`DataError::Io`] if a read
    /// fails.
    pub fn load(&self, indices: &[usize]) -> Result<ImageDataset> {
        let size = self.image_size();
        let mut pixels = vec![0u8; indices.len() * size];
        let mut labels = Vec::with_capacity(indices.len());
        for &i in indices {
            labels.push(*self.labels.get(i).ok_or(DataError::IndexOutOfRange {
                index: i,
                len: self.len(),
            })?);
        }
        let mut order: Vec<usize> = (0..indices.len()).collect();
        order.sort_unstable_by_key(|&slot| indices[slot]);
        for slot in order {
            self.read_image(indices[slot], &mut pixels[slot * size..(slot + 1) * size])?;
        }
        ImageDataset::new(pixels, labels, self.rows, self.cols, self.norm)
    }

    /// Reads the raw pixels of image `index` (in range) into `out` (`image_size` bytes).
    fn read_image(&self, index: usize, out: &mut [u8]) -> Result<()> {
        let at = self.offset + (index * self.image_size()) as u64;
        self.file
            .read_exact_at(out, at)
            .map_err(|source| DataError::Io {
                path: self.path.clone(),
                source,
            })
    }
}

/// The [`DataError::BadDimensions`] of an images file.
fn bad_dims(path: &Path, dims: &[usize], reason: &'static str) -> DataError {
    DataError::BadDimensions {
        path: path.to_path_buf(),
        dims: dims
            .iter()
            .map(|&d| u32::try_from(d).unwrap_or(u32::MAX))
            .collect(),
        reason,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{idx_bytes, write_file};

    fn file(dir: &Path, count: u32) -> ImageFile {
        let pixels: Vec<u8> = (0..count * 6).map(|p| (p * 13 % 256) as u8).collect();
        let path = write_file(
            dir,
            "images",
            &idx_bytes(IMAGES_MAGIC, &[count, 2, 3], &pixels),
            false,
        );
        let labels = (0..count).map(|i| (i % 10) as u8).collect();
        ImageFile::open(&path, labels, Normalization::MNIST).expect("open")
    }

    #[test]
    fn loaded_samples_are_the_in_memory_sets_in_the_given_order() {
        let dir = tempfile::tempdir().expect("dir");
        let f = file(dir.path(), 20);
        let whole = f.load(&(0..20).collect::<Vec<_>>()).expect("whole");
        assert_eq!(whole.len(), 20);
        let pick = [17, 3, 3, 0, 19];
        let got = f.load(&pick).expect("load");
        assert_eq!(got.len(), pick.len());
        for (slot, &i) in pick.iter().enumerate() {
            assert_eq!(got.image(slot), whole.image(i), "slot {slot}");
            assert_eq!(got.label(slot), whole.label(i));
        }
        assert_eq!(got.normalization(), Normalization::MNIST);
        assert!(matches!(
            f.load(&[20]),
            Err(DataError::IndexOutOfRange { index: 20, len: 20 })
        ));
    }

    #[test]
    fn a_short_file_or_a_count_mismatch_is_refused() {
        let dir = tempfile::tempdir().expect("dir");
        let path = write_file(
            dir.path(),
            "short",
            &idx_bytes(IMAGES_MAGIC, &[3, 2, 3], &[0; 17]),
            false,
        );
        let err = ImageFile::open(&path, vec![0; 3], Normalization::UNIT).expect_err("short");
        assert!(matches!(
            err,
            DataError::Truncated {
                expected: 18,
                actual: 17,
                ..
            }
        ));
        let path = write_file(
            dir.path(),
            "ok",
            &idx_bytes(IMAGES_MAGIC, &[3, 2, 3], &[0; 18]),
            false,
        );
        let err = ImageFile::open(&path, vec![0; 4], Normalization::UNIT).expect_err("labels");
        assert!(matches!(err, DataError::InconsistentBuffers(_)));
    }
}
