//! The merged weights file laid out from the stages' headers and written block by block, in
//! any order: a safetensors file the `safetensors` crate reads, every tensor the stage's own
//! under its name (or its stage's when names repeat), stage 0's metadata without its stage.

use std::collections::HashMap;
use std::path::Path;

use safetensors::{Dtype, SafeTensors, tensor::TensorView};

use super::{MergedWeights, data_of, header_of, write_block};

/// A stage's safetensors file: tensors named `names`, the i-th of shape `[i + 1]` valued
/// `value + i`, and metadata naming `stage`.
fn stage_file(names: &[&str], value: f32, stage: usize) -> Vec<u8> {
    let data: Vec<Vec<u8>> = (0..names.len())
        .map(|i| {
            (0..=i)
                .flat_map(|_| (value + i as f32).to_le_bytes())
                .collect()
        })
        .collect();
    let views: Vec<_> = names
        .iter()
        .zip(&data)
        .enumerate()
        .map(|(i, (n, d))| {
            let view = TensorView::new(Dtype::F32, vec![i + 1], d).expect("view");
            (n.to_string(), view)
        })
        .collect();
    let meta = HashMap::from([
        ("format".to_string(), "pt".to_string()),
        ("flotilla.stage".to_string(), stage.to_string()),
    ]);
    safetensors::serialize(views, Some(meta)).expect("serialize")
}

/// The layout of the merged file of `stages`, made at `path`.
fn create(stages: &[Vec<u8>], path: &Path) -> MergedWeights {
    let out = Path::new("m");
    let headers: Vec<&[u8]> = stages
        .iter()
        .map(|s| header_of(s, out).expect("header"))
        .collect();
    let merged = MergedWeights::new(&headers, out).expect("layout");
    drop(merged.create(path).expect("create"));
    merged
}

/// The merged file of `stages`, their blocks written last stage first, and its layout.
fn merge(stages: &[Vec<u8>]) -> (Vec<u8>, MergedWeights) {
    let out = Path::new("m");
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("model.safetensors");
    let merged = create(stages, &path);
    for (k, s) in stages.iter().enumerate().rev() {
        let block = merged.block(k, out).expect("block");
        write_block(&path, block, data_of(s, out).expect("data")).expect("write");
    }
    (std::fs::read(&path).expect("read"), merged)
}

/// Every tensor of `file` by name: its shape and bytes.
fn tensors(file: &[u8]) -> HashMap<String, (Vec<usize>, Vec<u8>)> {
    let st = SafeTensors::deserialize(file).expect("a valid safetensors file");
    st.tensors()
        .into_iter()
        .map(|(n, v)| (n, (v.shape().to_vec(), v.data().to_vec())))
        .collect()
}

#[test]
fn stage_weights_merge_under_their_names_or_their_stages_when_names_repeat() {
    let stages = [
        stage_file(&["l0.w", "l0.b"], 1.0, 0),
        stage_file(&["l1.w", "l1.b", "l1.c"], 2.0, 1),
    ];
    let (file, merged) = merge(&stages);
    assert_eq!(merged.values(), 1 + 2 + 1 + 2 + 3);
    let got = tensors(&file);
    let mut want = HashMap::new();
    for (k, s) in stages.iter().enumerate() {
        for (name, t) in tensors(s) {
            assert!(got.contains_key(&name), "stage {k}'s {name} is missing");
            want.insert(name, t);
        }
    }
    assert_eq!(got, want, "each tensor is its stage's, shape and bytes");
    let (_, meta) = SafeTensors::read_metadata(&file).expect("metadata");
    let meta = meta.metadata().clone().expect("metadata");
    assert_eq!(meta.get("format").map(String::as_str), Some("pt"));
    assert!(!meta.contains_key("flotilla.stage"), "{meta:?}");

    // A program's stage modules both named `conv`: kept apart by their stage.
    let stages = [
        stage_file(&["conv.w", "x"], 1.0, 0),
        stage_file(&["conv.w", "y"], 2.0, 1),
    ];
    let got = tensors(&merge(&stages).0);
    let mut names: Vec<&str> = got.keys().map(String::as_str).collect();
    names.sort();
    assert_eq!(
        names,
        ["stage0.conv.w", "stage0.x", "stage1.conv.w", "stage1.y"]
    );
    assert_eq!(got["stage1.conv.w"], tensors(&stages[1])["conv.w"]);
}

#[test]
fn a_block_of_another_length_or_a_cut_header_is_refused() {
    let stages = [stage_file(&["a"], 1.0, 0), stage_file(&["b", "c"], 2.0, 1)];
    let out = Path::new("m");
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("model.safetensors");
    let merged = create(&stages, &path);
    let block = merged.block(0, out).expect("block");
    let e = write_block(&path, block, data_of(&stages[1], out).expect("data"));
    let why = "stage 1's data written in stage 0's smaller block";
    assert!(e.is_err(), "{why}");
    assert!(merged.block(2, out).is_err(), "two stages, no third block");
    assert!(header_of(&stages[0][..12], out).is_err());
    let header = header_of(&stages[0], out).expect("header");
    let cut = &header[..header.len() / 2];
    assert!(
        MergedWeights::new(&[cut], out).is_err(),
        "a header cut in half"
    );
}
