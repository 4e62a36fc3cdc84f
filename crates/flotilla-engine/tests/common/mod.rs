//! What the numeric test files share: engines of small specs, deterministic batches, flat
//! views by tensor name, and the central-difference gradient check.
#![allow(dead_code)] // each test file uses its own part

use flotilla_engine::{
    BatchRef, BurnEngine, DecayParams, Engine, ModelSpec, ModelState, OptimizerSpec,
};

/// SGD without momentum or weight decay.
pub fn plain_sgd(lr: f64) -> OptimizerSpec {
    OptimizerSpec::Sgd {
        lr,
        momentum: 0.0,
        dampening: 0.0,
        nesterov: false,
        weight_decay: 0.0,
        decay_params: DecayParams::All,
    }
}

/// An engine of the spec `yaml` on the flex backend, with plain SGD at `lr`.
pub fn engine_of(yaml: &str, seed: u64, lr: f64) -> BurnEngine {
    let spec = ModelSpec::from_yaml(yaml, "test spec").expect("spec");
    BurnEngine::new(&spec, &plain_sgd(lr), "flex", seed).expect("engine")
}

/// A deterministic stream of values in `[-1, 1)` (xorshift).
pub fn uniform(n: usize, salt: u32) -> Vec<f32> {
    let mut x = salt.wrapping_mul(2_654_435_761).wrapping_add(12_345) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x % 20_000) as f32 / 10_000.0 - 1.0
        })
        .collect()
}

/// `n` samples of `per` values each and labels in `0..classes`.
pub fn batch(n: usize, per: usize, classes: usize, salt: u32) -> (Vec<f32>, Vec<i64>) {
    let images = uniform(n * per, salt);
    let labels = uniform(n, salt ^ 0x5bd1_e995)
        .iter()
        .map(|v| (((v + 1.0) * 0.5 * classes as f32) as i64).min(classes as i64 - 1))
        .collect();
    (images, labels)
}

/// The flat parameters.
pub fn params(e: &BurnEngine) -> Vec<f32> {
    let mut p = vec![0.0; e.num_params()];
    e.read_params(&mut p).expect("read");
    p
}

/// The flat gradient of the last backward pass.
pub fn grads(e: &BurnEngine) -> Vec<f32> {
    let mut g = vec![0.0; e.num_params()];
    e.read_grads(&mut g).expect("grads");
    g
}

/// The flat range of the tensor called `name`, and its shape.
pub fn tensor_range(e: &BurnEngine, name: &str) -> (std::ops::Range<usize>, Vec<usize>) {
    let info = e
        .layout()
        .params
        .iter()
        .find(|p| p.name == name)
        .unwrap_or_else(|| panic!("no tensor {name}"));
    (info.offset..info.offset + info.len, info.shape.clone())
}

/// Mean batch loss of `e` with parameter `index` set to `value`.
pub fn loss_at(e: &mut BurnEngine, base: &[f32], index: usize, value: f32, b: BatchRef<'_>) -> f64 {
    let mut q = base.to_vec();
    q[index] = value;
    e.write_params(&q).expect("write");
    e.forward_backward(b).expect("forward") as f64
}

/// Whether a numeric derivative with step `eps` agrees with an analytic one: 1% relative,
/// plus an absolute floor for the f32 rounding of the two losses (a few 1e-7) over `2 eps`.
pub fn agrees(numeric: f64, analytic: f64, eps: f32) -> bool {
    (numeric - analytic).abs() <= 1e-2 * analytic.abs() + loss_noise(eps)
}

/// The derivative error that the f32 rounding of the losses alone may cause at step `eps`.
pub fn loss_noise(eps: f32) -> f64 {
    4e-7 / eps as f64
}

/// Checks the analytic gradient of each named tensor of `e` on a batch against central
/// differences with that tensor's step `eps`, on the 6 entries of each tensor with the
/// largest gradient (all entries if the tensor is smaller). Also checks that the comparison
/// rejects a gradient scaled by 2 and a linear weight's gradient read transposed.
pub fn check_gradients(e: &mut BurnEngine, b: BatchRef<'_>, tensors: &[(&str, f32)]) {
    let per_tensor = 6;
    let base = params(e);
    e.forward_backward(b).expect("forward");
    let g = grads(e);
    for &(name, eps) in tensors {
        let (range, shape) = tensor_range(e, name);
        let mut order: Vec<usize> = range.clone().collect();
        order.sort_by(|&a, &b| g[b].abs().total_cmp(&g[a].abs()));
        let picked = &order[..per_tensor.min(order.len())];
        assert!(picked.len() >= 4, "{name}: too few entries");
        let mut transposed_rejected = false;
        for &i in picked {
            let k = i - range.start;
            let analytic = g[i] as f64;
            assert!(
                analytic.abs() > 20.0 * loss_noise(eps),
                "{name}[{k}]: gradient {analytic} too small to check at step {eps}"
            );
            let up = loss_at(e, &base, i, base[i] + eps, b);
            let down = loss_at(e, &base, i, base[i] - eps, b);
            let numeric = (up - down) / (2.0 * eps as f64);
            assert!(
                agrees(numeric, analytic, eps),
                "{name}[{k}]: numeric {numeric} analytic {analytic}"
            );
            assert!(
                !agrees(numeric, 2.0 * analytic, eps),
                "{name}[{k}]: 2g passes"
            );
            if let [rows, cols] = shape[..] {
                // The same flat position read as `[cols, rows]` (a transpose bug).
                let t = range.start + (k % cols) * rows + k / cols;
                transposed_rejected |= !agrees(numeric, g[t] as f64, eps);
            }
        }
        if shape.len() == 2 {
            assert!(transposed_rejected, "{name}: a transposed gradient passes");
        }
    }
    e.write_params(&base).expect("restore");
}

/// `n` samples of `t` token ids in `0..vocab` (as the `f32` values a batch carries) and one
/// label in `0..vocab` per position: a sequence model's batch.
pub fn token_batch(n: usize, t: usize, vocab: usize, salt: u32) -> (Vec<f32>, Vec<i64>) {
    let id = |v: f32| (((v + 1.0) * 0.5 * vocab as f32) as usize).min(vocab - 1);
    let ids = uniform(n * t, salt)
        .into_iter()
        .map(|v| id(v) as f32)
        .collect();
    let labels = uniform(n * t, salt ^ 0x5bd1_e995)
        .into_iter()
        .map(|v| id(v) as i64)
        .collect();
    (ids, labels)
}
