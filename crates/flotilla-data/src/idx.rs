//! Reader for the IDX file format used by MNIST and its look-alikes.
//!
//! An IDX file is a big-endian header followed by raw data:
//!
//! ```text
//! bytes 0..2   zero
//! byte  2      element type (0x08 = u8, 0x09 = i8, 0x0B = i16, 0x0C = i32, 0x0D = f32, 0x0E = f64)
//! byte  3      number of dimensions d
//! then d x u32 dimension sizes, then prod(dims) elements
//! ```
//!
//! Only the two layouts MNIST needs are accepted: [`IMAGES_MAGIC`] (`u8`, 3-D) and
//! [`LABELS_MAGIC`] (`u8`, 1-D). Files may be gzip-compressed; compression is detected
//! from the gzip magic bytes `1f 8b`, not from the file extension (browsers sometimes
//! decompress a download but keep its `.gz` name).

use std::fs;
use std::io::Read;
use std::path::Path;

use flate2::read::MultiGzDecoder;

use crate::error::{DataError, Result};

/// Magic number of an IDX file holding `u8` values in 3 dimensions (images).
pub const IMAGES_MAGIC: u32 = 0x0000_0803;
/// Magic number of an IDX file holding `u8` values in 1 dimension (labels).
pub const LABELS_MAGIC: u32 = 0x0000_0801;

/// The longest IDX header: magic and 255 dimension sizes.
pub const MAX_HEADER_BYTES: usize = 4 * 256;
/// The two leading bytes of every gzip stream.
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];
/// Upper bound on the capacity pre-reserved from a gzip size trailer (it may be corrupt).
const MAX_SIZE_HINT: usize = 1 << 30;
/// The largest IDX content read (raw, or after decompression), in bytes: a bigger file, or a
/// gzip stream that expands beyond it, is [`DataError::TooLarge`], never an allocation.
pub const MAX_IDX_BYTES: u64 = 4 << 30;
/// Deflate expands at most about 1032:1, so a trailer claiming more than this many bytes per
/// compressed byte is corrupt and only this much is pre-reserved.
const MAX_DEFLATE_RATIO: usize = 1032;

/// A decoded IDX images file: `count` images of `rows x cols` `u8` pixels, row-major.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdxImages {
    /// Number of images.
    pub count: usize,
    /// Rows per image.
    pub rows: usize,
    /// Columns per image.
    pub cols: usize,
    /// `count * rows * cols` pixels, image after image, each row-major.
    pub pixels: Vec<u8>,
}

/// Returns `true` if `bytes` starts with the gzip magic `1f 8b`.
pub fn is_gzip(bytes: &[u8]) -> bool {
    bytes.starts_with(&GZIP_MAGIC)
}

/// Reads a whole file, transparently decompressing it if it is gzip data, up to
/// [`MAX_IDX_BYTES`].
///
/// # Errors
/// [`DataError::Io`] if the file cannot be read, [`DataError::Gzip`] if it looks like
/// gzip but does not decompress (corrupt or truncated), [`DataError::TooLarge`] past the
/// limit.
pub fn read_maybe_gz(path: &Path) -> Result<Vec<u8>> {
    read_maybe_gz_limited(path, MAX_IDX_BYTES)
}

/// [`read_maybe_gz`] with a limit of `max` bytes (file and decompressed content alike).
pub fn read_maybe_gz_limited(path: &Path, max: u64) -> Result<Vec<u8>> {
    let io = |source| DataError::Io {
        path: path.to_path_buf(),
        source,
    };
    if fs::metadata(path).map_err(io)?.len() > max {
        return Err(DataError::TooLarge {
            path: path.to_path_buf(),
            what: "file",
            max,
        });
    }
    let raw = fs::read(path).map_err(io)?;
    decode_maybe_gz(raw, path, max)
}

