//! Batch norm's running statistics through the public API: buffers, not parameters; updated
//! by every training forward pass (burn's formula, checked by hand), used by evaluation,
//! written and read as a flat view, and saved and loaded under PyTorch's names.

mod common;

use common::{batch, engine_of, params, uniform};
use flotilla_engine::{BatchRef, BurnEngine, Engine, ModelSpec, ModelState};

/// A 1-d batch norm straight on the input: its batch statistics are the input's.
const FLAT_BN: &str = "input: [3]
layers:
  - batch_norm
  - linear: {out: 2}
";

fn buffers(e: &BurnEngine) -> Vec<f32> {
    let mut b = vec![0.0; e.buffer_layout().total];
    e.read_buffers(&mut b).expect("buffers");
    b
}

fn step(e: &mut BurnEngine, x: &[f32], y: &[i64]) {
    let b = BatchRef {
        images: x,
        labels: y,
    };
    e.forward_backward(b).expect("forward");
}

#[test]
fn running_statistics_are_buffers_not_parameters() {
    let spec = ModelSpec::builtin("resnet-bn").expect("resnet-bn");
    let e = BurnEngine::new(&spec, &common::plain_sgd(0.1), "flex", 51).expect("engine");
    assert_eq!(e.num_params(), 46_970);
    assert!(
        e.layout()
            .params
            .iter()
            .all(|p| !p.name.contains("running"))
    );
    assert_eq!(e.layout().params[1].name, "layers.1.weight");
    assert_eq!(e.layout().params[2].name, "layers.1.bias");
    let layout = e.buffer_layout();
    assert_eq!(layout.total, 416);
    assert_eq!(layout.params.len(), 16);
    assert_eq!(layout.params[0].name, "layers.1.running_mean");
    assert_eq!(layout.params[1].name, "layers.1.running_var");
    assert_eq!(layout.params[1].shape, vec![16]);
    // Fresh statistics: mean 0, variance 1.
    let b = buffers(&e);
    assert!(b[..16].iter().all(|v| *v == 0.0) && b[16..32].iter().all(|v| *v == 1.0));
    let lenet = BurnEngine::new(
        &ModelSpec::builtin("lenet5").expect("lenet5"),
        &common::plain_sgd(0.1),
        "flex",
        1,
    )
    .expect("lenet");
    assert_eq!(lenet.buffer_layout().total, 0);
    lenet.read_buffers(&mut []).expect("no buffers");
}

#[test]
fn a_training_forward_updates_them_by_burns_formula_and_evaluation_does_not() {
    let mut e = engine_of(FLAT_BN, 52, 0.1);
    let (x, y) = batch(5, 3, 2, 1);
    step(&mut e, &x, &y);
    let first = buffers(&e);
    // running = 0.9 · running + 0.1 · batch statistic (burn's variance is the biased one).
    let column =
        |f: usize| -> Vec<f64> { x.iter().skip(f).step_by(3).map(|v| *v as f64).collect() };
    for f in 0..3 {
        let c = column(f);
        let mean = c.iter().sum::<f64>() / 5.0;
        let var = c.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / 5.0;
        assert!((first[f] as f64 - 0.1 * mean).abs() < 1e-6, "mean {f}");
        assert!(
            (first[3 + f] as f64 - (0.9 + 0.1 * var)).abs() < 1e-6,
            "var {f}"
        );
    }
    // A second forward moves them again, on top of the first (nothing left pending).
    step(&mut e, &x, &y);
    let second = buffers(&e);
    for f in 0..3 {
        let mean = column(f).iter().sum::<f64>() / 5.0;
        let expected = 0.9 * first[f] as f64 + 0.1 * mean;
        assert!(
            (second[f] as f64 - expected).abs() < 1e-6,
            "second mean {f}"
        );
    }
    e.evaluate(&x, &y, 2).expect("evaluate");
    assert_eq!(
        buffers(&e),
        second,
        "evaluation leaves the statistics alone"
    );
}

