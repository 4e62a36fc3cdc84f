//! A weights file written tensor by tensor is the file `save_weights` writes: the same
//! tensors (names, PyTorch's shapes, bytes; batch norm's running statistics after the
//! parameters) and metadata, and it loads back into the model.

use crate::engine_tests::sgd;
use crate::{BatchRef, BurnEngine, Engine, ModelSpec, ModelState};

/// `values` (`e`'s parameters) written tensor by tensor in flat order into the file at
/// `path` that `e`'s [`crate::WeightsPlan`] lays out.
fn write_in_order(e: &BurnEngine, values: &[f32], path: &std::path::Path) {
    let plan = e.weights_plan().expect("plan");
    let file = plan.create(path).expect("created");
    for (i, p) in e.layout().params.iter().enumerate() {
        plan.write_at((&file, path), i, &values[p.offset..p.offset + p.len])
            .expect("tensor");
    }
    // The buffers after the parameters.
    let mut buffers = vec![0.0; e.buffer_layout().total];
    e.read_buffers(&mut buffers).expect("buffers");
    let first = e.layout().params.len();
    for (j, b) in e.buffer_layout().params.iter().enumerate() {
        plan.write_at(
            (&file, path),
            first + j,
            &buffers[b.offset..b.offset + b.len],
        )
        .expect("buffer");
    }
}

#[test]
fn a_weights_file_written_tensor_by_tensor_is_the_one_save_weights_writes() {
    let tmp = tempfile::tempdir().expect("tmp");
    for name in ["mlp", "lenet5", "gpt-char", "resnet-bn"] {
        let spec = ModelSpec::builtin(name).expect("shipped spec");
        let mut e = BurnEngine::new(&spec, &sgd(0.1, 0.0), "flex", 3).expect("engine");
        // A forward moves batch norm's running statistics off their initial values.
        let (images, labels) = crate::sharded_tests::batch(&spec, 4, 1);
        e.forward_backward(BatchRef {
            images: &images,
            labels: &labels,
        })
        .expect("forward");
        let whole = tmp.path().join(format!("{name}-whole.safetensors"));
        e.save_weights(&whole).expect("save");
        let mut values = vec![0.0; e.num_params()];
        e.read_params(&mut values).expect("params");
        let pieces = tmp.path().join(format!("{name}-pieces.safetensors"));
        write_in_order(&e, &values, &pieces);
        let (a, b) = (
            std::fs::read(&whole).expect("whole"),
            std::fs::read(&pieces).expect("pieces"),
        );
        let (a, b) = (
            safetensors::SafeTensors::deserialize(&a).expect("whole file"),
            safetensors::SafeTensors::deserialize(&b).expect("file of pieces"),
        );
        let mut names_a = a.names();
        let mut names_b = b.names();
        names_a.sort();
        names_b.sort();
        assert_eq!(names_a, names_b, "{name}: tensors");
        for n in names_a {
            let (x, y) = (a.tensor(n).expect("a"), b.tensor(n).expect("b"));
            assert_eq!(x.shape(), y.shape(), "{name}: {n}'s shape");
            assert_eq!(x.dtype(), y.dtype(), "{name}: {n}'s type");
            assert!(x.data() == y.data(), "{name}: {n}'s values");
        }
        let meta = |path: &std::path::Path| {
            let bytes = std::fs::read(path).expect("file");
            let (_, m) = safetensors::SafeTensors::read_metadata(&bytes).expect("header");
            m.metadata().clone()
        };
        assert_eq!(meta(&whole), meta(&pieces), "{name}: metadata");
        let mut fresh = BurnEngine::new(&spec, &sgd(0.1, 0.0), "flex", 4).expect("engine");
        fresh.load_weights(&pieces).expect("loads");
        let mut back = vec![0.0; values.len()];
        fresh.read_params(&mut back).expect("params");
        assert!(back == values, "{name}: loads back");
        let mut stats = vec![0.0; e.buffer_layout().total];
        e.read_buffers(&mut stats).expect("buffers");
        let mut stats_back = vec![0.0; stats.len()];
        fresh.read_buffers(&mut stats_back).expect("buffers");
        assert!(
            stats_back == stats,
            "{name}: its running statistics load back"
        );
    }
}

