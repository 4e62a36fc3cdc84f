//! The model-spec parser with its graph checks and shape inference (no model is built).
//! Properties: garbage is a spec error, never a panic (no overflow in shape arithmetic); a
//! parsed spec's shapes infer; its YAML form parses back to a spec with the same YAML form
//! and shapes.
#![no_main]

use flotilla_engine::ModelSpec;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let Ok(spec) = ModelSpec::from_yaml(&text, "fuzz.yaml") else {
        return;
    };
    let io = spec.infer_io().expect("a parsed spec infers");
    let written = serde_norway::to_string(&spec).expect("a spec serialises");
    let back = ModelSpec::from_yaml(&written, "written").expect("a written spec parses");
    assert_eq!(serde_norway::to_string(&back).ok().as_ref(), Some(&written));
    assert_eq!(back.infer_io().ok(), Some(io));
});
