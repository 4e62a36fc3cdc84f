//! The crate's error type.

use std::io;
use std::path::PathBuf;

/// Convenience alias for results produced by this crate.
pub type Result<T, E = DataError> = std::result::Result<T, E>;

/// Everything that can go wrong while loading, checking, sampling or batching data.
///
/// Every variant that concerns a file carries its path, so messages can be shown to a
/// user as-is.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DataError {
    /// A text file cannot be a data set (empty, or too short for one window per part).
    #[error("{}: {message}", path.display())]
    Text {
        /// The text file.
        path: PathBuf,
        /// Why.
        message: String,
    },

    /// The cache directory in the temporary directory is not this user's private one.
    #[error(
        "refusing the cache directory {}: {reason} (set FLOTILLA_CACHE_DIR or HOME to use another)",
        path.display()
    )]
    UnsafeCache {
        /// The directory.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },

    /// The file could not be opened or read.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        /// The file being read.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: io::Error,
    },

    /// The file starts with the gzip magic bytes but does not decompress.
    #[error("{}: corrupt or truncated gzip stream: {source}", path.display())]
    Gzip {
        /// The file being decompressed.
        path: PathBuf,
        /// The error reported by the decompressor.
        #[source]
        source: io::Error,
    },

    /// The file, or its decompressed content, is larger than the limit.
    #[error("{}: the {what} is larger than the limit MAX_IDX_BYTES = {max} bytes", path.display())]
    TooLarge {
        /// The file being read.
        path: PathBuf,
        /// What is too large (`file` or `decompressed content`).
        what: &'static str,
        /// The limit in bytes.
        max: u64,
    },

    /// The (decompressed) content is too short to hold the IDX header.
    #[error(
        "{}: truncated IDX header: expected at least {expected} bytes, found {actual}",
        path.display()
    )]
    TruncatedHeader {
        /// The file being parsed.
        path: PathBuf,
        /// Bytes needed for the header.
        expected: usize,
        /// Bytes present in the (decompressed) file.
        actual: usize,
    },

    /// The IDX magic number is not the one expected for this kind of file.
    #[error(
        "{}: unexpected IDX magic number 0x{found:08X} ({found_desc}); expected 0x{expected:08X} ({expected_desc})",
        path.display()
    )]
    BadMagic {
        /// The file being parsed.
        path: PathBuf,
        /// The magic number found in the first four bytes.
        found: u32,
        /// Human-readable decoding of `found`.
        found_desc: String,
        /// The magic number that was expected.
        expected: u32,
        /// Human-readable decoding of `expected`.
        expected_desc: String,
    },

    /// The IDX header declares a shape that is empty where it must not be, or too large.
    #[error("{}: invalid IDX dimensions {dims:?}: {reason}", path.display())]
    BadDimensions {
        /// The file being parsed.
        path: PathBuf,
        /// The dimensions declared in the header.
        dims: Vec<u32>,
        /// Why they are rejected.
        reason: &'static str,
    },

    /// The data section is shorter than the header's dimensions require.
    #[error(
        "{}: truncated IDX data: header dims {dims:?} need {expected} data bytes, found {actual}",
        path.display()
    )]
    Truncated {
        /// The file being parsed.
        path: PathBuf,
        /// The dimensions declared in the header.
        dims: Vec<u32>,
        /// Data bytes required by `dims`.
        expected: usize,
        /// Data bytes actually present after the header.
        actual: usize,
    },

    /// The data section is longer than the header's dimensions allow.
    #[error(
        "{}: trailing bytes after IDX data: header dims {dims:?} need {expected} data bytes, found {actual}",
        path.display()
    )]
    TrailingData {
        /// The file being parsed.
        path: PathBuf,
        /// The dimensions declared in the header.
        dims: Vec<u32>,
        /// Data bytes required by `dims`.
        expected: usize,
        /// Data bytes actually present after the header.
        actual: usize,
    },

    /// An images file and its labels file disagree on the number of samples.
    #[error(
        "sample count mismatch: {} holds {images} images but {} holds {labels} labels",
        images_path.display(),
        labels_path.display()
    )]
    CountMismatch {
        /// The images file.
        images_path: PathBuf,
        /// Number of images it declares.
        images: usize,
        /// The labels file.
        labels_path: PathBuf,
        /// Number of labels it declares.
        labels: usize,
    },

    /// None of the accepted file names exists in the data directory.
    #[error(
        "{what} file not found in {}: tried {}",
        dir.display(),
        tried.join(", ")
    )]
    MissingFile {
        /// What was looked for, e.g. `"train images"`.
        what: &'static str,
        /// The directory searched.
        dir: PathBuf,
        /// The file names tried, in order.
        tried: Vec<String>,
    },

    /// `verify_md5` found files whose uncompressed MD5 is not the known MNIST one.
    #[error("MD5 check failed (not the original MNIST files): {}", files.join(", "))]
    ChecksumMismatch {
        /// One `"path: md5 <found>, expected <expected>"` entry per failing file.
        files: Vec<String>,
    },

    /// Raw buffers handed to a constructor do not have consistent sizes.
    #[error("inconsistent dataset buffers: {0}")]
    InconsistentBuffers(String),

    /// The thread that loads shards and gathers batches ahead could not start, or ended
    /// without saying why.
    #[error("data prefetch thread: {0}")]
    Prefetch(String),

    /// A sampler was configured with impossible parameters.
    #[error("invalid sampler configuration: {0}")]
    InvalidSampler(String),

    /// A batch refers to a sample index that the dataset does not have.
    #[error("sample index {index} out of range for a dataset of {len} samples")]
    IndexOutOfRange {
        /// The offending index.
        index: usize,
        /// The dataset length.
        len: usize,
    },
}
