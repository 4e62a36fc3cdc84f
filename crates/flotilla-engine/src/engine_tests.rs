//! Tests of the burn engine through the [`Engine`] trait.

use crate::{BatchRef, BurnEngine, DecayParams, Engine, ModelSpec, ModelState, OptimizerSpec};

/// Plain SGD (PyTorch semantics) at `lr` with `momentum`: the optimizer of the engine tests.
pub(crate) fn sgd(lr: f64, momentum: f64) -> OptimizerSpec {
    OptimizerSpec::Sgd {
        lr,
        momentum,
        dampening: 0.0,
        nesterov: false,
        weight_decay: 0.0,
        decay_params: DecayParams::All,
    }
}

fn engine(model: &str, seed: u64, opt: &OptimizerSpec) -> BurnEngine {
    let spec = ModelSpec::builtin(model).expect("builtin");
    BurnEngine::new(&spec, opt, "flex", seed).expect("engine")
}

/// A deterministic pseudo-random batch of `n` MNIST-shaped samples.
fn batch(n: usize, salt: u32) -> (Vec<f32>, Vec<i64>) {
    let mut x = salt.wrapping_mul(2654435761).wrapping_add(12345);
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        x
    };
    let images = (0..n * 784)
        .map(|_| (next() % 1000) as f32 / 500.0 - 1.0)
        .collect();
    let labels = (0..n).map(|_| (next() % 10) as i64).collect();
    (images, labels)
}

fn params(e: &BurnEngine) -> Vec<f32> {
    let mut p = vec![0.0; e.num_params()];
    e.read_params(&mut p).expect("read");
    p
}

fn grads(e: &BurnEngine) -> Vec<f32> {
    let mut g = vec![0.0; e.num_params()];
    e.read_grads(&mut g).expect("grads");
    g
}

#[test]
fn layout_is_pytorch_named_and_ordered() {
    let e = engine("lenet5", 1, &sgd(0.1, 0.0));
    let l = e.layout();
    let names: Vec<&str> = l.params.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "layers.0.weight",
            "layers.0.bias",
            "layers.3.weight",
            "layers.3.bias",
            "layers.7.weight",
            "layers.7.bias",
            "layers.9.weight",
            "layers.9.bias",
            "layers.11.weight",
            "layers.11.bias"
        ]
    );
    assert_eq!(l.params[0].shape, vec![6, 1, 5, 5]);
    assert_eq!(
        l.params[4].shape,
        vec![400, 120],
        "burn keeps linear weights as [in, out]"
    );
    assert_eq!(l.total, 61_706);
    let mlp = engine("mlp", 1, &sgd(0.1, 0.0));
    assert_eq!(mlp.num_params(), 235_146);
}

/// Where the parameter tensors are comes from the tensors: all ten of LeNet-5's on Flex; a
/// stage of parameterless layers has none to report.
#[test]
fn parameter_placement_is_read_from_the_tensors() {
    let e = engine("lenet5", 1, &sgd(0.1, 0.0));
    let p = e.param_placement().expect("placement").expect("parameters");
    assert_eq!(
        (p.device.as_str(), p.backend(), p.tensors),
        ("flex", "flex", 10)
    );
    assert_eq!(p.to_string(), "flex (all 10 parameter tensors)");
    let spec = ModelSpec::builtin("lenet5").expect("builtin");
    // Layers 1 and 2 (ReLU, max pooling) hold no parameters.
    let cut = crate::StageCut::at(&spec, &[1, 3]).expect("cut");
    let stage = crate::Stage::new(&spec, &cut, 1, &sgd(0.1, 0.0), "flex", 1).expect("stage");
    assert_eq!(stage.param_placement().expect("placement"), None);
}

