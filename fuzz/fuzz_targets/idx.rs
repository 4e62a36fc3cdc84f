//! The IDX reader from bytes: gzip detection and decompression, then the images and labels
//! headers. Properties: garbage is an error, never a panic; no allocation proportional to a
//! claimed size (gzip size trailer, dimensions); parsed images hold count*rows*cols pixels.
#![no_main]

use std::path::Path;

use flotilla_data::idx;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = Path::new("fuzz.idx");
    // A content limit well inside libFuzzer's memory limit; the real reader uses MAX_IDX_BYTES.
    let Ok(bytes) = idx::decode_maybe_gz(data.to_vec(), path, 1 << 26) else {
        return;
    };
    if let Ok(images) = idx::parse_images(bytes.clone(), path) {
        assert_eq!(
            images.pixels.len(),
            images.count * images.rows * images.cols
        );
    }
    if let Ok(labels) = idx::parse_labels(bytes.clone(), path) {
        assert_eq!(labels.len() + 8, bytes.len());
    }
});
