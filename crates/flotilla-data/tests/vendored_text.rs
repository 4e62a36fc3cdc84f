//! The vendored text (`data/text/kjv.txt`) is the file its README describes.

use sha2::{Digest, Sha256};

#[test]
fn the_vendored_text_has_its_documented_checksum_and_splits() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/text/kjv.txt");
    let bytes = std::fs::read(&path).expect("data/text/kjv.txt");
    let digest: String = Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(digest, flotilla_data::text::KJV_SHA256);
    assert_eq!(bytes.len(), 1_000_040);
    let s = flotilla_data::TextSplits::load(&path, 64).expect("splits");
    assert_eq!(s.train.tokens(), 900_036);
    assert_eq!(s.validation.len(), 100_004 / 64);
}
