//! A gzipped IDX file as a raw one that can be read by position: decompressed once, as a
//! stream, into a cache directory shared by every rank and run on the machine, under the MD5
//! of the compressed file (so a changed file gets a new copy). A raw file is used as it is.
//!
//! The copy is written to a temporary name and renamed into place, so ranks that start
//! together and race to write it each end with a complete file.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use flate2::read::MultiGzDecoder;
use md5::{Digest, Md5};

use crate::error::{DataError, Result};
use crate::idx::{MAX_IDX_BYTES, is_gzip};

/// The environment variable naming the cache directory of decompressed IDX files.
pub const CACHE_DIR_VAR: &str = "FLOTILLA_CACHE_DIR";

/// Where decompressed IDX files are kept: `$FLOTILLA_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/flotilla`, else `$HOME/.cache/flotilla`, else `flotilla-cache` in the
/// temporary directory.
pub fn default_cache_dir() -> PathBuf {
    let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
    if let Some(dir) = var(CACHE_DIR_VAR) {
        return PathBuf::from(dir);
    }
    if let Some(dir) = var("XDG_CACHE_HOME") {
        return PathBuf::from(dir).join("flotilla");
    }
    match var("HOME") {
        Some(home) => PathBuf::from(home).join(".cache").join("flotilla"),
        None => std::env::temp_dir().join("flotilla-cache"),
    }
}

/// The path of `path`'s content as a raw (uncompressed) file: `path` itself if it is not
/// gzip data, else its decompressed copy in `cache` (made now if missing), at most
/// [`MAX_IDX_BYTES`] long.
///
/// # Errors
/// [`DataError::Io`] if a file cannot be read or the copy written, [`DataError::Gzip`] if the
/// file does not decompress, [`DataError::TooLarge`] past the limit.
pub fn raw_idx(path: &Path, cache: &Path) -> Result<PathBuf> {
    let mut magic = [0u8; 2];
    let mut file = File::open(path).map_err(io(path))?;
    let read = file.read(&mut magic).map_err(io(path))?;
    if !is_gzip(&magic[..read]) {
        return Ok(path.to_path_buf());
    }
    let name = path
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    let stem = name.strip_suffix(".gz").unwrap_or(&name);
    let copy = cache.join(format!("{}-{stem}", md5_of(path)?));
    if !copy.is_file() {
        decompress(path, cache, &copy)?;
    }
    Ok(copy)
}

/// MD5 (lower-case hex) of the file `path`, read in blocks.
fn md5_of(path: &Path) -> Result<String> {
    let mut reader = BufReader::new(File::open(path).map_err(io(path))?);
    let mut hasher = Md5::new();
    let mut block = vec![0u8; 1 << 16];
    loop {
        let n = reader.read(&mut block).map_err(io(path))?;
        if n == 0 {
            break;
        }
        hasher.update(&block[..n]);
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// Decompresses `path` into `copy` in the directory `cache`: into a temporary file first,
/// renamed into place when complete.
fn decompress(path: &Path, cache: &Path, copy: &Path) -> Result<()> {
    std::fs::create_dir_all(cache).map_err(io(cache))?;
    let partial = copy.with_extension(format!("{}.partial", std::process::id()));
    let written = (|| {
        let source = BufReader::new(File::open(path).map_err(io(path))?);
        let mut decoder = MultiGzDecoder::new(source).take(MAX_IDX_BYTES.saturating_add(1));
        let mut out = BufWriter::new(File::create(&partial).map_err(io(&partial))?);
        let n = std::io::copy(&mut decoder, &mut out).map_err(|source| DataError::Gzip {
            path: path.to_path_buf(),
            source,
        })?;
        out.flush().map_err(io(&partial))?;
        if n > MAX_IDX_BYTES {
            return Err(DataError::TooLarge {
                path: path.to_path_buf(),
                what: "decompressed content",
                max: MAX_IDX_BYTES,
            });
        }
        std::fs::rename(&partial, copy).map_err(io(copy))
    })();
    if written.is_err() {
        // Best effort: a partial copy is never used, only its space is lost.
        let _ = std::fs::remove_file(&partial);
    }
    written
}

/// The [`DataError::Io`] of an operation on `path`.
fn io(path: &Path) -> impl Fn(std::io::Error) -> DataError + '_ {
    move |source| DataError::Io {
        path: path.to_path_buf(),
        source,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::write_file;

    #[test]
    fn a_gzip_file_is_decompressed_once_and_a_raw_one_used_as_it_is() {
        let dir = tempfile::tempdir().expect("dir");
        let cache = dir.path().join("cache");
        let content: Vec<u8> = (0..5000u32).map(|i| (i * 7 % 251) as u8).collect();
        let gz = write_file(dir.path(), "x-idx3-ubyte.gz", &content, true);
        let raw = write_file(dir.path(), "y", &content, false);
        assert_eq!(raw_idx(&raw, &cache).expect("raw"), raw);
        let copy = raw_idx(&gz, &cache).expect("copy");
        assert!(copy.starts_with(&cache));
        assert!(
            copy.to_string_lossy().ends_with("-x-idx3-ubyte"),
            "{copy:?}"
        );
        assert_eq!(std::fs::read(&copy).expect("read"), content);
        // A second call finds the copy (its mtime is unchanged).
        let mtime = std::fs::metadata(&copy).and_then(|m| m.modified()).ok();
        assert_eq!(raw_idx(&gz, &cache).expect("again"), copy);
        assert_eq!(
            std::fs::metadata(&copy).and_then(|m| m.modified()).ok(),
            mtime
        );
        // Other content, another copy.
        let other = write_file(dir.path(), "x-idx3-ubyte.gz", &content[1..], true);
        assert_ne!(raw_idx(&other, &cache).expect("other"), copy);
    }

    #[test]
    fn a_corrupt_gzip_file_leaves_no_copy() {
        let dir = tempfile::tempdir().expect("dir");
        let cache = dir.path().join("cache");
        let path = dir.path().join("bad.gz");
        std::fs::write(&path, [0x1f, 0x8b, 8, 0, 1, 2, 3]).expect("write");
        assert!(matches!(
            raw_idx(&path, &cache),
            Err(DataError::Gzip { .. })
        ));
        let left = std::fs::read_dir(&cache).map_or(0, |d| d.count());
        assert_eq!(left, 0);
    }
}