#[test]
fn evaluation_normalizes_with_the_buffers_written() {
    let mut e = engine_of(FLAT_BN, 53, 0.1);
    let (x, y) = batch(4, 3, 2, 2);
    let before = e.evaluate(&x, &y, 4).expect("evaluate");
    let written = vec![0.5, -0.25, 1.0, 4.0, 0.25, 2.0];
    e.write_buffers(&written).expect("write");
    assert_eq!(buffers(&e), written);
    let after = e.evaluate(&x, &y, 4).expect("evaluate");
    assert_ne!(after.loss_sum, before.loss_sum);
    // Evaluation by hand: (x − mean) / sqrt(var + 1e-5) (weight 1, bias 0), then the linear
    // layer (weight [3, 2], bias [2]).
    let p = params(&e);
    let (w, bias) = (&p[6..12], &p[12..14]);
    let mut loss_sum = 0.0f64;
    for (row, &label) in x.chunks(3).zip(&y) {
        let z: Vec<f64> = (0..3)
            .map(|f| (row[f] - written[f]) as f64 / (written[3 + f] as f64 + 1e-5).sqrt())
            .collect();
        let logits: Vec<f64> = (0..2)
            .map(|o| bias[o] as f64 + (0..3).map(|f| z[f] * w[f * 2 + o] as f64).sum::<f64>())
            .collect();
        let lse = logits.iter().map(|v| v.exp()).sum::<f64>().ln();
        loss_sum += lse - logits[label as usize];
    }
    assert!(
        (after.loss_sum - loss_sum).abs() < 1e-5,
        "{} vs {loss_sum}",
        after.loss_sum
    );
    let e2 = e
        .write_buffers(&[1.0; 5])
        .expect_err("wrong length")
        .to_string();
    assert!(e2.contains('6') && e2.contains('5'), "{e2}");
}

#[test]
fn checkpoints_keep_the_statistics_under_pytorch_names() {
    let spec = ModelSpec::builtin("resnet-bn").expect("resnet-bn");
    let sgd = common::plain_sgd(0.05);
    let mut e = BurnEngine::new(&spec, &sgd, "flex", 54).expect("engine");
    let (x, y) = batch(4, 28 * 28, 10, 3);
    for _ in 0..2 {
        step(&mut e, &x, &y);
        let mut g = vec![0.0; e.num_params()];
        e.read_grads(&mut g).expect("grads");
        e.apply_grads(&g, 0.05).expect("apply");
    }
    let stats = buffers(&e);
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("model.safetensors");
    e.save_weights(&path).expect("save");
    let bytes = std::fs::read(&path).expect("read");
    let file = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    let mean = file.tensor("layers.1.running_mean").expect("running_mean");
    let var = file.tensor("layers.1.running_var").expect("running_var");
    assert_eq!(mean.shape(), [16]);
    let value = |bytes: &[u8], i: usize| {
        f32::from_le_bytes([
            bytes[4 * i],
            bytes[4 * i + 1],
            bytes[4 * i + 2],
            bytes[4 * i + 3],
        ])
    };
    assert_eq!(value(mean.data(), 3), stats[3]);
    assert_eq!(value(var.data(), 3), stats[16 + 3]);
    assert!(file.tensor("layers.1.weight").is_ok() && file.tensor("layers.1.gamma").is_err());
    // A fresh engine of another seed takes parameters and statistics from the file.
    let mut again = BurnEngine::new(&spec, &sgd, "flex", 55).expect("engine");
    again.load_weights(&path).expect("load");
    assert_eq!(buffers(&again), stats);
    assert_eq!(params(&again), params(&e));
    let (xt, yt) = (uniform(6 * 28 * 28, 9), vec![1i64; 6]);
    assert_eq!(
        again.evaluate(&xt, &yt, 3).expect("eval"),
        e.evaluate(&xt, &yt, 3).expect("eval")
    );
    // A file with other statistics but without one of the model's weights is refused, and
    // leaves the statistics as they were (burn's copies of a model share them).
    step(&mut e, &x, &y);
    assert_ne!(buffers(&e), stats);
    e.save_weights(&path).expect("save");
    let bytes = std::fs::read(&path).expect("read");
    let file = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    let kept: Vec<_> = file
        .tensors()
        .into_iter()
        .filter(|(name, _)| name != "layers.0.weight")
        .collect();
    let partial = dir.path().join("partial.safetensors");
    safetensors::serialize_to_file(kept, None, &partial).expect("write partial");
    let err = again
        .load_weights(&partial)
        .expect_err("refused")
        .to_string();
    assert!(err.contains("layers.0.weight"), "{err}");
    assert_eq!(buffers(&again), stats);
}
