//! Numeric checks of the burn engine through its public, flat [`Engine`] API: gradients of
//! convolution and pooling layers against central finite differences, the PyTorch layout of
//! saved weights against the flat view, the learning rate of `apply_grads`, and evaluation
//! totals. Every test asserts values, so that a transposed, scaled or misplaced number fails.

mod common;

use common::{batch, check_gradients, engine_of, params, tensor_range, uniform};
use flotilla_engine::{BatchRef, BurnEngine, Engine, ModelState};

/// Conv (two input channels, padding) → overlapping max pooling → linear. No other kinks.
const MAXPOOL_SPEC: &str = "name: conv-maxpool
input: [2, 7, 7]
layers:
  - conv2d: {out: 5, k: 3, padding: 1}
  - maxpool: {k: 3, stride: 2}
  - flatten
  - linear: {out: 4}
";

/// Conv (stride 2, padding) → tanh → overlapping average pooling → linear: smooth everywhere.
const AVGPOOL_SPEC: &str = "name: conv-avgpool
input: [2, 9, 9]
layers:
  - conv2d: {out: 5, k: 3, stride: 2, padding: 1}
  - tanh
  - avgpool: {k: 2, stride: 1}
  - flatten
  - linear: {out: 4}
";

/// Two conv layers and two linear layers, each with a bias: every kind of tensor a checkpoint
/// holds.
const LAYOUT_SPEC: &str = "name: layout
input: [2, 8, 8]
layers:
  - conv2d: {out: 3, k: 3}
  - relu
  - maxpool: {k: 2}
  - conv2d: {out: 4, k: 2, padding: 1}
  - flatten
  - linear: {out: 7}
  - relu
  - linear: {out: 5}
";

/// A convolution's settings, for the reference forward pass of the tie check.
struct Conv {
    cin: usize,
    cout: usize,
    k: usize,
    stride: usize,
    pad: usize,
}

/// Reference convolution in f64 of one sample `[cin, h, w]` with weight `[cout, cin, k, k]`;
/// returns `[cout, oh, ow]` and `(oh, ow)`.
fn conv_f64(
    x: &[f32],
    (h, w): (usize, usize),
    weight: &[f32],
    bias: &[f32],
    c: &Conv,
) -> (Vec<f64>, usize, usize) {
    let oh = (h + 2 * c.pad - c.k) / c.stride + 1;
    let ow = (w + 2 * c.pad - c.k) / c.stride + 1;
    let mut out = vec![0.0f64; c.cout * oh * ow];
    for o in 0..c.cout {
        for y in 0..oh {
            for z in 0..ow {
                let mut acc = bias[o] as f64;
                for ci in 0..c.cin {
                    for i in 0..c.k {
                        for j in 0..c.k {
                            let (yy, zz) =
                                ((y * c.stride + i) as isize, (z * c.stride + j) as isize);
                            let (yy, zz) = (yy - c.pad as isize, zz - c.pad as isize);
                            if yy < 0 || zz < 0 || yy >= h as isize || zz >= w as isize {
                                continue;
                            }
                            let xv = x[(ci * h + yy as usize) * w + zz as usize] as f64;
                            let wv = weight[((o * c.cin + ci) * c.k + i) * c.k + j] as f64;
                            acc += xv * wv;
                        }
                    }
                }
                out[(o * oh + y) * ow + z] = acc;
            }
        }
    }
    (out, oh, ow)
}

/// The smallest gap between the largest and second-largest value of any max-pooling window
/// (`k`, `stride`) over `[c, h, w]` maps.
fn min_pool_gap(maps: &[f64], c: usize, (h, w): (usize, usize), k: usize, stride: usize) -> f64 {
    let mut gap = f64::INFINITY;
    for ch in 0..c {
        for y in (0..=h - k).step_by(stride) {
            for z in (0..=w - k).step_by(stride) {
                let mut window: Vec<f64> = (0..k * k)
                    .map(|t| maps[(ch * h + y + t / k) * w + z + t % k])
                    .collect();
                window.sort_by(|a, b| b.total_cmp(a));
                gap = gap.min(window[0] - window[1]);
            }
        }
    }
    gap
}

