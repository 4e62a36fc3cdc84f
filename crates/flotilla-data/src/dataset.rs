//! In-memory image classification dataset with normalised `f32` pixels.

use crate::error::{DataError, Result};

/// Per-pixel normalisation applied when loading: `(x / 255 - mean) / std`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Normalization {
    /// Mean of the `[0, 1]`-scaled pixels.
    pub mean: f32,
    /// Standard deviation of the `[0, 1]`-scaled pixels.
    pub std: f32,
}

impl Normalization {
    /// The usual MNIST statistics: mean 0.1307, std 0.3081.
    pub const MNIST: Normalization = Normalization {
        mean: 0.1307,
        std: 0.3081,
    };

    /// Only scales to `[0, 1]` (mean 0, std 1).
    pub const UNIT: Normalization = Normalization {
        mean: 0.0,
        std: 1.0,
    };

    /// Normalises one raw pixel value.
    pub fn apply(self, x: u8) -> f32 {
        (f32::from(x) / 255.0 - self.mean) / self.std
    }

    /// Lookup table of [`Normalization::apply`] for all 256 pixel values.
    fn table(self) -> [f32; 256] {
        let mut t = [0.0; 256];
        for (x, v) in (0..=u8::MAX).zip(t.iter_mut()) {
            *v = self.apply(x);
        }
        t
    }
}

impl Default for Normalization {
    fn default() -> Self {
        Normalization::MNIST
    }
}

/// A set of single-channel `rows x cols` images with `u8` class labels, held in memory.
///
/// Invariant: `images().len() == len() * rows() * cols()` and `labels().len() == len()`.
/// Image `i` occupies `images()[i * image_size() .. (i + 1) * image_size()]`, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageDataset {
    images: Vec<f32>,
    labels: Vec<u8>,
    rows: usize,
    cols: usize,
    len: usize,
}

impl ImageDataset {
    /// Builds a dataset from already-normalised pixels.
    ///
    /// # Errors
    /// [`DataError::InconsistentBuffers`] if `images.len() != labels.len() * rows * cols`.
    pub fn new(images: Vec<f32>, labels: Vec<u8>, rows: usize, cols: usize) -> Result<Self> {
        let len = labels.len();
        if rows.checked_mul(cols).and_then(|s| s.checked_mul(len)) != Some(images.len()) {
            return Err(DataError::InconsistentBuffers(format!(
                "{} pixels for {len} labels of {rows}x{cols}",
                images.len()
            )));
        }
        Ok(ImageDataset {
            images,
            labels,
            rows,
            cols,
            len,
        })
    }

    /// Builds a dataset from raw `u8` pixels, normalising them with `norm`.
    ///
    /// # Errors
    /// [`DataError::InconsistentBuffers`] if `pixels.len() != labels.len() * rows * cols`.
    pub fn from_u8(
        pixels: &[u8],
        labels: Vec<u8>,
        rows: usize,
        cols: usize,
        norm: Normalization,
    ) -> Result<Self> {
        let table = norm.table();
        let images = pixels.iter().map(|&p| table[usize::from(p)]).collect();
        Self::new(images, labels, rows, cols)
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.len
    }

    /// `true` if the dataset holds no samples.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Rows per image (28 for MNIST).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns per image (28 for MNIST).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Pixels per image, `rows * cols`.
    pub fn image_size(&self) -> usize {
        self.rows * self.cols
    }

    /// All normalised pixels, `len x rows x cols`, row-major.
    pub fn images(&self) -> &[f32] {
        &self.images
    }

    /// All labels, one per sample.
    pub fn labels(&self) -> &[u8] {
        &self.labels
    }

    /// The normalised pixels of sample `index`, or `None` if out of range.
    pub fn image(&self, index: usize) -> Option<&[f32]> {
        let size = self.image_size();
        let start = index.checked_mul(size)?;
        self.images.get(start..start.checked_add(size)?)
    }

    /// The label of sample `index`, or `None` if out of range.
    pub fn label(&self, index: usize) -> Option<u8> {
        self.labels.get(index).copied()
    }

    /// Number of classes, taken as `max(label) + 1` (0 for an empty dataset).
    pub fn num_classes(&self) -> usize {
        self.labels.iter().max().map_or(0, |&m| usize::from(m) + 1)
    }

    /// Keeps only the first `n` samples (no-op if `n >= len`). Handy for quick runs.
    pub fn truncate(&mut self, n: usize) {
        if n < self.len {
            self.len = n;
            self.labels.truncate(n);
            self.images.truncate(n * self.rows * self.cols);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalisation_and_accessors() {
        let ds = ImageDataset::from_u8(
            &[0, 255, 0, 255, 51, 51],
            vec![3, 1, 4],
            1,
            2,
            Normalization::MNIST,
        )
        .unwrap();
        assert_eq!(
            (ds.len(), ds.rows(), ds.cols(), ds.image_size()),
            (3, 1, 2, 2)
        );
        let lo = (0.0 - 0.1307) / 0.3081;
        let hi = (1.0 - 0.1307) / 0.3081;
        assert!((ds.image(1).unwrap()[0] - lo).abs() < 1e-6);
        assert!((ds.image(1).unwrap()[1] - hi).abs() < 1e-6);
        assert_eq!(ds.label(2), Some(4));
        assert_eq!(ds.label(3), None);
        assert!(ds.image(3).is_none());
        assert_eq!(ds.num_classes(), 5);
    }

    #[test]
    fn inconsistent_buffers_rejected() {
        let err = ImageDataset::new(vec![0.0; 5], vec![0, 1], 1, 2).unwrap_err();
        assert!(matches!(err, DataError::InconsistentBuffers(_)));
    }

    #[test]
    fn truncate_keeps_prefix() {
        let mut ds =
            ImageDataset::from_u8(&[1, 2, 3, 4], vec![0, 1, 2, 3], 1, 1, Normalization::UNIT)
                .unwrap();
        ds.truncate(2);
        assert_eq!(ds.len(), 2);
        assert_eq!(ds.images().len(), 2);
        assert_eq!(ds.labels(), &[0, 1]);
    }
}
