//! What every data set a training job draws from is ([`Samples`]): a number of samples of
//! equal size, each with a fixed number of class labels, gathered by index into flat
//! buffers. An image is one sample of `rows × cols` pixels with one label
//! ([`crate::ImageDataset`] in memory, [`crate::ImageFile`] read from its file); a text window is one sample of `context` token ids with
//! `context` next-token labels ([`crate::TokenWindows`]).

use crate::error::Result;

/// A data set of equal-sized samples, gathered by index.
pub trait Samples: Send + Sync {
    /// Number of samples.
    fn len(&self) -> usize;

    /// `true` if the data set holds no samples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The shape of one sample (`[1, rows, cols]` for an image, `[context]` for a window).
    fn sample_shape(&self) -> Vec<usize>;

    /// Input values per sample (the product of [`Samples::sample_shape`]).
    fn values_per_sample(&self) -> usize {
        self.sample_shape().iter().product()
    }

    /// Class labels per sample: 1 for an image, `context` for a text window (one per
    /// position, row-major).
    fn labels_per_sample(&self) -> usize;

    /// Number of classes a model must give logits for.
    fn classes(&self) -> usize;

    /// Whether the labels are byte tokens, so that a loss in nats per label is
    /// `loss / ln 2` bits per byte.
    fn byte_tokens(&self) -> bool {
        false
    }

    /// Gathers the samples `indices` into `inputs` (`n × values_per_sample`, row-major) and
    /// their labels into `labels` (`n × labels_per_sample`). Both are cleared first.
    ///
    /// # Errors
    /// [`crate::DataError::IndexOutOfRange`] if an index is `>= len()`.
    fn fill(&self, indices: &[usize], inputs: &mut Vec<f32>, labels: &mut Vec<i64>) -> Result<()>;

    /// The samples `indices`, in this order, as a data set held in memory (its sample `i`
    /// is sample `indices[i]`; an index may repeat): how a rank loads the shard of an epoch
    /// and nothing else. Gathering from it is bitwise gathering from `self`.
    ///
    /// # Errors
    /// [`crate::DataError::IndexOutOfRange`] if an index is `>= len()`, or the error of
    /// reading the samples.
    fn select(&self, indices: &[usize]) -> Result<Box<dyn Samples>>;

    /// The bytes of sample data this set holds in memory (pixels, tokens, labels, window
    /// offsets); not what it can read from a file.
    fn held_bytes(&self) -> usize;
}

impl Samples for crate::ImageDataset {
    fn len(&self) -> usize {
        crate::ImageDataset::len(self)
    }

    fn sample_shape(&self) -> Vec<usize> {
        vec![1, self.rows(), self.cols()]
    }

    fn labels_per_sample(&self) -> usize {
        1
    }

    fn classes(&self) -> usize {
        self.num_classes()
    }

    fn fill(&self, indices: &[usize], inputs: &mut Vec<f32>, labels: &mut Vec<i64>) -> Result<()> {
        crate::fill_batch(self, indices, inputs, labels)
    }

    fn select(&self, indices: &[usize]) -> Result<Box<dyn Samples>> {
        Ok(Box::new(crate::ImageDataset::select(self, indices)?))
    }

    fn held_bytes(&self) -> usize {
        self.pixels().len() + self.labels().len()
    }
}

impl Samples for crate::ImageFile {
    fn len(&self) -> usize {
        crate::ImageFile::len(self)
    }

    fn sample_shape(&self) -> Vec<usize> {
        vec![1, self.rows(), self.cols()]
    }

    fn labels_per_sample(&self) -> usize {
        1
    }

    fn classes(&self) -> usize {
        self.num_classes()
    }

    /// Reads the samples from the file ([`crate::ImageFile::load`]) and gathers them.
    fn fill(&self, indices: &[usize], inputs: &mut Vec<f32>, labels: &mut Vec<i64>) -> Result<()> {
        inputs.clear();
        labels.clear();
        let loaded = self.load(indices)?;
        let slots: Vec<usize> = (0..indices.len()).collect();
        crate::fill_batch(&loaded, &slots, inputs, labels)
    }

