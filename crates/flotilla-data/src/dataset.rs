//! In-memory image classification dataset: raw `u8` pixels, normalised to `f32` as they are
//! gathered.

use crate::error::{DataError, Result};

/// Per-pixel normalisation applied when pixels are read: `(x / 255 - mean) / std` in `f32`.
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
    pub(crate) fn table(self) -> [f32; 256] {
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

/// A set of single-channel `rows x cols` images with `u8` class labels, held in memory as
/// raw `u8` pixels (a quarter of `f32`'s size) with the [`Normalization`] that readers apply
/// as they gather samples ([`crate::fill_batch`], [`ImageDataset::normalized_images`]).
///
/// Invariant: `pixels().len() == len() * rows() * cols()` and `labels().len() == len()`.
/// Image `i` occupies `pixels()[i * image_size() .. (i + 1) * image_size()]`, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageDataset {
    pixels: Vec<u8>,
    labels: Vec<u8>,
    rows: usize,
    cols: usize,
    len: usize,
    norm: Normalization,
}

impl ImageDataset {
    /// Builds a dataset from raw `u8` pixels, normalised with `norm` when read.
    ///
    /// # Errors
    /// [`DataError::InconsistentBuffers`] if `pixels.len() != labels.len() * rows * cols`.
    pub fn new(
        pixels: Vec<u8>,
        labels: Vec<u8>,
        rows: usize,
        cols: usize,
        norm: Normalization,
    ) -> Result<Self> {
        let len = labels.len();
        if rows.checked_mul(cols).and_then(|s| s.checked_mul(len)) != Some(pixels.len()) {
            return Err(DataError::InconsistentBuffers(format!(
                "{} pixels for {len} labels of {rows}x{cols}",
                pixels.len()
            )));
        }
        Ok(ImageDataset {
            pixels,
            labels,
            rows,
            cols,
            len,
            norm,
        })
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

    /// The normalisation readers apply to the raw pixels.
    pub fn normalization(&self) -> Normalization {
        self.norm
    }

    /// All raw pixels, `len x rows x cols`, row-major.
    pub fn pixels(&self) -> &[u8] {
        &self.pixels
    }

    /// A normalised `f32` copy of every image, `len x rows x cols`, row-major: four times the
    /// memory of the data set. Gather batches with [`crate::fill_batch`] instead where you can.
    pub fn normalized_images(&self) -> Vec<f32> {
        let table = self.norm.table();
        self.pixels.iter().map(|&p| table[usize::from(p)]).collect()
    }

    /// All labels, one per sample.
    pub fn labels(&self) -> &[u8] {
        &self.labels
    }

    /// The raw pixels of sample `index`, or `None` if out of range.
    pub fn image(&self, index: usize) -> Option<&[u8]> {
        let size = self.image_size();
        let start = index.checked_mul(size)?;
        self.pixels.get(start..start.checked_add(size)?)
    }

    /// The label of sample `index`, or `None` if out of range.
    pub fn label(&self, index: usize) -> Option<u8> {
        self.labels.get(index).copied()
    }

    /// Number of classes, taken as `max(label) + 1` (0 for an empty dataset).
    pub fn num_classes(&self) -> usize {
        self.labels.iter().max().map_or(0, |&m| usize::from(m) + 1)
    }

    /// The samples `indices`, in this order, copied into a data set of their own (its
    /// sample `i` is sample `indices[i]`).
    ///
    /// # Errors
    /// [`DataError::IndexOutOfRange`] if an index is `>= len()`.
    pub fn select(&self, indices: &[usize]) -> Result<ImageDataset> {
        let size = self.image_size();
        let mut pixels = Vec::with_capacity(indices.len() * size);
        let mut labels = Vec::with_capacity(indices.len());
        for &i in indices {
            let image = self.image(i).ok_or(DataError::IndexOutOfRange {
                index: i,
                len: self.len,
            })?;
            pixels.extend_from_slice(image);
            labels.push(self.labels[i]);
        }
        ImageDataset::new(pixels, labels, self.rows, self.cols, self.norm)
    }

    /// Keeps only the first `n` samples (no-op if `n >= len`) and frees the rest's memory.
    /// Handy for quick runs.
    pub fn truncate(&mut self, n: usize) {
        if n < self.len {
            self.len = n;
            self.labels.truncate(n);
            self.labels.shrink_to_fit();
            self.pixels.truncate(n * self.rows * self.cols);
            self.pixels.shrink_to_fit();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalisation_and_accessors() {
        let ds = ImageDataset::new(
            vec![0, 255, 0, 255, 51, 51],
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
        assert_eq!(ds.image(1), Some(&[0, 255][..]));
        let lo = (0.0 - 0.1307) / 0.3081;
        let hi = (1.0 - 0.1307) / 0.3081;
        let all = ds.normalized_images();
        assert_eq!(all.len(), 6);
        assert!((all[2] - lo).abs() < 1e-6);
        assert!((all[3] - hi).abs() < 1e-6);
        assert_eq!(ds.normalization(), Normalization::MNIST);
        assert_eq!(ds.label(2), Some(4));
        assert_eq!(ds.label(3), None);
        assert!(ds.image(3).is_none());
        assert_eq!(ds.num_classes(), 5);
    }

    #[test]
    fn the_table_is_the_formula_for_every_pixel_value() {
        for norm in [Normalization::MNIST, Normalization::UNIT] {
            let table = norm.table();
            for x in 0..=u8::MAX {
                let want = (f32::from(x) / 255.0 - norm.mean) / norm.std;
                assert_eq!(table[usize::from(x)].to_bits(), want.to_bits(), "{x}");
            }
        }
    }

    #[test]
    fn inconsistent_buffers_rejected() {
        let err = ImageDataset::new(vec![0; 5], vec![0, 1], 1, 2, Normalization::UNIT).unwrap_err();
        assert!(matches!(err, DataError::InconsistentBuffers(_)));
    }

    #[test]
    fn truncate_keeps_prefix() {
        let mut ds = ImageDataset::new(
            vec![1, 2, 3, 4],
            vec![0, 1, 2, 3],
            1,
            1,
            Normalization::UNIT,
        )
        .unwrap();
        ds.truncate(2);
        assert_eq!(ds.len(), 2);
        assert_eq!(ds.pixels(), &[1, 2]);
        assert_eq!(ds.labels(), &[0, 1]);
    }
}
