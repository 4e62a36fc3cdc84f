//! The grouped backward pass against one backward pass: the same loss, gradients and steps,
//! bit for bit; groups that cover every parameter once, last layers first, cut only where the
//! main activation alone crosses.

use std::time::Instant;

use crate::backward_groups::{self, BackwardGroup};
use crate::engine_tests::sgd;
use crate::pipeline::cut::{MAIN, StageCut};
use crate::{BatchRef, BurnEngine, Engine, ModelSpec, ModelState};

const SEED: u64 = 23;

/// The shipped models, and a flat one with a residual and a concatenating skip.
const MODELS: [&str; 5] = ["mlp", "lenet5", "resmlp", "resnet-mnist", "skip-mlp"];

fn spec(name: &str) -> ModelSpec {
    if name == "skip-mlp" {
        return ModelSpec::from_yaml(
            "input: [12]
layers:
  - linear: {out: 16}
    out_variables: [a]
  - relu
  - linear: {out: 16}
  - tanh
  - linear: {out: 16}
    dependencies: [a]
  - relu
  - linear: {out: 10}
    out_variables: [b]
  - tanh
  - identity:
    dependencies: [b]
    merge: concat
  - linear: {out: 12}
  - relu
  - linear: {out: 3}
",
            "skip-mlp",
        )
        .expect("spec");
    }
    ModelSpec::builtin(name).expect("shipped spec")
}

fn engine(spec: &ModelSpec, max_bytes: usize) -> BurnEngine {
    let mut e = BurnEngine::new(spec, &sgd(0.05, 0.9), "flex", SEED).expect("engine");
    e.set_backward_group_bytes(max_bytes).expect("groups");
    e
}

/// A deterministic pseudo-random batch of `n` samples for `spec`.
fn batch(spec: &ModelSpec, n: usize, salt: u32) -> (Vec<f32>, Vec<i64>) {
    let per = spec.input_shape().expect("input").numel();
    let classes = spec.output_shape().expect("output").numel() as u32;
    let mut x = salt.wrapping_mul(2654435761).wrapping_add(12345);
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        x
    };
    let images = (0..n * per)
        .map(|_| (next() % 1000) as f32 / 500.0 - 1.0)
        .collect();
    let labels = (0..n).map(|_| (next() % classes) as i64).collect();
    (images, labels)
}

/// One streamed pass: the loss, the gradients assembled by parameter index, and the indices
/// in the order they were reported.
fn stream(e: &mut BurnEngine, images: &[f32], labels: &[i64]) -> (f32, Vec<f32>, Vec<usize>) {
    let layout = e.layout().clone();
    let mut flat = vec![f32::NAN; layout.total];
    let mut order = Vec::new();
    let loss = e
        .forward_backward_streaming(BatchRef { images, labels }, &mut |i, g| {
            let p = &layout.params[i];
            flat[p.offset..p.offset + p.len].copy_from_slice(g);
            order.push(i);
            Ok(())
        })
        .expect("streamed pass");
    (loss, flat, order)
}

fn params_of(e: &dyn ModelState) -> Vec<f32> {
    let mut out = vec![0.0; e.num_params()];
    e.read_params(&mut out).expect("params");
    out
}

/// The layer of a parameter named `layers.<i>.<name>`.
fn layer_of(name: &str) -> usize {
    name.split('.')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("layers.<i>.<name>")
}

