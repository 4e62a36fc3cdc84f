//! MD5 verification of the uncompressed MNIST files.

use std::fmt;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use md5::{Digest, Md5};

use crate::error::{DataError, Result};
use crate::files::MnistFile;
use crate::idx::read_maybe_gz;

impl MnistFile {
    /// The MD5 (lower-case hex) of the original, uncompressed MNIST file.
    pub fn mnist_md5(self) -> &'static str {
        match self {
            MnistFile::TrainImages => "6bbc9ace898e44ae57da46a324031adb",
            MnistFile::TrainLabels => "a25bea736e30d166cdddb491f175f624",
            MnistFile::TestImages => "2646ac647ad5339dbf082846283269ea",
            MnistFile::TestLabels => "27ae3e4e09519cfbb04c329615203637",
        }
    }
}

/// Outcome of comparing one file's digest with the known MNIST digest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Md5Status {
    /// The uncompressed content is byte-identical to the original MNIST file.
    MnistMatch,
    /// Not the MNIST digest: another data set of the same layout (e.g. Fashion-MNIST),
    /// or a modified/corrupted copy. This crate cannot tell which.
    Unknown,
}

/// The digest of one of the four files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileMd5 {
    /// Which file this is.
    pub file: MnistFile,
    /// Where it was found.
    pub path: PathBuf,
    /// MD5 of the uncompressed content, lower-case hex.
    pub md5: String,
    /// Comparison with [`MnistFile::mnist_md5`].
    pub status: Md5Status,
}

/// Digests of the four files of a data directory, as returned by [`verify_md5`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Md5Report {
    /// One entry per file, in [`MnistFile::ALL`] order.
    pub files: Vec<FileMd5>,
}

impl Md5Report {
    /// `true` if all four files are the original MNIST files.
    pub fn is_mnist(&self) -> bool {
        self.files.iter().all(|f| f.status == Md5Status::MnistMatch)
    }

    /// `true` if some but not all files match MNIST: most likely a damaged MNIST copy.
    pub fn is_partial_mnist(&self) -> bool {
        let matches = self
            .files
            .iter()
            .filter(|f| f.status == Md5Status::MnistMatch)
            .count();
        matches > 0 && matches < self.files.len()
    }

    /// Succeeds only if all four files are the original MNIST files.
    ///
    /// # Errors
    /// [`DataError::ChecksumMismatch`] naming every file whose digest differs.
    pub fn require_mnist(&self) -> Result<()> {
        let bad: Vec<String> = self
            .files
            .iter()
            .filter(|f| f.status != Md5Status::MnistMatch)
            .map(|f| {
                format!(
                    "{}: md5 {}, expected {}",
                    f.path.display(),
                    f.md5,
                    f.file.mnist_md5()
                )
            })
            .collect();
        if bad.is_empty() {
            Ok(())
        } else {
            Err(DataError::ChecksumMismatch { files: bad })
        }
    }
}

impl fmt::Display for Md5Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, file) in self.files.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            let status = match file.status {
                Md5Status::MnistMatch => "MNIST ok",
                Md5Status::Unknown => "unknown (not MNIST)",
            };
            write!(f, "{}  {}  {status}", file.md5, file.path.display())?;
        }
        Ok(())
    }
}

/// MD5 of `bytes` as lower-case hex.
pub fn md5_hex(bytes: &[u8]) -> String {
    Md5::digest(bytes)
        .iter()
        .fold(String::with_capacity(32), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

/// Computes the MD5 of the uncompressed content of the four files in `dir` and compares
/// each with the original MNIST digest.
///
/// A directory holding another data set of the same layout yields
/// [`Md5Status::Unknown`] entries, not an error; use [`Md5Report::require_mnist`] to
/// insist on MNIST.
///
/// # Errors
/// [`DataError::MissingFile`], [`DataError::Io`] or [`DataError::Gzip`] if a file cannot
/// be found or read.
pub fn verify_md5(dir: impl AsRef<Path>) -> Result<Md5Report> {
    let dir = dir.as_ref();
    let files = MnistFile::ALL
        .into_iter()
        .map(|file| {
            let path = file.locate(dir)?;
            let md5 = md5_hex(&read_maybe_gz(&path)?);
            let status = if md5 == file.mnist_md5() {
                Md5Status::MnistMatch
            } else {
                Md5Status::Unknown
            };
            Ok(FileMd5 {
                file,
                path,
                md5,
                status,
            })
        })
        .collect::<Result<_>>()?;
    Ok(Md5Report { files })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{Style, vendored_mnist_dir, write_dataset};

    #[test]
    fn md5_hex_known_value() {
        assert_eq!(md5_hex(b""), "d41d8cd98f00b204e9800998ecf8427e");
    }

    #[test]
    fn vendored_mnist_md5s_match() {
        let report = verify_md5(vendored_mnist_dir()).unwrap();
        assert!(report.is_mnist(), "{report}");
        report.require_mnist().unwrap();
        assert_eq!(report.files.len(), 4);
    }

    #[test]
    fn other_dataset_reports_unknown() {
        let dir = tempfile::tempdir().unwrap();
        write_dataset(dir.path(), Style::Dot, true, 5, 5, 2, 2);
        let report = verify_md5(dir.path()).unwrap();
        assert!(report.files.iter().all(|f| f.status == Md5Status::Unknown));
        assert!(!report.is_mnist() && !report.is_partial_mnist());
        let err = report.require_mnist().unwrap_err();
        assert!(matches!(err, DataError::ChecksumMismatch { ref files } if files.len() == 4));
    }
}
