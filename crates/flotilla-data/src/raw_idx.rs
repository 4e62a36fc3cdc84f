//! A gzipped IDX file as a raw one that can be read by position: decompressed once, as a
//! stream, into a cache directory shared by every rank and run on the machine, under the MD5
//! of the compressed file (so a changed file gets a new copy). A raw file is used as it is.
//!
//! The copy is written to a temporary name and renamed into place, so ranks that start
//! together and race to write it each end with a complete file.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};

use flate2::read::MultiGzDecoder;
use md5::{Digest, Md5};

use crate::error::{DataError, Result};
use crate::idx::{MAX_IDX_BYTES, is_gzip};

/// The environment variable naming the cache directory of decompressed IDX files.
pub const CACHE_DIR_VAR: &str = "FLOTILLA_CACHE_DIR";

/// Where decompressed IDX files are kept: `$FLOTILLA_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/flotilla`, else `$HOME/.cache/flotilla`, else this user's own
/// `flotilla-cache-<uid>` in the temporary directory (see [`cache_dir_in`]).
///
/// # Errors
/// [`DataError::UnsafeCache`] when the directory in the temporary directory is not this
/// user's private one, [`DataError::Io`] when it cannot be made.
pub fn default_cache_dir() -> Result<PathBuf> {
    cache_dir_in(|name| std::env::var_os(name), &std::env::temp_dir())
}

/// [`default_cache_dir`] with the environment's variables read by `var` and the temporary
/// directory `tmp`. The fallback in `tmp`, a directory every user can write to, is made
/// mode 0700 and is used only while it is a directory (not a link) of this user that no
/// other user may read or write: a directory another user made there first (to read our
/// copies, or swap them) is refused, naming it. The others are the user's own choice and are
/// used as they are (made 0700 when missing).
pub fn cache_dir_in(
    var: impl Fn(&str) -> Option<std::ffi::OsString>,
    tmp: &Path,
) -> Result<PathBuf> {
    let var = |name: &str| var(name).filter(|v| !v.is_empty());
    if let Some(dir) = var(CACHE_DIR_VAR) {
        return Ok(PathBuf::from(dir));
    }
    if let Some(dir) = var("XDG_CACHE_HOME") {
        return Ok(PathBuf::from(dir).join("flotilla"));
    }
    if let Some(home) = var("HOME") {
        return Ok(PathBuf::from(home).join(".cache").join("flotilla"));
    }
    let uid = rustix::process::getuid().as_raw();
    let dir = tmp.join(format!("flotilla-cache-{uid}"));
    match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io(&dir)(e)),
    }
    check_private(&dir, uid)?;
    Ok(dir)
}

/// Refuses `dir` unless it is a directory (not a link) owned by `uid` with no permission for
/// its group or others.
fn check_private(dir: &Path, uid: u32) -> Result<()> {
    let meta = std::fs::symlink_metadata(dir).map_err(io(dir))?;
    let why = if !meta.file_type().is_dir() {
        Some("it is not a directory (a link or a file)".to_string())
    } else if meta.uid() != uid {
        Some(format!(
            "it belongs to user {}, not to this user ({uid})",
            meta.uid()
        ))
    } else if meta.mode() & 0o077 != 0 {
        Some(format!(
            "its mode {:o} lets other users in (want 0700)",
            meta.mode() & 0o777
        ))
    } else {
        None
    };
    match why {
        Some(reason) => Err(DataError::UnsafeCache {
            path: dir.to_path_buf(),
            reason,
        }),
        None => Ok(()),
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
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(cache)
        .map_err(io(cache))?;
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

    /// With no `HOME` (nor `XDG_CACHE_HOME`, nor `FLOTILLA_CACHE_DIR`) the cache is this user's
    /// own 0700 directory in the temporary directory; one that another user could reach is
    /// refused.
    #[test]
    fn without_home_the_cache_is_a_private_directory_of_this_user() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().expect("dir");
        let none = |_: &str| None;
        let dir = cache_dir_in(none, tmp.path()).expect("cache");
        let uid = rustix::process::getuid().as_raw();
        assert_eq!(dir, tmp.path().join(format!("flotilla-cache-{uid}")));
        let meta = std::fs::symlink_metadata(&dir).expect("made");
        assert!(meta.is_dir());
        assert_eq!((meta.uid(), meta.mode() & 0o777), (uid, 0o700));
        // Used again as it is.
        assert_eq!(cache_dir_in(none, tmp.path()).expect("again"), dir);
        // Opened to others (another user made it, or a umask did): refused, named.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        let e = cache_dir_in(none, tmp.path()).expect_err("world-writable");
        assert!(
            matches!(&e, DataError::UnsafeCache { path, .. } if *path == dir),
            "{e}"
        );
        std::fs::remove_dir(&dir).expect("rmdir");
        // A link planted at its name: refused, not followed.
        let elsewhere = tmp.path().join("elsewhere");
        std::fs::create_dir(&elsewhere).expect("mkdir");
        std::os::unix::fs::symlink(&elsewhere, &dir).expect("symlink");
        let e = cache_dir_in(none, tmp.path()).expect_err("a link");
        assert!(e.to_string().contains("not a directory"), "{e}");
        std::fs::remove_file(&dir).expect("unlink");
        // Another user's directory (as root, the test can make one): refused.
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .expect("mkdir");
        if uid == 0 {
            std::os::unix::fs::chown(&dir, Some(12345), None).expect("chown");
            let e = cache_dir_in(none, tmp.path()).expect_err("another user's");
            assert!(e.to_string().contains("belongs to user 12345"), "{e}");
        }
        // The user's own settings come first, in order.
        let vars = |name: &str| match name {
            "HOME" => Some("/home/u".into()),
            "XDG_CACHE_HOME" => Some("".into()),
            _ => None,
        };
        assert_eq!(
            cache_dir_in(vars, tmp.path()).expect("home"),
            PathBuf::from("/home/u/.cache/flotilla")
        );
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
