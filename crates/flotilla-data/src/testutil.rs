//! Helpers for building small IDX files in tests.

use std::io::Write;
use std::path::{Path, PathBuf};

use flate2::Compression;
use flate2::write::GzEncoder;

use crate::files::MnistFile;
use crate::idx::{IMAGES_MAGIC, LABELS_MAGIC};

/// Serialises an IDX file: magic, big-endian dims, data.
pub fn idx_bytes(magic: u32, dims: &[u32], data: &[u8]) -> Vec<u8> {
    let mut out = magic.to_be_bytes().to_vec();
    for d in dims {
        out.extend_from_slice(&d.to_be_bytes());
    }
    out.extend_from_slice(data);
    out
}

/// Writes `content` to `dir/name`, gzip-compressed if `gz`.
pub fn write_file(dir: &Path, name: &str, content: &[u8], gz: bool) -> PathBuf {
    let path = dir.join(name);
    let bytes = if gz {
        let mut enc = GzEncoder::new(Vec::new(), Compression::fast());
        enc.write_all(content).unwrap();
        enc.finish().unwrap()
    } else {
        content.to_vec()
    };
    std::fs::write(&path, bytes).unwrap();
    path
}

/// Naming style of the four files.
#[derive(Clone, Copy)]
pub enum Style {
    /// `train-images-idx3-ubyte`
    Hyphen,
    /// `train-images.idx3-ubyte`
    Dot,
}

/// File name for `file` in `style`, with `.gz` appended if `gz`.
pub fn file_name(file: MnistFile, style: Style, gz: bool) -> String {
    let [hyphen, dot] = file.base_names();
    let base = match style {
        Style::Hyphen => hyphen,
        Style::Dot => dot,
    };
    if gz {
        format!("{base}.gz")
    } else {
        base.to_owned()
    }
}

/// Pixel value of pixel `p` of image `i` in a synthetic data set.
pub fn pixel(i: usize, p: usize) -> u8 {
    ((i * 31 + p * 7) % 256) as u8
}

/// Writes a synthetic 4-file data set of `train`/`test` images of `rows x cols`.
/// Label of image `i` is `i % 10`.
pub fn write_dataset(
    dir: &Path,
    style: Style,
    gz: bool,
    train: u32,
    test: u32,
    rows: u32,
    cols: u32,
) {
    let size = (rows * cols) as usize;
    for (count, images, labels) in [
        (train, MnistFile::TrainImages, MnistFile::TrainLabels),
        (test, MnistFile::TestImages, MnistFile::TestLabels),
    ] {
        let n = count as usize;
        let px: Vec<u8> = (0..n * size).map(|k| pixel(k / size, k % size)).collect();
        let lb: Vec<u8> = (0..n).map(|i| (i % 10) as u8).collect();
        write_file(
            dir,
            &file_name(images, style, gz),
            &idx_bytes(IMAGES_MAGIC, &[count, rows, cols], &px),
            gz,
        );
        write_file(
            dir,
            &file_name(labels, style, gz),
            &idx_bytes(LABELS_MAGIC, &[count], &lb),
            gz,
        );
    }
}

/// The vendored MNIST directory of the repository.
pub fn vendored_mnist_dir() -> PathBuf {
    manifest_dir().join("../../data/mnist")
}

/// The crate's directory, read at run time (cargo sets it for tests), so that a test binary
/// reused from a build in another checkout reads this checkout's files.
fn manifest_dir() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}
