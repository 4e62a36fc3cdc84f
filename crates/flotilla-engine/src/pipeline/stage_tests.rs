//! Stages against the whole model: a model cut into stages and run micro-batch by micro-batch
//! gives the whole model's initial parameters, loss and gradients.

use std::collections::HashMap;

use crate::StageEngine;
use crate::engine_tests::sgd;
use crate::{BatchRef, BurnEngine, Engine, ModelSpec, ModelState, Stage, StageCut};

const SEED: u64 = 17;

/// A flat model with a residual skip and a concatenating skip, both crossing stages.
fn skip_mlp() -> ModelSpec {
    ModelSpec::from_yaml(
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
  - linear: {out: 3}
",
        "skip-mlp",
    )
    .expect("spec")
}

/// A small residual CNN: image crossings.
fn small_cnn() -> ModelSpec {
    ModelSpec::from_yaml(
        "input: [1, 8, 8]
layers:
  - conv2d: {out: 4, k: 3, padding: 1}
    out_variables: [x]
  - relu
  - conv2d: {out: 4, k: 3, padding: 1}
  - relu
  - identity:
    dependencies: [x]
  - maxpool: {k: 2}
  - flatten
  - linear: {out: 5}
",
        "small-cnn",
    )
    .expect("spec")
}

fn data(spec: &ModelSpec, n: usize) -> (Vec<f32>, Vec<i64>) {
    let per = spec.input_shape().expect("input").numel();
    let classes = spec.output_shape().expect("output").numel();
    let images = (0..n * per)
        .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
        .collect();
    let labels = (0..n).map(|i| (i * 7 % classes) as i64).collect();
    (images, labels)
}

/// Runs one batch through the stages in `m` micro-batches (all forwards, then all backwards
/// in reverse), routing every crossing by its index; returns the mean loss.
fn run_batch(
    stages: &mut [Stage],
    cut: &StageCut,
    images: &[f32],
    labels: &[i64],
    m: usize,
) -> f32 {
    let n = labels.len();
    let per = images.len() / n;
    let sizes: Vec<usize> = (0..m).map(|i| n / m + usize::from(i < n % m)).collect();
    let starts: Vec<usize> = sizes
        .iter()
        .scan(0, |s, &k| {
            let a = *s;
            *s += k;
            Some(a)
        })
        .collect();
    let last = stages.len() - 1;
    let mut sent: HashMap<(usize, usize), Vec<f32>> = HashMap::new();
    for mb in 0..m {
        let (a, k) = (starts[mb], sizes[mb]);
        for (s, stage) in stages.iter_mut().enumerate() {
            let inputs: Vec<Vec<f32>> = if s == 0 {
                vec![images[a * per..(a + k) * per].to_vec()]
            } else {
                cut.inputs(s)
                    .iter()
                    .map(|c| sent[&(*c, mb)].clone())
                    .collect()
            };
            let refs: Vec<&[f32]> = inputs.iter().map(Vec::as_slice).collect();
            let out = stage.forward(mb, k, &refs).expect("forward");
            if s < last {
                for (c, v) in cut.outputs(s).into_iter().zip(out) {
                    sent.insert((c, mb), v);
                }
            }
        }
    }
    let mut loss = 0.0;
    let mut back: HashMap<(usize, usize), Vec<f32>> = HashMap::new();
    for mb in (0..m).rev() {
        let (a, k) = (starts[mb], sizes[mb]);
        for s in (0..=last).rev() {
            let grads_in = if s == last {
                let (l, g) = stages[s]
                    .backward_loss(mb, &labels[a..a + k], k as f32 / n as f32)
                    .expect("loss");
                loss += l * k as f32 / n as f32;
                g
            } else {
                let g = cut
                    .outputs(s)
                    .iter()
                    .map(|c| back.remove(&(*c, mb)).expect("grad"))
                    .collect();
                stages[s].backward(mb, g).expect("backward")
            };
            if s > 0 {
                for (c, g) in cut.inputs(s).into_iter().zip(grads_in) {
                    back.insert((c, mb), g);
                }
            }
        }
    }
    loss
}

/// name → values of every parameter (or gradient) of a flat buffer in `layout` order.
fn by_name(state: &dyn ModelState, flat: &[f32]) -> HashMap<String, Vec<f32>> {
    state
        .layout()
        .params
        .iter()
        .map(|p| (p.name.clone(), flat[p.offset..p.offset + p.len].to_vec()))
        .collect()
}

fn params_of(state: &dyn ModelState) -> HashMap<String, Vec<f32>> {
    let mut flat = vec![0.0; state.num_params()];
    state.read_params(&mut flat).expect("read");
    by_name(state, &flat)
}

fn assert_close(a: &HashMap<String, Vec<f32>>, b: &HashMap<String, Vec<f32>>, what: &str) {
    assert_eq!(
        a.len(),
        b.len(),
        "{what}: tensors {:?} vs {:?}",
        a.keys(),
        b.keys()
    );
    for (name, x) in a {
        let y = &b[name];
        assert_eq!(x.len(), y.len(), "{what} {name}: lengths");
        let scale = x.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
        let err = x
            .iter()
            .zip(y)
            .fold(0.0f32, |m, (p, q)| m.max((p - q).abs()));
        assert!(
            err / scale <= 1e-5,
            "{what} {name}: relative error {}",
            err / scale
        );
    }
}

