//! flotilla-data: datasets, distributed sampling and batching for Flotilla.
//!
//! The crate is independent of the tensor engine: it yields flat `f32` pixel buffers and
//! `u8`/`i64` labels that the trainer turns into tensors. Images stay `u8` in memory
//! ([`ImageDataset`]) and are normalised into the `f32` buffer as a batch is gathered.
//!
//! * [`idx`]: the IDX file format (gzipped or raw).
//! * [`Mnist::load`]: the four files of an MNIST-layout directory into [`MnistSplits`];
//!   [`Mnist::open`]: the same files read by sample ([`ImageFile`], positioned reads; a
//!   gzipped file through its raw copy, [`mod@raw_idx`]), only the labels held.
//! * [`verify_md5`]: MD5 check against the original MNIST files.
//! * [`DistributedSampler`]: per-epoch shuffled, per-rank shards of equal size.
//! * [`fill_batch`] / [`Batcher`]: gathering a batch into reusable buffers, normalised.
//! * [`TextSplits`]: a text file as next-token windows of bytes (training and held-out).
//! * [`Samples`]: what every data set is to the trainer (samples, labels per sample, `fill`,
//!   `select`: a subset such as a rank's shard of an epoch, in memory).
//! * [`Prefetcher`]: a rank's batches gathered ahead on a thread, from each epoch's shard
//!   alone.
//!
//! ```no_run
//! use flotilla_data::{Batcher, DistributedSampler, Mnist};
//!
//! # fn main() -> Result<(), flotilla_data::DataError> {
//! let splits = Mnist::load("data/mnist")?;
//! let (world_size, rank, batch) = (2, 0, 64);
//! let sampler = DistributedSampler::new(splits.train.len(), world_size, rank, 42, true)?;
//! let mut batcher = Batcher::new(batch, splits.train.image_size());
//! for epoch in 0..3 {
//!     for indices in sampler.indices(epoch).chunks_exact(batch) {
//!         let b = batcher.fill(&splits.train, indices)?;
//!         // b.images: [batch, 1, 28, 28] row-major f32; b.labels: i64 classes.
//!         let _ = (b.images, b.labels, b.shape);
//!     }
//! }
//! # Ok(())
//! # }
//! ```

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod batch;
pub mod checksum;
pub mod dataset;
pub mod error;
pub mod files;
pub mod idx;
pub mod image_file;
pub mod mnist;
pub mod prefetch;
pub mod raw_idx;
pub mod sampler;
pub mod samples;
pub mod text;

#[cfg(test)]
mod testutil;

pub use batch::{Batch, Batcher, fill_batch};
pub use checksum::{FileMd5, Md5Report, Md5Status, verify_md5};
pub use dataset::{ImageDataset, Normalization};
pub use error::{DataError, Result};
pub use files::{MnistFile, Split};
pub use image_file::ImageFile;
pub use mnist::{Mnist, MnistFiles, MnistSplits};
pub use prefetch::{Filled, Prefetcher};
pub use raw_idx::{cache_dir_in, default_cache_dir, raw_idx};
pub use sampler::DistributedSampler;
pub use samples::Samples;
pub use text::{BYTE_VOCAB, TextSplits, TokenWindows};