#[test]
fn init_is_seeded_and_deterministic() {
    let a = params(&engine("lenet5", 7, &sgd(0.1, 0.0)));
    let b = params(&engine("lenet5", 7, &sgd(0.1, 0.0)));
    let c = params(&engine("lenet5", 8, &sgd(0.1, 0.0)));
    assert_eq!(a, b);
    assert_ne!(a, c);
    assert!(a.iter().all(|v| v.is_finite()) && a.iter().any(|v| *v != 0.0));
}

#[test]
fn write_then_read_round_trips_and_changes_the_model() {
    let mut e = engine("mlp", 1, &sgd(0.1, 0.0));
    let other = params(&engine("mlp", 2, &sgd(0.1, 0.0)));
    e.write_params(&other).expect("write");
    assert_eq!(params(&e), other);
    assert!(e.write_params(&other[1..]).is_err());
    assert_eq!(params(&e), other, "a failed write changes nothing");
}

#[test]
fn sgd_step_is_p_minus_lr_g() {
    let mut e = engine("lenet5", 3, &sgd(0.5, 0.0));
    let (x, y) = batch(8, 1);
    let before = params(&e);
    let loss = e
        .forward_backward(BatchRef {
            images: &x,
            labels: &y,
        })
        .expect("fb");
    assert!(loss.is_finite() && loss > 0.0);
    let g = grads(&e);
    assert!(g.iter().any(|v| *v != 0.0));
    e.apply_grads(&g, 0.5).expect("apply");
    let after = params(&e);
    for i in 0..before.len() {
        let want = before[i] - 0.5 * g[i];
        assert!(
            (after[i] - want).abs() <= 1e-6 * (1.0 + want.abs()),
            "param {i}"
        );
    }
    assert!(
        e.for_each_grad(&mut |_, _| Ok(())).is_err(),
        "gradients are consumed by a step"
    );
}

#[test]
fn gradients_match_finite_differences() {
    // Checks that gradient values and flat order agree with the parameters they belong to.
    let mut e = engine("mlp", 4, &sgd(0.1, 0.0));
    let (x, y) = batch(4, 2);
    let b = BatchRef {
        images: &x,
        labels: &y,
    };
    e.forward_backward(b).expect("fb");
    let g = grads(&e);
    let p = params(&e);
    let layout = e.layout().clone();
    for info in &layout.params {
        // The largest gradient entry of each tensor.
        let (k, _) = g[info.offset..info.offset + info.len]
            .iter()
            .enumerate()
            .fold(
                (0, 0.0f32),
                |m, (k, v)| if v.abs() > m.1 { (k, v.abs()) } else { m },
            );
        let i = info.offset + k;
        // Small enough not to cross ReLU kinks often, large enough for f32 loss differences.
        let h = 2e-3f32;
        let mut q = p.clone();
        q[i] += h;
        e.write_params(&q).expect("w");
        let up = e.forward_backward(b).expect("fb") as f64;
        q[i] -= 2.0 * h;
        e.write_params(&q).expect("w");
        let down = e.forward_backward(b).expect("fb") as f64;
        let numeric = (up - down) / (2.0 * h as f64);
        let analytic = g[i] as f64;
        assert!(
            (numeric - analytic).abs() <= 5e-2 * analytic.abs().max(1e-2),
            "{}: numeric {numeric} analytic {analytic}",
            info.name
        );
    }
}

#[test]
fn optimizer_state_survives_write_and_round_trips() {
    optimizer_state_round_trips(&sgd(0.1, 0.9));
    // AdamW decaying matrices only: two parameter groups, whose states both round-trip.
    optimizer_state_round_trips(&OptimizerSpec::Adamw {
        lr: 0.01,
        beta1: 0.9,
        beta2: 0.99,
        epsilon: 1e-8,
        weight_decay: 0.1,
        decay_params: DecayParams::Matrices,
    });
}