    fn select(&self, indices: &[usize]) -> Result<Box<dyn Samples>> {
        Ok(Box::new(self.load(indices)?))
    }

    fn held_bytes(&self) -> usize {
        self.labels().len()
    }
}

impl Samples for crate::TokenWindows {
    fn len(&self) -> usize {
        crate::TokenWindows::len(self)
    }

    fn sample_shape(&self) -> Vec<usize> {
        vec![self.context()]
    }

    fn labels_per_sample(&self) -> usize {
        self.context()
    }

    fn classes(&self) -> usize {
        crate::BYTE_VOCAB
    }

    fn byte_tokens(&self) -> bool {
        true
    }

    fn fill(&self, indices: &[usize], inputs: &mut Vec<f32>, labels: &mut Vec<i64>) -> Result<()> {
        crate::TokenWindows::fill(self, indices, inputs, labels)
    }

    /// The windows `indices` over the same text (shared, not copied: windows overlap, so
    /// the text is smaller than any copy of a shard's windows).
    fn select(&self, indices: &[usize]) -> Result<Box<dyn Samples>> {
        Ok(Box::new(crate::TokenWindows::select(self, indices)?))
    }

    fn held_bytes(&self) -> usize {
        self.tokens() + self.len() * std::mem::size_of::<usize>()
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::{ImageDataset, Normalization, TextSplits};

    /// Gathers through the trait object, as the trainer does.
    fn gather(data: &dyn Samples, indices: &[usize]) -> (Vec<f32>, Vec<i64>) {
        let (mut x, mut y) = (Vec::new(), Vec::new());
        data.fill(indices, &mut x, &mut y).expect("fill");
        (x, y)
    }

    #[test]
    fn an_image_is_one_sample_with_one_label() {
        let d = ImageDataset::new(
            vec![1, 2, 3, 4, 5, 6],
            vec![7, 3, 9],
            1,
            2,
            Normalization::UNIT,
        )
        .expect("data");
        let s: &dyn Samples = &d;
        assert_eq!(
            (s.len(), s.values_per_sample(), s.labels_per_sample()),
            (3, 2, 1)
        );
        assert_eq!((s.sample_shape(), s.classes()), (vec![1, 1, 2], 10));
        assert!(!s.byte_tokens());
        let (x, y) = gather(s, &[2, 0]);
        assert_eq!(y, [9, 7]);
        assert_eq!(x, [5.0 / 255.0, 6.0 / 255.0, 1.0 / 255.0, 2.0 / 255.0]);
        assert!(s.fill(&[3], &mut Vec::new(), &mut Vec::new()).is_err());
    }

    #[test]
    fn a_window_is_one_sample_with_a_label_per_position() {
        let text: Vec<u8> = (0..60u8).collect();
        let s = TextSplits::from_bytes(text, 5, 0.2, Path::new("t")).expect("splits");
        let w: &dyn Samples = &s.train;
        // 48 training bytes: windows at offsets 0..=42.
        assert_eq!(
            (w.len(), w.values_per_sample(), w.labels_per_sample()),
            (43, 5, 5)
        );
        assert_eq!((w.sample_shape(), w.classes()), (vec![5], 256));
        assert!(w.byte_tokens());
        let (x, y) = gather(w, &[42, 1]);
        assert_eq!(x, [42.0, 43.0, 44.0, 45.0, 46.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        assert_eq!(y, [43, 44, 45, 46, 47, 2, 3, 4, 5, 6]);
        // Validation: 12 bytes from 48, non-overlapping windows at 48 and 53.
        let v: &dyn Samples = &s.validation;
        assert_eq!(v.len(), 2);
        assert_eq!(gather(v, &[1]).1, [54, 55, 56, 57, 58]);
    }
}