/// A batch for the max-pooling model in which no pooling window has a near tie: the gap
/// between its two largest conv outputs exceeds what a step of `eps` on one conv weight can
/// change (`2 eps max|x|`) four times over, so no perturbation moves a window's argmax.
fn tie_free_maxpool_batch(e: &BurnEngine, n: usize, eps: f32) -> (Vec<f32>, Vec<i64>) {
    let p = params(e);
    let (wr, _) = tensor_range(e, "layers.0.weight");
    let (br, _) = tensor_range(e, "layers.0.bias");
    let conv = Conv {
        cin: 2,
        cout: 5,
        k: 3,
        stride: 1,
        pad: 1,
    };
    for salt in 0..500 {
        let (x, y) = batch(n, 2 * 7 * 7, 4, salt);
        let xmax = x.iter().fold(0.0f64, |m, v| m.max(v.abs() as f64));
        let gap = x
            .chunks(2 * 7 * 7)
            .map(|s| {
                let (maps, oh, ow) = conv_f64(s, (7, 7), &p[wr.clone()], &p[br.clone()], &conv);
                min_pool_gap(&maps, conv.cout, (oh, ow), 3, 2)
            })
            .fold(f64::INFINITY, f64::min);
        if gap > 8.0 * eps as f64 * xmax {
            return (x, y);
        }
    }
    panic!("no batch without max-pooling near ties");
}

#[test]
fn conv2d_and_maxpool_gradients_match_central_differences() {
    let mut e = engine_of(MAXPOOL_SPEC, 21, 0.1);
    // Larger conv weights spread the pooled values apart (fewer near ties).
    let mut p = params(&e);
    let (wr, _) = tensor_range(&e, "layers.0.weight");
    p[wr].iter_mut().for_each(|v| *v *= 4.0);
    e.write_params(&p).expect("write");
    let eps = 2e-3;
    let (x, y) = tie_free_maxpool_batch(&e, 3, eps);
    let b = BatchRef {
        images: &x,
        labels: &y,
    };
    // A conv bias moves a whole channel and the linear layer comes after the pooling: neither
    // can move an argmax, so they take the larger (less noisy) step.
    check_gradients(
        &mut e,
        b,
        &[
            ("layers.0.weight", eps),
            ("layers.0.bias", 1e-2),
            ("layers.3.weight", 1e-2),
            ("layers.3.bias", 1e-2),
        ],
    );
}

#[test]
fn conv2d_and_avgpool_gradients_match_central_differences() {
    let mut e = engine_of(AVGPOOL_SPEC, 22, 0.1);
    let (x, y) = batch(3, 2 * 9 * 9, 4, 7);
    let b = BatchRef {
        images: &x,
        labels: &y,
    };
    check_gradients(
        &mut e,
        b,
        &[
            ("layers.0.weight", 1e-2),
            ("layers.0.bias", 1e-2),
            ("layers.4.weight", 1e-2),
            ("layers.4.bias", 1e-2),
        ],
    );
}