/// The content of a file's bytes `raw`: gunzipped if they are gzip data, else as they are,
/// at most `max` bytes either way. `path` is only used in error messages.
///
/// # Errors
/// [`DataError::Gzip`] if `raw` looks like gzip but does not decompress,
/// [`DataError::TooLarge`] if the content exceeds `max`.
pub fn decode_maybe_gz(raw: Vec<u8>, path: &Path, max: u64) -> Result<Vec<u8>> {
    let too_large = |what: &'static str| DataError::TooLarge {
        path: path.to_path_buf(),
        what,
        max,
    };
    if raw.len() as u64 > max {
        return Err(too_large("file"));
    }
    if !is_gzip(&raw) {
        return Ok(raw);
    }
    // ISIZE trailer: uncompressed size mod 2^32, little-endian. Only a capacity hint.
    let hint = raw
        .len()
        .checked_sub(4)
        .and_then(|at| raw.get(at..))
        .and_then(|t| <[u8; 4]>::try_from(t).ok())
        .map_or(0, |t| u32::from_le_bytes(t) as usize)
        .min(raw.len().saturating_mul(MAX_DEFLATE_RATIO))
        .min(MAX_SIZE_HINT)
        .min(usize::try_from(max).unwrap_or(usize::MAX));
    let mut out = Vec::with_capacity(hint);
    // One byte past the limit tells a stream that expands too far from one that fits.
    MultiGzDecoder::new(raw.as_slice())
        .take(max.saturating_add(1))
        .read_to_end(&mut out)
        .map_err(|source| DataError::Gzip {
            path: path.to_path_buf(),
            source,
        })?;
    if out.len() as u64 > max {
        return Err(too_large("decompressed content"));
    }
    Ok(out)
}

/// Describes an IDX magic number in words, for error messages.
pub fn describe_magic(magic: u32) -> String {
    let [z0, z1, ty, ndims] = magic.to_be_bytes();
    if z0 != 0 || z1 != 0 {
        return "not an IDX file: first two bytes are not zero".to_owned();
    }
    let ty = match ty {
        0x08 => "u8",
        0x09 => "i8",
        0x0B => "i16",
        0x0C => "i32",
        0x0D => "f32",
        0x0E => "f64",
        _ => "unknown element type",
    };
    format!("{ty}, {ndims}-D")
}

/// Parses the header of IDX content and checks its magic number and data size.
///
/// Returns the dimensions and the byte offset where the data starts. `path` is only
/// used in error messages.
///
/// # Errors
/// [`DataError::TruncatedHeader`], [`DataError::BadMagic`], [`DataError::BadDimensions`],
/// [`DataError::Truncated`] or [`DataError::TrailingData`].
pub fn parse_header(bytes: &[u8], expected_magic: u32, path: &Path) -> Result<(Vec<usize>, usize)> {
    parse_header_of(bytes, bytes.len() as u64, expected_magic, path)
}