fn grads_of(e: &BurnEngine) -> Vec<f32> {
    let mut g = vec![0.0; e.num_params()];
    e.read_grads(&mut g).expect("grads");
    g
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The indices `backward_groups` promises: group by group, flat order within each.
fn promised_order(e: &BurnEngine) -> Vec<usize> {
    e.backward_groups().into_iter().flatten().collect()
}

#[test]
fn streamed_gradients_and_steps_equal_one_backward_bit_for_bit() {
    for name in MODELS {
        let spec = spec(name);
        let mut grouped = engine(&spec, 1);
        let mut whole = engine(&spec, 0);
        let groups = grouped.backward_plan().to_vec();
        assert!(groups.len() >= 3, "{name}: {groups:?}");
        assert_eq!(whole.backward_plan().len(), 1);
        for step in 0..5 {
            let (images, labels) = batch(&spec, 16, step);
            let (loss, streamed, order) = stream(&mut grouped, &images, &labels);
            assert_eq!(order, promised_order(&grouped), "{name}: report order");
            let expected_loss = whole
                .forward_backward(BatchRef {
                    images: &images,
                    labels: &labels,
                })
                .expect("one backward");
            let expected = grads_of(&whole);
            assert_eq!(
                loss.to_bits(),
                expected_loss.to_bits(),
                "{name} step {step}: loss {loss} vs {expected_loss}"
            );
            assert!(
                bits(&streamed) == bits(&expected),
                "{name} step {step}: gradients differ at {:?}",
                streamed
                    .iter()
                    .zip(&expected)
                    .position(|(a, b)| a.to_bits() != b.to_bits())
            );
            // Every group got a real gradient (group 0 only through every cut above it).
            for group in &groups {
                let layout = grouped.layout();
                let range = layout.params[group.params.start].offset
                    ..layout.params[group.params.end - 1].offset
                        + layout.params[group.params.end - 1].len;
                assert!(
                    streamed[range].iter().any(|g| *g != 0.0),
                    "{name}: group {group:?} has a zero gradient"
                );
            }
            // The streamed gradients are kept, as `forward_backward` keeps its own.
            assert_eq!(bits(&grads_of(&grouped)), bits(&streamed), "{name}: kept");
            grouped.apply_grads(&streamed, 0.05).expect("step");
            whole.apply_grads(&expected, 0.05).expect("step");
        }
        let (a, b) = (params_of(&grouped), params_of(&whole));
        assert_eq!(bits(&a), bits(&b), "{name}: parameters after 5 steps");
        assert_ne!(
            bits(&a),
            bits(&params_of(&engine(&spec, 0))),
            "{name}: the steps moved the parameters"
        );
    }
}

/// Whether `group` is one segment between allowed cuts, with parameters (so it may exceed
/// the byte limit).
fn indivisible(spec: &ModelSpec, group: &BackwardGroup, layers: &[usize]) -> bool {
    let cuts = backward_groups::clean_cuts(spec).expect("cuts");
    let inner: Vec<usize> = cuts
        .into_iter()
        .filter(|c| group.layers.start < *c && *c < group.layers.end)
        .collect();
    // Splitting at the inner cuts leaves one part with parameters.
    let mut bounds = vec![group.layers.start];
    bounds.extend(inner);
    bounds.push(group.layers.end);
    bounds
        .windows(2)
        .map(|w| w[0]..w[1])
        .filter(|r| layers[r.start..r.end].iter().any(|v| *v > 0))
        .count()
        == 1
}

#[test]
fn groups_cover_every_parameter_once_last_layers_first() {
    for name in MODELS {
        let spec = spec(name);
        let mut e = engine(&spec, 0);
        let n = spec.layers.len();
        let tensors = e.layout().params.len();
        let mut values = vec![0; n];
        for p in &e.layout().params {
            values[layer_of(&p.name)] += p.len;
        }
        for max_bytes in [0, 1, 4_000, 50_000, 200_000, usize::MAX] {
            e.set_backward_group_bytes(max_bytes).expect("groups");
            let plan = e.backward_plan().to_vec();
            // Layers: consecutive, in layer order, covering every layer once.
            assert_eq!(plan.first().map(|g| g.layers.start), Some(0), "{name}");
            assert_eq!(plan.last().map(|g| g.layers.end), Some(n), "{name}");
            assert!(
                plan.windows(2)
                    .all(|w| w[0].layers.end == w[1].layers.start)
            );
            assert!(
                plan.iter().all(|g| !g.layers.is_empty()),
                "{name}: {plan:?}"
            );
            // Parameters: what `backward_groups` reports, last layers first.
            let reported = e.backward_groups();
            let reversed: Vec<_> = plan.iter().rev().map(|g| g.params.clone()).collect();
            assert_eq!(reported, reversed, "{name}");
            assert_eq!(reported.first().map(|r| r.end), Some(tensors), "{name}");
            assert_eq!(reported.last().map(|r| r.start), Some(0), "{name}");
            assert!(reported.windows(2).all(|w| w[1].end == w[0].start));
            let mut seen: Vec<usize> = reported.iter().flat_map(|r| r.clone()).collect();
            seen.sort_unstable();
            assert_eq!(seen, (0..tensors).collect::<Vec<_>>(), "{name}: once each");
            let total: usize = plan.iter().map(|g| g.bytes).sum();
            assert_eq!(total, 4 * e.num_params(), "{name}");
            for g in &plan {
                assert!(g.bytes > 0, "{name}: a group without parameters: {plan:?}");
                assert!(
                    max_bytes == 0 || g.bytes <= max_bytes || indivisible(&spec, g, &values),
                    "{name} max {max_bytes}: {g:?} is over the limit and divisible"
                );
            }
            if max_bytes == 0 || max_bytes == usize::MAX {
                assert_eq!(plan.len(), 1, "{name} max {max_bytes}: one group");
            }
            // Each group's parameters are its layers' parameters.
            let layout = e.layout();
            for g in &plan {
                for p in &layout.params[g.params.clone()] {
                    let layer = layer_of(&p.name);
                    assert!(g.layers.contains(&layer), "{name}: {} in {g:?}", p.name);
                }
            }
        }
        // A streamed pass reports every parameter exactly once under each plan.
        e.set_backward_group_bytes(4_000).expect("groups");
        let (images, labels) = batch(&spec, 4, 9);
        let (_, _, order) = stream(&mut e, &images, &labels);
        assert_eq!(order, promised_order(&e), "{name}");
    }
}

#[test]
fn cuts_fall_only_where_the_main_activation_alone_crosses() {
    for name in MODELS {
        let spec = spec(name);
        let n = spec.layers.len();
        let cuts = backward_groups::clean_cuts(&spec).expect("cuts");
        for c in 1..n {
            let cut = StageCut::at(&spec, &[c]).expect("cut");
            let main_only = cut.crossings.iter().all(|x| x.name == MAIN);
            assert_eq!(cuts.contains(&c), main_only, "{name}: cut before layer {c}");
        }
        let plan = engine(&spec, 1).backward_plan().to_vec();
        let ranges = plan.iter().map(|g| g.layers.clone()).collect();
        let cut = StageCut::new(&spec, ranges).expect("cut");
        assert!(
            cut.crossings.iter().all(|x| x.name == MAIN),
            "{name}: {:?}",
            cut.crossings
        );
    }
    // The residual CNN: the stem, blocks 1-2, the downsampling convolution, blocks 3-4 with
    // the pooling, the classifier. Every block's skip stays inside a group.
    let layers: Vec<_> = engine(&spec("resnet-mnist"), 1)
        .backward_plan()
        .iter()
        .map(|g| g.layers.clone())
        .collect();
    assert_eq!(layers, vec![0..2, 2..11, 11..12, 12..23, 23..24]);
    // Parameterless layers join the group before them: the MLP's ReLUs go with the linear
    // layer they follow, its flatten with group 0.
    let layers: Vec<_> = engine(&spec("mlp"), 1)
        .backward_plan()
        .iter()
        .map(|g| g.layers.clone())
        .collect();
    assert_eq!(layers, vec![0..3, 3..5, 5..6]);
    // Under a limit, groups merge from the back while they fit: LeNet-5's last two linear
    // layers (40,656 + 3,400 bytes) share a group, the first (192,480 bytes) is over the limit
    // and alone, the two convolutions (9,664 + 624 bytes) share group 0.
    let mut lenet = engine(&spec("lenet5"), 50_000);
    let plan = lenet.backward_plan().to_vec();
    let layers: Vec<_> = plan.iter().map(|g| g.layers.clone()).collect();
    let bytes: Vec<_> = plan.iter().map(|g| g.bytes).collect();
    assert_eq!(layers, vec![0..7, 7..9, 9..12]);
    assert_eq!(bytes, vec![10_288, 192_480, 44_056]);
    assert_eq!(lenet.backward_groups(), vec![6..10, 4..6, 0..4]);
    lenet.set_backward_group_bytes(usize::MAX).expect("groups");
    assert_eq!(lenet.backward_groups(), vec![0..10]);
}

#[test]
fn a_failed_stream_keeps_no_gradients_and_the_next_one_works() {
    for max_bytes in [0, 1] {
        let spec = spec("lenet5");
        let mut e = engine(&spec, max_bytes);
        let (images, labels) = batch(&spec, 4, 3);
        let b = BatchRef {
            images: &images,
            labels: &labels,
        };
        let err = e
            .forward_backward_streaming(b, &mut |i, _| match i {
                7 => Err(crate::EngineError::Batch("bucket 7 refused".into())),
                _ => Ok(()),
            })
            .expect_err("the callback's error")
            .to_string();
        assert!(err.contains("bucket 7 refused"), "{err}");
        assert!(e.for_each_grad(&mut |_, _| Ok(())).is_err(), "no gradients");
        let (_, streamed, _) = stream(&mut e, &images, &labels);
        assert_eq!(bits(&grads_of(&e)), bits(&streamed));
        e.apply_grads(&streamed, 0.1).expect("step");
        assert!(
            e.for_each_grad(&mut |_, _| Ok(())).is_err(),
            "a step consumes the gradients"
        );
        let short = e.forward_backward_streaming(
            BatchRef {
                images: &images[1..],
                labels: &labels,
            },
            &mut |_, _| Ok(()),
        );
        assert!(short.is_err(), "a bad batch is an error");
    }
}

/// Timing, not a test: LeNet-5 at batch 64, one backward pass (then reading every gradient)
/// against the grouped pass, interleaved, medians (and quartiles) of 40 steps each. Run with
/// `RAYON_NUM_THREADS=1 cargo test --release -p flotilla-engine grouped_overhead -- --ignored --nocapture`.
#[test]
#[ignore = "timing; run explicitly with --ignored --nocapture"]
fn grouped_overhead_lenet5_batch_64() {
    let spec = spec("lenet5");
    let mut whole = engine(&spec, 0);
    let mut grouped = engine(&spec, 1);
    println!(
        "groups (layers): {:?}",
        grouped
            .backward_plan()
            .iter()
            .map(|g| g.layers.clone())
            .collect::<Vec<_>>()
    );
    let (images, labels) = batch(&spec, 64, 1);
    let b = BatchRef {
        images: &images,
        labels: &labels,
    };
    let mut sink = 0.0f32;
    let mut one = |e: &mut BurnEngine| {
        let start = Instant::now();
        e.forward_backward_streaming(b, &mut |_, g| {
            sink += g[0];
            Ok(())
        })
        .expect("pass");
        start.elapsed().as_secs_f64() * 1e3
    };
    for _ in 0..3 {
        one(&mut whole);
        one(&mut grouped);
    }
    let (mut a, mut g) = (Vec::new(), Vec::new());
    for i in 0..40 {
        if i % 2 == 0 {
            a.push(one(&mut whole));
            g.push(one(&mut grouped));
        } else {
            g.push(one(&mut grouped));
            a.push(one(&mut whole));
        }
    }
    // Each round's difference (the rounds are interleaved, so drift cancels).
    let mut paired: Vec<f64> = g.iter().zip(&a).map(|(g, a)| g - a).collect();
    // Median and quartiles, in ms.
    let stats = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        (v[v.len() / 2], v[v.len() / 4], v[3 * v.len() / 4])
    };
    let ((ma, a1, a3), (mg, g1, g3)) = (stats(&mut a), stats(&mut g));
    let (md, d1, d3) = stats(&mut paired);
    println!(
        "lenet5 batch 64, {} steps each: one backward {ma:.2} ms [{a1:.2}, {a3:.2}], {} groups {mg:.2} ms [{g1:.2}, {g3:.2}], overhead {:+.2} ms ({:+.1} %); paired difference {md:+.2} ms [{d1:+.2}, {d3:+.2}]",
        a.len(),
        grouped.backward_plan().len(),
        mg - ma,
        100.0 * (mg - ma) / ma
    );
}