/// The f32 values of a safetensors tensor.
fn f32_values(view: &safetensors::tensor::TensorView<'_>) -> Vec<f32> {
    assert_eq!(view.dtype(), safetensors::Dtype::F32);
    view.data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// `[rows, cols]` row-major values transposed to `[cols, rows]`.
fn transpose(values: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    (0..cols * rows)
        .map(|t| values[(t % rows) * cols + t / rows])
        .collect()
}

#[test]
fn saved_weights_are_the_pytorch_layout_of_the_flat_view() {
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("model.safetensors");
    let e = engine_of(LAYOUT_SPEC, 31, 0.1);
    e.save_weights(&path).expect("save");
    let flat = params(&e);
    let bytes = std::fs::read(&path).expect("read");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    let layout = e.layout();
    let mut names: Vec<&str> = st.names().into_iter().collect();
    names.sort_unstable();
    let mut expected: Vec<&str> = layout.params.iter().map(|p| p.name.as_str()).collect();
    expected.sort_unstable();
    assert_eq!(names, expected, "exactly the layout's tensors");
    let (mut linear, mut conv) = (0, 0);
    for info in &layout.params {
        let view = st.tensor(&info.name).expect("tensor");
        let file = f32_values(&view);
        let own = &flat[info.offset..info.offset + info.len];
        match info.shape[..] {
            [rows, cols] => {
                // burn's linear weight [in, out] is PyTorch's [out, in]: file[o][i] == own[i][o].
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
                assert_ne!(file, own, "{}: transposed, not copied", info.name);
                linear += 1;
            }
            _ => {
                assert_eq!(view.shape(), &info.shape[..], "{}", info.name);
                assert_eq!(file, own, "{}", info.name);
                conv += usize::from(info.shape.len() == 4);
            }
        }
    }
    assert_eq!(
        (linear, conv),
        (2, 2),
        "the model's linear and conv weights were all seen"
    );
}

#[test]
fn pytorch_layout_weights_load_transposed_into_the_flat_view() {
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("torch.safetensors");
    let mut e = engine_of(LAYOUT_SPEC, 32, 0.1);
    let layout = e.layout().clone();
    // Distinct values, written the way PyTorch would store them ([out, in] linear weights).
    let wanted = uniform(layout.total, 99);
    let torch: Vec<(String, Vec<usize>, Vec<u8>)> = layout
        .params
        .iter()
        .map(|info| {
            let own = &wanted[info.offset..info.offset + info.len];
            let (shape, values) = match info.shape[..] {
                [rows, cols] => (vec![cols, rows], transpose(own, rows, cols)),
                _ => (info.shape.clone(), own.to_vec()),
            };
            let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            (info.name.clone(), shape, bytes)
        })
        .collect();
    let views = torch.iter().map(|(name, shape, bytes)| {
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes)
                .expect("view");
        (name.clone(), view)
    });
    std::fs::write(
        &path,
        safetensors::serialize(views, None).expect("serialize"),
    )
    .expect("write");
    e.load_weights(&path).expect("load");
    assert_eq!(params(&e), wanted);
}

/// A flat gradient with no zero entry, of both signs and various sizes.
fn known_gradient(n: usize) -> Vec<f32> {
    uniform(n, 5)
        .iter()
        .map(|v| if *v >= 0.0 { v + 0.01 } else { v - 0.01 })
        .collect()
}

/// Asserts `after == before - lr * g` to f32 rounding (two roundings: the product, the
/// difference).
fn assert_sgd_step(before: &[f32], after: &[f32], g: &[f32], lr: f64) {
    for i in 0..before.len() {
        let step = lr * g[i] as f64;
        let want = before[i] as f64 - step;
        let bound = 1.2e-7 * (want.abs() + step.abs()) + 1e-12;
        assert!(
            (after[i] as f64 - want).abs() <= bound,
            "lr {lr}, param {i}: {} after, {want} wanted",
            after[i]
        );
    }
}

#[test]
fn apply_grads_uses_the_learning_rate_it_is_given() {
    // The config's lr (0.1) must play no part: each step uses the lr of its call.
    let mut e = engine_of(LAYOUT_SPEC, 41, 0.1);
    let g = known_gradient(e.num_params());
    for lr in [0.03, 0.7] {
        let before = params(&e);
        e.apply_grads(&g, lr).expect("apply");
        assert_sgd_step(&before, &params(&e), &g, lr);
    }
}

#[test]
fn apply_grads_uses_the_given_gradient_not_the_last_backward() {
    let mut e = engine_of(LAYOUT_SPEC, 42, 0.1);
    let (x, y) = batch(4, 2 * 8 * 8, 5, 3);
    e.forward_backward(BatchRef {
        images: &x,
        labels: &y,
    })
    .expect("forward");
    let g = known_gradient(e.num_params());
    let before = params(&e);
    e.apply_grads(&g, 0.25).expect("apply");
    assert_sgd_step(&before, &params(&e), &g, 0.25);
}