/// [`parse_header`] of content `len` bytes long of which `head` is the beginning (at least
/// the header, [`MAX_HEADER_BYTES`] are always enough): how a file read by position is
/// checked without reading its data.
///
/// # Errors
/// As [`parse_header`].
pub fn parse_header_of(
    head: &[u8],
    len: u64,
    expected_magic: u32,
    path: &Path,
) -> Result<(Vec<usize>, usize)> {
    let len = usize::try_from(len).unwrap_or(usize::MAX);
    let bytes = &head[..head.len().min(len)];
    let word = |i: usize| -> Option<u32> {
        let b = bytes.get(4 * i..4 * i + 4)?;
        Some(u32::from_be_bytes(<[u8; 4]>::try_from(b).ok()?))
    };
    let truncated_header = |expected: usize| DataError::TruncatedHeader {
        path: path.to_path_buf(),
        expected,
        actual: len,
    };
    let magic = word(0).ok_or_else(|| truncated_header(4))?;
    if magic != expected_magic {
        return Err(DataError::BadMagic {
            path: path.to_path_buf(),
            found: magic,
            found_desc: describe_magic(magic),
            expected: expected_magic,
            expected_desc: describe_magic(expected_magic),
        });
    }
    let ndims = (magic & 0xff) as usize;
    let offset = 4 * (1 + ndims);
    let dims_u32: Vec<u32> = (1..=ndims)
        .map(word)
        .collect::<Option<_>>()
        .ok_or_else(|| truncated_header(offset))?;
    let dims: Vec<usize> = dims_u32.iter().map(|&d| d as usize).collect();
    let expected = dims
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| DataError::BadDimensions {
            path: path.to_path_buf(),
            dims: dims_u32.clone(),
            reason: "element count overflows usize",
        })?;
    let actual = len - offset;
    if actual < expected {
        return Err(DataError::Truncated {
            path: path.to_path_buf(),
            dims: dims_u32,
            expected,
            actual,
        });
    }
    if actual > expected {
        return Err(DataError::TrailingData {
            path: path.to_path_buf(),
            dims: dims_u32,
            expected,
            actual,
        });
    }
    Ok((dims, offset))
}

/// Parses in-memory (already decompressed) IDX images content.
///
/// # Errors
/// See [`parse_header`]; additionally [`DataError::BadDimensions`] if an image has zero
/// rows or columns.
pub fn parse_images(mut bytes: Vec<u8>, path: &Path) -> Result<IdxImages> {
    let (dims, offset) = parse_header(&bytes, IMAGES_MAGIC, path)?;
    let &[count, rows, cols] = dims.as_slice() else {
        // Unreachable: the magic fixes the number of dimensions to 3.
        return Err(DataError::BadDimensions {
            path: path.to_path_buf(),
            dims: dims.iter().map(|&d| d as u32).collect(),
            reason: "images must be 3-D",
        });
    };
    if rows == 0 || cols == 0 {
        return Err(DataError::BadDimensions {
            path: path.to_path_buf(),
            dims: dims.iter().map(|&d| d as u32).collect(),
            reason: "images must have at least one row and one column",
        });
    }
    bytes.drain(..offset);
    Ok(IdxImages {
        count,
        rows,
        cols,
        pixels: bytes,
    })
}

/// Parses in-memory (already decompressed) IDX labels content.
///
/// # Errors
/// See [`parse_header`].
pub fn parse_labels(mut bytes: Vec<u8>, path: &Path) -> Result<Vec<u8>> {
    let (_dims, offset) = parse_header(&bytes, LABELS_MAGIC, path)?;
    bytes.drain(..offset);
    Ok(bytes)
}

/// Reads an IDX images file (`u8`, 3-D), gzipped or raw.
///
/// # Errors
/// See [`read_maybe_gz`] and [`parse_images`].
pub fn read_images(path: &Path) -> Result<IdxImages> {
    parse_images(read_maybe_gz(path)?, path)
}