/// Two steps of `opt`, then its state moved to an engine with other weights: the next step
/// must be bitwise the same, and differ without the state.
fn optimizer_state_round_trips(opt: &OptimizerSpec) {
    let (x, y) = batch(8, 3);
    let b = BatchRef {
        images: &x,
        labels: &y,
    };
    let lr = opt.lr();
    let trained = |seed: u64| {
        let mut t = engine("mlp", seed, opt);
        for _ in 0..2 {
            t.forward_backward(b).expect("fb");
            let g = grads(&t);
            t.apply_grads(&g, lr).expect("apply");
        }
        t
    };
    let mut a = trained(5);
    let state = a.optimizer_state().expect("state");
    assert!(!state.is_empty());
    // What a receiver of a broadcast state allows (`optimizer_state_bound`) holds it, with
    // the moments counted alone (without the bound's allowance for the file).
    let moments = crate::optimizer_state_bound(a.layout()) - (1 << 20);
    assert!(
        state.len() <= moments,
        "{opt:?}: a state of {} bytes, bound {moments}",
        state.len()
    );
    // A second engine with other weights takes a's weights and optimizer state: the next
    // step must then be identical.
    let mut c = engine("mlp", 6, opt);
    c.write_params(&params(&a)).expect("w");
    c.load_optimizer_state(&state).expect("load");
    for e in [&mut a, &mut c] {
        e.forward_backward(b).expect("fb");
        let g = grads(e);
        e.apply_grads(&g, lr).expect("apply");
    }
    assert_eq!(params(&a), params(&c), "{opt:?}");
    // Without the state the step differs (momentum matters here).
    let mut d = engine("mlp", 6, opt);
    d.write_params(&params(&trained(5))).expect("w");
    d.forward_backward(b).expect("fb");
    let g = grads(&d);
    d.apply_grads(&g, lr).expect("apply");
    assert_ne!(params(&d), params(&a), "{opt:?}");
}

#[test]
fn weights_save_and_load_in_pytorch_layout() {
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("model.safetensors");
    let a = engine("lenet5", 9, &sgd(0.1, 0.0));
    a.save_weights(&path).expect("save");
    let mut b = engine("lenet5", 10, &sgd(0.1, 0.0));
    assert_ne!(params(&a), params(&b));
    b.load_weights(&path).expect("load");
    assert_eq!(params(&a), params(&b));
    // A checkpoint of another model is refused with a clear error.
    let mut m = engine("mlp", 1, &sgd(0.1, 0.0));
    let before = params(&m);
    let e = m.load_weights(&path).expect_err("wrong model").to_string();
    assert!(e.contains("model.safetensors"), "{e}");
    assert_eq!(params(&m), before);
}

#[test]
fn evaluate_counts_and_bad_batches_are_errors() {
    let mut e = engine("mlp", 11, &sgd(0.1, 0.0));
    let (x, y) = batch(50, 4);
    let stats = e.evaluate(&x, &y, 16).expect("eval");
    assert_eq!(stats.count, 50);
    assert!(stats.correct <= 50 && stats.loss() > 0.0);
    let err = e
        .forward_backward(BatchRef {
            images: &x[..100],
            labels: &y,
        })
        .expect_err("short images")
        .to_string();
    assert!(err.contains("50 labels"), "{err}");
}

/// A whole step (forward, loss, backward) of the MLP and of LeNet-5 at a batch whose GEMMs
/// are split into pieces: the gradients on 2 threads are bitwise those on 1.
#[test]
fn a_step_gives_the_same_bits_on_one_and_two_threads() {
    for model in ["mlp", "lenet5"] {
        let (images, labels) = batch(256, 5);
        let on = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("pool");
            pool.install(|| {
                let mut e = engine(model, 3, &sgd(0.1, 0.0));
                let loss = e
                    .forward_backward(BatchRef {
                        images: &images,
                        labels: &labels,
                    })
                    .expect("step");
                (
                    loss.to_bits(),
                    grads(&e).iter().map(|g| g.to_bits()).collect::<Vec<_>>(),
                )
            })
        };
        assert_eq!(on(1), on(2), "{model}");
    }
}