/// Evaluation totals of `e` on samples `range` of a data set, in chunks of `batch_size`.
fn eval_range(
    e: &BurnEngine,
    (x, y): (&[f32], &[i64]),
    per: usize,
    range: std::ops::Range<usize>,
    batch_size: usize,
) -> flotilla_engine::EvalStats {
    e.evaluate(
        &x[range.start * per..range.end * per],
        &y[range.clone()],
        batch_size,
    )
    .expect("evaluate")
}

#[test]
fn evaluate_on_halves_adds_up_to_evaluate_on_the_whole() {
    let e = engine_of(LAYOUT_SPEC, 51, 0.1);
    let per = 2 * 8 * 8;
    let n = 23;
    let (x, y) = batch(n, per, 5, 11);
    let data = (&x[..], &y[..]);
    let whole = eval_range(&e, data, per, 0..n, 64);
    assert_eq!(whole.count, n);
    assert!(
        whole.correct > 0 && whole.correct < n,
        "a mixed result: {whole:?}"
    );
    for (split, (bs_a, bs_b)) in [(11, (4, 5)), (12, (1, 7)), (7, (3, 100))] {
        let a = eval_range(&e, data, per, 0..split, bs_a);
        let b = eval_range(&e, data, per, split..n, bs_b);
        assert_eq!((a.count, b.count), (split, n - split));
        assert_eq!(a.correct + b.correct, whole.correct, "split at {split}");
        let sum = a.loss_sum + b.loss_sum;
        assert!(
            (sum - whole.loss_sum).abs() <= 1e-5 * whole.loss_sum,
            "split at {split}: {sum} vs {}",
            whole.loss_sum
        );
    }
    for bs in [0, 1, 5, 23] {
        let other = eval_range(&e, data, per, 0..n, bs);
        assert_eq!(
            (other.count, other.correct),
            (n, whole.correct),
            "batch size {bs}"
        );
        assert!((other.loss_sum - whole.loss_sum).abs() <= 1e-5 * whole.loss_sum);
    }
}

#[test]
fn evaluate_matches_hand_computed_cross_entropy() {
    // A single linear layer set to a permutation plus a bias: the logits are known, so the
    // loss and the predictions can be computed here in f64. Flat linear weight is [in, out].
    let spec = "input: [4]\nlayers:\n  - linear: {out: 4}\n";
    let mut e = engine_of(spec, 52, 0.1);
    let perm = [2usize, 0, 3, 1];
    let bias = [0.3f32, -0.2, 0.1, 0.0];
    let mut p = vec![0.0f32; e.num_params()];
    for (i, &o) in perm.iter().enumerate() {
        p[i * 4 + o] = 1.0;
    }
    p[16..].copy_from_slice(&bias);
    e.write_params(&p).expect("write");
    let n = 9;
    let (x, y) = batch(n, 4, 4, 17);
    let (mut loss_sum, mut correct) = (0.0f64, 0);
    for (row, &label) in x.chunks(4).zip(&y) {
        let mut logits = [0.0f64; 4];
        for (i, &o) in perm.iter().enumerate() {
            logits[o] = row[i] as f64 + bias[o] as f64;
        }
        let max = logits.iter().fold(f64::NEG_INFINITY, |m, v| m.max(*v));
        let lse = max + logits.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
        loss_sum += lse - logits[label as usize];
        let argmax = (0..4).fold(0, |b, k| if logits[k] > logits[b] { k } else { b });
        correct += usize::from(argmax as i64 == label);
    }
    assert!(correct > 0 && correct < n, "a mixed result: {correct}");
    for bs in [1, 4, 9] {
        let stats = e.evaluate(&x, &y, bs).expect("evaluate");
        assert_eq!(
            (stats.count, stats.correct),
            (n, correct),
            "batch size {bs}"
        );
        assert!(
            (stats.loss_sum - loss_sum).abs() <= 1e-5 * loss_sum,
            "batch size {bs}: {} vs {loss_sum}",
            stats.loss_sum
        );
    }
    // The training loss of the same batch is the same mean.
    let mean = e
        .forward_backward(BatchRef {
            images: &x,
            labels: &y,
        })
        .expect("forward") as f64;
    assert!((mean - loss_sum / n as f64).abs() <= 1e-5 * mean);
}