fn check(spec: &ModelSpec, points: &[usize], m: usize) {
    let cut = StageCut::at(spec, points).expect("cut");
    let mut whole = BurnEngine::new(spec, &sgd(0.1, 0.0), "flex", SEED).expect("engine");
    let mut stages: Vec<Stage> = (0..cut.stages())
        .map(|s| Stage::new(spec, &cut, s, &sgd(0.1, 0.0), "flex", SEED).expect("stage"))
        .collect();
    // Same names and initial values: the union of the stages is the whole model.
    let mut union = HashMap::new();
    for stage in &stages {
        union.extend(params_of(stage));
    }
    let initial = params_of(&whole);
    assert_eq!(union, initial, "initial parameters");

    let (images, labels) = data(spec, 8);
    let whole_loss = whole
        .forward_backward(BatchRef {
            images: &images,
            labels: &labels,
        })
        .expect("whole");
    let mut whole_grad = vec![0.0; whole.num_params()];
    whole.read_grads(&mut whole_grad).expect("grads");
    let loss = run_batch(&mut stages, &cut, &images, &labels, m);
    assert!(
        (loss - whole_loss).abs() <= 1e-5 * whole_loss.abs(),
        "loss {loss} vs {whole_loss}"
    );
    let mut grads = HashMap::new();
    for stage in &mut stages {
        let flat = stage.grads_mut().to_vec();
        grads.extend(by_name(stage, &flat));
        assert_eq!(stage.in_flight(), 0);
        assert_eq!(stage.peak_in_flight(), m);
    }
    assert_close(&grads, &by_name(&whole, &whole_grad), "gradient");

    whole.apply_grads(&whole_grad, 0.1).expect("step");
    let mut after = HashMap::new();
    for stage in &mut stages {
        stage.step(0.1).expect("step");
        assert!(stage.grads_mut().iter().all(|g| *g == 0.0));
        after.extend(params_of(stage));
    }
    let whole_after = params_of(&whole);
    assert_close(&after, &whole_after, "parameters after a step");
    assert_ne!(whole_after, initial, "the step moved the parameters");
}

#[test]
fn stages_with_skips_equal_the_whole_model() {
    let spec = skip_mlp();
    check(&spec, &[3], 1);
    check(&spec, &[3], 4);
    // Three stages: `a` goes from stage 0 straight to stage 2, `b` from 1 to 2.
    check(&spec, &[2, 4], 4);
    check(&spec, &[2, 8], 3);
}

#[test]
fn image_stages_equal_the_whole_model() {
    let spec = small_cnn();
    check(&spec, &[2], 4);
    check(&spec, &[1, 4, 6], 2);
}

#[test]
fn out_of_order_calls_are_errors_not_panics() {
    let spec = skip_mlp();
    let cut = StageCut::at(&spec, &[3]).expect("cut");
    let mut first = Stage::new(&spec, &cut, 0, &sgd(0.1, 0.0), "flex", SEED).expect("stage");
    let mut last = Stage::new(&spec, &cut, 1, &sgd(0.1, 0.0), "flex", SEED).expect("stage");
    let err = first
        .backward(0, vec![vec![0.0; 16]])
        .unwrap_err()
        .to_string();
    assert!(err.contains("no forward in flight"), "{err}");
    let bad = first.forward(0, 2, &[&[0.0; 5]]).unwrap_err().to_string();
    assert!(bad.contains("need 24 values, got 5"), "{bad}");
    let (images, _) = data(&spec, 2);
    let out = first.forward(0, 2, &[&images]).expect("forward");
    assert!(
        first.forward(0, 2, &[&images]).is_err(),
        "same micro-batch twice"
    );
    let err = first.step(0.1).unwrap_err().to_string();
    assert!(err.contains("still waiting for backward"), "{err}");
    let err = first
        .backward_loss(0, &[0, 1], 1.0)
        .unwrap_err()
        .to_string();
    assert!(err.contains("not the last stage"), "{err}");
    let refs: Vec<&[f32]> = out.iter().map(Vec::as_slice).collect();
    last.forward(0, 2, &refs).expect("forward");
    let err = last.backward_loss(0, &[0], 1.0).unwrap_err().to_string();
    assert!(err.contains("1 labels for a micro-batch of 2"), "{err}");
    first.reset();
    assert_eq!(first.in_flight(), 0);
    assert!(Stage::new(&spec, &cut, 2, &sgd(0.1, 0.0), "flex", SEED).is_err());
}

#[test]
fn evaluation_through_stages_gives_the_whole_models_logits() {
    let spec = small_cnn();
    let cut = StageCut::at(&spec, &[3]).expect("cut");
    let whole = BurnEngine::new(&spec, &sgd(0.1, 0.0), "flex", SEED).expect("engine");
    let stages: Vec<Stage> = (0..2)
        .map(|s| Stage::new(&spec, &cut, s, &sgd(0.1, 0.0), "flex", SEED).expect("stage"))
        .collect();
    let (images, labels) = data(&spec, 6);
    let mid = stages[0].forward_eval(6, &[&images]).expect("eval 0");
    let refs: Vec<&[f32]> = mid.iter().map(Vec::as_slice).collect();
    let logits = stages[1].forward_eval(6, &refs).expect("eval 1");
    let stats = crate::EvalStats::from_logits(&logits[0], &labels);
    let expected = whole.evaluate(&images, &labels, 4).expect("evaluate");
    assert_eq!(stats.count, 6);
    assert_eq!(stats.correct, expected.correct);
    assert!(
        (stats.loss() - expected.loss()).abs() < 1e-5,
        "{stats:?} vs {expected:?}"
    );
}