/// Reads an IDX labels file (`u8`, 1-D), gzipped or raw.
///
/// # Errors
/// See [`read_maybe_gz`] and [`parse_labels`].
pub fn read_labels(path: &Path) -> Result<Vec<u8>> {
    parse_labels(read_maybe_gz(path)?, path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{idx_bytes, write_file};

    /// Fuzzing found: 15 bytes with the gzip magic and a size trailer of 1 GiB made the
    /// reader reserve 1 GiB before decompressing anything. The reservation is now bounded
    /// by deflate's ratio to the compressed size; the data is still refused.
    #[test]
    fn a_lying_gzip_trailer_reserves_little_and_is_refused() {
        let raw = vec![
            0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0x3d, 0, 0, 0, 0x01, 0x1c, 0x66,
        ];
        let hint = u32::from_le_bytes([0, 0x01, 0x1c, 0x66]) as usize;
        assert!(hint > raw.len() * MAX_DEFLATE_RATIO);
        assert!(matches!(
            decode_maybe_gz(raw, Path::new("x.gz"), MAX_IDX_BYTES),
            Err(DataError::Gzip { .. })
        ));
    }

    #[test]
    fn raw_and_gzip_read_identically() {
        let dir = tempfile::tempdir().unwrap();
        let content = idx_bytes(
            IMAGES_MAGIC,
            &[2, 2, 3],
            &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
        );
        let raw = write_file(dir.path(), "a", &content, false);
        let gz = write_file(dir.path(), "b", &content, true);
        let a = read_images(&raw).unwrap();
        let b = read_images(&gz).unwrap();
        assert_eq!(a, b);
        assert_eq!((a.count, a.rows, a.cols), (2, 2, 3));
        assert_eq!(a.pixels, (1..=12).collect::<Vec<u8>>());
    }

    #[test]
    fn content_beyond_the_limit_is_refused_without_reading_it_all() {
        let dir = tempfile::tempdir().unwrap();
        // A gzip bomb: 64 MiB of zeros in a few KiB; with a 1 MiB limit it stops after 1 MiB.
        let bomb = vec![0u8; 64 << 20];
        let gz = write_file(dir.path(), "bomb", &bomb, true);
        assert!(std::fs::metadata(&gz).unwrap().len() < 1 << 20);
        let t = std::time::Instant::now();
        let e = read_maybe_gz_limited(&gz, 1 << 20).expect_err("too large");
        assert!(t.elapsed() < std::time::Duration::from_secs(2));
        let msg = e.to_string();
        assert!(
            msg.contains("decompressed content") && msg.contains("1048576"),
            "{msg}"
        );
        let raw = write_file(dir.path(), "raw", &[0u8; 4096], false);
        let e = read_maybe_gz_limited(&raw, 1024).expect_err("raw too large");
        assert!(e.to_string().contains("file"), "{e}");
        assert_eq!(read_maybe_gz_limited(&raw, 4096).unwrap().len(), 4096);
    }

    /// A header announcing huge dimensions is checked against the file's length (overflow
    /// checked), so it is an error at once, never an allocation of its size.
    #[test]
    fn huge_header_dimensions_are_refused_at_once() {
        let p = Path::new("crafted");
        let t = std::time::Instant::now();
        let mut h = IMAGES_MAGIC.to_be_bytes().to_vec();
        for d in [u32::MAX, u32::MAX, u32::MAX] {
            h.extend_from_slice(&d.to_be_bytes());
        }
        let e = parse_header(&h, IMAGES_MAGIC, p).expect_err("overflow or truncated");
        assert!(
            matches!(
                e,
                DataError::BadDimensions { .. } | DataError::Truncated { .. }
            ),
            "{e}"
        );
        let mut h = IMAGES_MAGIC.to_be_bytes().to_vec();
        for d in [60_000u32, 28, 28] {
            h.extend_from_slice(&d.to_be_bytes());
        }
        let e = parse_header(&h, IMAGES_MAGIC, p).expect_err("truncated");
        assert!(matches!(e, DataError::Truncated { .. }), "{e}");
        assert!(t.elapsed() < std::time::Duration::from_millis(100));
    }

    #[test]
    fn gzip_detected_by_magic_not_extension() {
        let dir = tempfile::tempdir().unwrap();
        let content = idx_bytes(LABELS_MAGIC, &[3], &[7, 8, 9]);
        // Raw content with a .gz name, gzip content without one.
        let raw = write_file(dir.path(), "raw.gz", &content, false);
        let gz = write_file(dir.path(), "gz.bin", &content, true);
        assert_eq!(read_labels(&raw).unwrap(), vec![7, 8, 9]);
        assert_eq!(read_labels(&gz).unwrap(), vec![7, 8, 9]);
    }

    #[test]
    fn bad_magic_names_file_and_magic() {
        let dir = tempfile::tempdir().unwrap();
        // An f32 3-D file handed to the labels reader.
        let content = idx_bytes(0x0000_0D03, &[1, 1, 1], &[0, 0, 0, 0]);
        let p = write_file(dir.path(), "weird-idx", &content, true);
        let err = read_labels(&p).unwrap_err();
        assert!(
            matches!(err, DataError::BadMagic { found: 0x0D03, .. }),
            "{err:?}"
        );
        let msg = err.to_string();
        assert!(msg.contains("weird-idx"), "{msg}");
        assert!(msg.contains("0x00000D03"), "{msg}");
        assert!(msg.contains("f32, 3-D"), "{msg}");
        assert!(msg.contains("0x00000801"), "{msg}");

        let html = write_file(dir.path(), "page.html", b"<html>not found</html>", false);
        let msg = read_images(&html).unwrap_err().to_string();
        assert!(msg.contains("not an IDX file"), "{msg}");
    }

    #[test]
    fn truncated_data_reports_expected_and_actual() {
        let dir = tempfile::tempdir().unwrap();
        let mut content = idx_bytes(IMAGES_MAGIC, &[2, 4, 4], &[0; 32]);
        content.truncate(content.len() - 5);
        let p = write_file(dir.path(), "short", &content, true);
        let err = read_images(&p).unwrap_err();
        assert!(
            matches!(
                err,
                DataError::Truncated {
                    expected: 32,
                    actual: 27,
                    ..
                }
            ),
            "{err:?}"
        );
        let msg = err.to_string();
        assert!(
            msg.contains("short") && msg.contains("32") && msg.contains("27"),
            "{msg}"
        );
    }

    #[test]
    fn truncated_header_and_trailing_data() {
        let dir = tempfile::tempdir().unwrap();
        let content = idx_bytes(IMAGES_MAGIC, &[1, 1, 1], &[0]);
        let p = write_file(dir.path(), "hdr", &content[..9], false);
        let err = read_images(&p).unwrap_err();
        assert!(
            matches!(
                err,
                DataError::TruncatedHeader {
                    expected: 16,
                    actual: 9,
                    ..
                }
            ),
            "{err:?}"
        );
        let p = write_file(dir.path(), "tiny", &content[..2], false);
        assert!(matches!(
            read_images(&p).unwrap_err(),
            DataError::TruncatedHeader {
                expected: 4,
                actual: 2,
                ..
            }
        ));
        let mut long = content.clone();
        long.push(0);
        let p = write_file(dir.path(), "long", &long, false);
        assert!(matches!(
            read_images(&p).unwrap_err(),
            DataError::TrailingData {
                expected: 1,
                actual: 2,
                ..
            }
        ));
    }

    #[test]
    fn truncated_gzip_stream_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let content = idx_bytes(LABELS_MAGIC, &[1000], &[3; 1000]);
        let p = write_file(dir.path(), "cut.gz", &content, true);
        let gz = std::fs::read(&p).unwrap();
        std::fs::write(&p, &gz[..gz.len() / 2]).unwrap();
        let err = read_labels(&p).unwrap_err();
        assert!(matches!(err, DataError::Gzip { .. }), "{err:?}");
        assert!(err.to_string().contains("cut.gz"));
    }

    #[test]
    fn zero_sized_images_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let p = write_file(
            dir.path(),
            "z",
            &idx_bytes(IMAGES_MAGIC, &[3, 0, 28], &[]),
            false,
        );
        assert!(matches!(
            read_images(&p).unwrap_err(),
            DataError::BadDimensions { .. }
        ));
    }

    #[test]
    fn missing_file_is_io_error_with_path() {
        let err = read_labels(Path::new("/nonexistent/flotilla/labels")).unwrap_err();
        assert!(matches!(err, DataError::Io { .. }));
        assert!(err.to_string().contains("/nonexistent/flotilla/labels"));
    }
}