/// A residual add and a channel concatenation around three smooth convolutions: the gradient
/// of the first layer flows through the direct path and both links.
const LINKS_SPEC: &str = "name: links
input: [2, 6, 6]
layers:
  - conv2d: {out: 3, k: 3, padding: 1}
  - tanh:
    out_variables: [a]
  - conv2d: {out: 3, k: 3, padding: 1}
  - tanh:
    dependencies: [a]
    merge: add
  - conv2d: {out: 2, k: 3, padding: 1}
  - identity:
    dependencies: [a]
    merge: concat
  - flatten
  - linear: {out: 4}
";

#[test]
fn residual_and_concat_gradients_match_central_differences() {
    let mut e = engine_of(LINKS_SPEC, 23, 0.1);
    assert_eq!(tensor_range(&e, "layers.7.weight").1, vec![5 * 6 * 6, 4]);
    let (x, y) = batch(3, 2 * 6 * 6, 4, 11);
    let b = BatchRef {
        images: &x,
        labels: &y,
    };
    check_gradients(
        &mut e,
        b,
        &[
            ("layers.0.weight", 1e-2),
            ("layers.2.weight", 1e-2),
            ("layers.4.weight", 1e-2),
            ("layers.7.weight", 1e-2),
        ],
    );
}

#[test]
fn links_compute_what_the_spec_says() {
    // h = L1(a) + a with a = L0(x); logits = L4([h, a]). Computed here in f64 from the flat
    // parameters (linear weight [in, out]); a model that ignored a link would differ.
    let spec = "input: [3]
layers:
  - linear: {out: 3}
    out_variables: [a]
  - linear: {out: 3}
  - identity:
    dependencies: [a]
  - identity:
    dependencies: [a]
    merge: concat
  - linear: {out: 2}
";
    let e = engine_of(spec, 53, 0.1);
    let p = params(&e);
    let linear = |name: &str, input: &[f64]| -> Vec<f64> {
        let (w, shape) = tensor_range(&e, &format!("{name}.weight"));
        let (b, _) = tensor_range(&e, &format!("{name}.bias"));
        let (rows, cols) = (shape[0], shape[1]);
        assert_eq!(rows, input.len());
        (0..cols)
            .map(|o| {
                p[b.start + o] as f64
                    + (0..rows)
                        .map(|i| input[i] * p[w.start + i * cols + o] as f64)
                        .sum::<f64>()
            })
            .collect()
    };
    let n = 8;
    let (x, y) = batch(n, 3, 2, 29);
    let mut loss_sum = 0.0f64;
    for (row, &label) in x.chunks(3).zip(&y) {
        let row: Vec<f64> = row.iter().map(|v| *v as f64).collect();
        let a = linear("layers.0", &row);
        let h: Vec<f64> = linear("layers.1", &a)
            .iter()
            .zip(&a)
            .map(|(u, v)| u + v)
            .collect();
        let cat: Vec<f64> = h.iter().chain(&a).copied().collect();
        let logits = linear("layers.4", &cat);
        let max = logits.iter().fold(f64::NEG_INFINITY, |m, v| m.max(*v));
        let lse = max + logits.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
        loss_sum += lse - logits[label as usize];
    }
    let stats = e.evaluate(&x, &y, 4).expect("evaluate");
    assert!(
        (stats.loss_sum - loss_sum).abs() <= 1e-5 * loss_sum.abs().max(1.0),
        "engine {} vs hand {loss_sum}",
        stats.loss_sum
    );
}
