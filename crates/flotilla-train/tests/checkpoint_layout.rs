//! A checkpoint's `model.safetensors` holds the engine's parameters in PyTorch's layout:
//! every linear weight is the transpose of the engine's flat `[in, out]` view, element by
//! element, and every other tensor (conv weights `[out, in, kh, kw]`, biases) is equal to it.

use flotilla_engine::{BurnEngine, ModelSpec, ModelState, OptimizerSpec};
use flotilla_train::checkpoint::{self, CheckpointState};

fn lenet(seed: u64) -> BurnEngine {
    let spec = ModelSpec::builtin("lenet5").expect("lenet5");
    BurnEngine::new(&spec, &OptimizerSpec::default(), "flex", seed).expect("engine")
}

fn params(e: &BurnEngine) -> Vec<f32> {
    let mut p = vec![0.0; e.num_params()];
    e.read_params(&mut p).expect("read");
    p
}

fn state(e: &BurnEngine) -> CheckpointState {
    CheckpointState {
        step: 12,
        epoch: 0,
        step_in_epoch: 12,
        config_hash: 7,
        model: "lenet5".into(),
        num_params: e.num_params(),
        test_acc: None,
        stages: None,
        zero: None,
        stage_zero: None,
    }
}

#[test]
fn checkpoint_tensors_are_the_pytorch_layout_of_the_flat_view() {
    let out = tempfile::tempdir().expect("tmp");
    let e = lenet(3);
    let flat = params(&e);
    let dir = checkpoint::save(out.path(), &e, &state(&e)).expect("save");
    assert_eq!(
        checkpoint::latest(out.path()).expect("latest"),
        Some(dir.clone())
    );
    let bytes = std::fs::read(dir.join("model.safetensors")).expect("read");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    let layout = e.layout();
    assert_eq!(st.len(), layout.params.len(), "one tensor per parameter");
    let (mut linear, mut conv) = (0, 0);
    for info in &layout.params {
        let view = st.tensor(&info.name).expect("tensor");
        assert_eq!(view.dtype(), safetensors::Dtype::F32, "{}", info.name);
        let file: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let own = &flat[info.offset..info.offset + info.len];
        if let [rows, cols] = info.shape[..] {
            // Flat `[in, out]` (burn) against file `[out, in]` (PyTorch).
            assert_eq!(view.shape(), [cols, rows], "{}", info.name);
            for i in 0..rows {
                for o in 0..cols {
                    assert_eq!(
                        file[o * rows + i],
                        own[i * cols + o],
                        "{}[{o}][{i}]",
                        info.name
                    );
                }
            }
            linear += 1;
        } else {
            assert_eq!(view.shape(), &info.shape[..], "{}", info.name);
            assert_eq!(file, own, "{}", info.name);
            conv += usize::from(info.shape.len() == 4);
        }
    }
    assert_eq!(
        (linear, conv),
        (3, 2),
        "lenet5's 3 linear and 2 conv weights"
    );
}

#[test]
fn checkpoint_loads_back_into_the_same_flat_view() {
    let out = tempfile::tempdir().expect("tmp");
    let e = lenet(4);
    let dir = checkpoint::save(out.path(), &e, &state(&e)).expect("save");
    let mut other = lenet(5);
    assert_ne!(params(&other), params(&e));
    let read = checkpoint::load(&dir, &mut other).expect("load");
    assert_eq!(read, state(&e));
    assert_eq!(params(&other), params(&e));
}