/// The file's layout is known before any value, so its tensors may be written at their
/// places in any order (by several ranks at once): written last tensor first into the file
/// [`crate::WeightsPlan::create`] made, it is byte for byte the file written in order.
#[test]
fn a_weights_file_written_out_of_order_at_its_places_is_the_one_written_in_order() {
    let tmp = tempfile::tempdir().expect("tmp");
    let spec = ModelSpec::builtin("gpt-char").expect("shipped spec");
    let e = BurnEngine::new(&spec, &sgd(0.1, 0.0), "flex", 3).expect("engine");
    let mut values = vec![0.0; e.num_params()];
    e.read_params(&mut values).expect("params");
    let in_order = tmp.path().join("in-order.safetensors");
    write_in_order(&e, &values, &in_order);
    let plan = e.weights_plan().expect("plan");
    let backwards = tmp.path().join("backwards.safetensors");
    let file = plan.create(&backwards).expect("created");
    let n = e.layout().params.len();
    assert_eq!(plan.tensors().len(), n);
    for (i, p) in e.layout().params.iter().enumerate().rev() {
        plan.write_at((&file, &backwards), i, &values[p.offset..p.offset + p.len])
            .expect("tensor");
    }
    let (a, b) = (
        std::fs::read(&in_order).expect("in order"),
        std::fs::read(&backwards).expect("backwards"),
    );
    assert_eq!(a.len() as u64, plan.len());
    assert!(a == b, "the files differ");
    let wrong = plan.write_at((&file, &backwards), 0, &values[..3]);
    assert!(wrong.is_err(), "a tensor of the wrong length is refused");
}

/// burn's own weights file (`save_weights`) read back one tensor at a time
/// ([`crate::WeightsReader`]) gives each tensor of the plan in burn's flat order: the
/// parameters and running statistics the model holds, bit for bit; a tensor of another
/// shape is refused by name.
#[test]
fn a_weights_file_reads_back_one_tensor_at_a_time_in_burns_order() {
    let tmp = tempfile::tempdir().expect("tmp");
    for name in ["mlp", "lenet5", "gpt-char", "resnet-bn"] {
        let spec = ModelSpec::builtin(name).expect("shipped spec");
        let mut e = BurnEngine::new(&spec, &sgd(0.1, 0.0), "flex", 5).expect("engine");
        let (images, labels) = crate::sharded_tests::batch(&spec, 4, 1);
        e.forward_backward(BatchRef {
            images: &images,
            labels: &labels,
        })
        .expect("forward");
        let path = tmp.path().join(format!("{name}.safetensors"));
        e.save_weights(&path).expect("save");
        let mut values = vec![0.0; e.num_params()];
        e.read_params(&mut values).expect("params");
        let mut buffers = vec![0.0; e.buffer_layout().total];
        e.read_buffers(&mut buffers).expect("buffers");
        let expected = (e
            .layout()
            .params
            .iter()
            .map(|p| &values[p.offset..p.offset + p.len]))
        .chain((e.buffer_layout().params.iter()).map(|b| &buffers[b.offset..b.offset + b.len]));
        let plan = e.weights_plan().expect("plan");
        let reader = crate::WeightsReader::open(&path).expect("reader");
        let mut transposed = 0;
        for (t, want) in plan.tensors().iter().zip(expected) {
            let got = reader.read(t).expect("tensor");
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(want), "{name}: {}", t.name);
            transposed += usize::from(t.transposed);
        }
        assert!(
            transposed > 0,
            "{name}: a linear layer's weight read back transposed"
        );
        let mut wrong = plan.tensors()[0].clone();
        wrong.shape.push(1);
        let refused = reader.read(&wrong).expect_err("another shape");
        assert!(refused.to_string().contains(&wrong.name), "{refused}");
    }
}
