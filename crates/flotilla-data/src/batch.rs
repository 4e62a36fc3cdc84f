//! Gathering samples into reusable flat batch buffers, normalising the data set's `u8`
//! pixels to `f32` on the way.

use crate::dataset::ImageDataset;
use crate::error::{DataError, Result};

/// Writes the samples `indices` of `dataset` into `images` (`n x 1 x rows x cols`,
/// row-major, `n = indices.len()`), each pixel normalised by the data set's
/// [`crate::Normalization`] (through its table, so bitwise [`crate::Normalization::apply`]),
/// and their labels, widened to `i64`, into `labels`.
///
/// Both buffers are cleared first; they only reallocate if their capacity is too small,
/// so reusing the same buffers for batches of the same size never allocates.
/// On error both buffers are left empty.
///
/// # Errors
/// [`DataError::IndexOutOfRange`] if an index is `>= dataset.len()`.
pub fn fill_batch(
    dataset: &ImageDataset,
    indices: &[usize],
    images: &mut Vec<f32>,
    labels: &mut Vec<i64>,
) -> Result<()> {
    images.clear();
    labels.clear();
    if let Some(&index) = indices.iter().find(|&&i| i >= dataset.len()) {
        return Err(DataError::IndexOutOfRange {
            index,
            len: dataset.len(),
        });
    }
    images.reserve(indices.len() * dataset.image_size());
    labels.reserve(indices.len());
    let size = dataset.image_size();
    let table = dataset.normalization().table();
    let (pixels, all_labels) = (dataset.pixels(), dataset.labels());
    for &i in indices {
        let image = &pixels[i * size..(i + 1) * size];
        images.extend(image.iter().map(|&p| table[usize::from(p)]));
        labels.push(i64::from(all_labels[i]));
    }
    Ok(())
}

/// A gathered batch borrowed from a [`Batcher`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Batch<'a> {
    /// Pixels, `len x 1 x rows x cols`, row-major.
    pub images: &'a [f32],
    /// Labels as `i64` class indices, one per sample.
    pub labels: &'a [i64],
    /// Tensor shape of `images`: `[len, 1, rows, cols]`.
    pub shape: [usize; 4],
}

impl Batch<'_> {
    /// Number of samples in the batch.
    pub fn len(&self) -> usize {
        self.shape[0]
    }

    /// `true` if the batch holds no samples.
    pub fn is_empty(&self) -> bool {
        self.shape[0] == 0
    }
}

/// Owns reusable image and label buffers and fills them batch after batch.
#[derive(Debug, Clone, Default)]
pub struct Batcher {
    images: Vec<f32>,
    labels: Vec<i64>,
}

impl Batcher {
    /// Creates a batcher whose buffers already hold `batch_size` samples of
    /// `image_size` pixels, so even the first batch does not allocate.
    pub fn new(batch_size: usize, image_size: usize) -> Self {
        Batcher {
            images: Vec::with_capacity(batch_size * image_size),
            labels: Vec::with_capacity(batch_size),
        }
    }

    /// Gathers the samples `indices` of `dataset` (see [`fill_batch`]).
    ///
    /// # Errors
    /// [`DataError::IndexOutOfRange`] if an index is `>= dataset.len()`.
    pub fn fill(&mut self, dataset: &ImageDataset, indices: &[usize]) -> Result<Batch<'_>> {
        fill_batch(dataset, indices, &mut self.images, &mut self.labels)?;
        Ok(Batch {
            images: &self.images,
            labels: &self.labels,
            shape: [indices.len(), 1, dataset.rows(), dataset.cols()],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataset::Normalization;

    fn dataset() -> ImageDataset {
        // 5 images of 2x3, pixel value = 10 * image + position.
        let px: Vec<u8> = (0..5u8)
            .flat_map(|i| (0..6u8).map(move |p| 10 * i + p))
            .collect();
        ImageDataset::new(px, vec![9, 8, 7, 6, 5], 2, 3, Normalization::UNIT).unwrap()
    }

    /// Image `i` of `ds` normalised pixel by pixel with the formula written out here, as
    /// the data set held it in `f32` before it kept `u8`.
    fn by_formula(ds: &ImageDataset, i: usize) -> Vec<u32> {
        let Normalization { mean, std } = ds.normalization();
        let image = ds.image(i).unwrap();
        image
            .iter()
            .map(|&x| ((f32::from(x) / 255.0 - mean) / std).to_bits())
            .collect()
    }

    #[test]
    fn a_batch_from_u8_equals_the_f32_normalisation_bitwise() {
        // 4 images of 8x8 holding every pixel value once, in a scrambled order.
        let px: Vec<u8> = (0..=255u8)
            .map(|x| x.wrapping_mul(167).wrapping_add(13))
            .collect();
        for norm in [Normalization::MNIST, Normalization::UNIT] {
            let ds = ImageDataset::new(px.clone(), vec![0, 1, 2, 3], 8, 8, norm).unwrap();
            let indices = [2, 0, 3, 2, 1];
            let mut batcher = Batcher::new(indices.len(), ds.image_size());
            let batch = batcher.fill(&ds, &indices).unwrap();
            let got: Vec<u32> = batch.images.iter().map(|v| v.to_bits()).collect();
            let want: Vec<u32> = indices.iter().flat_map(|&i| by_formula(&ds, i)).collect();
            assert_eq!(got, want, "{norm:?}");
            let whole: Vec<u32> = ds.normalized_images().iter().map(|v| v.to_bits()).collect();
            assert_eq!(
                whole,
                (0..4).flat_map(|i| by_formula(&ds, i)).collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn gathers_in_order_without_reallocating() {
        let ds = dataset();
        let mut images = Vec::new();
        let mut labels = Vec::new();
        fill_batch(&ds, &[3, 0, 3], &mut images, &mut labels).unwrap();
        assert_eq!(labels, vec![6, 9, 6]);
        assert_eq!(images.len(), 18);
        let unit = |i: usize| -> Vec<f32> {
            let image = ds.image(i).unwrap();
            image.iter().map(|&p| f32::from(p) / 255.0).collect()
        };
        assert_eq!(images[..6], unit(3));
        assert_eq!(images[6..12], unit(0));
        let (ip, lp) = (images.as_ptr(), labels.as_ptr());
        fill_batch(&ds, &[1, 2, 4], &mut images, &mut labels).unwrap();
        assert_eq!(labels, vec![8, 7, 5]);
        assert_eq!(images[12..], unit(4));
        assert_eq!(
            (ip, lp),
            (images.as_ptr(), labels.as_ptr()),
            "buffers reused"
        );
    }

    #[test]
    fn out_of_range_index_is_an_error() {
        let ds = dataset();
        let mut images = vec![1.0];
        let mut labels = vec![1];
        let err = fill_batch(&ds, &[0, 5], &mut images, &mut labels).unwrap_err();
        assert!(matches!(
            err,
            DataError::IndexOutOfRange { index: 5, len: 5 }
        ));
        assert!(images.is_empty() && labels.is_empty());
    }

    #[test]
    fn batcher_shape_and_preallocation() {
        let ds = dataset();
        let mut batcher = Batcher::new(2, ds.image_size());
        let batch = batcher.fill(&ds, &[4, 1]).unwrap();
        assert_eq!(batch.shape, [2, 1, 2, 3]);
        assert_eq!(batch.len(), 2);
        assert_eq!(batch.labels, &[5, 8]);
        let ptr = batch.images.as_ptr();
        let batch = batcher.fill(&ds, &[0, 2]).unwrap();
        assert_eq!(batch.images.as_ptr(), ptr);
        assert_eq!(batch.images[0], 0.0);
    }
}
