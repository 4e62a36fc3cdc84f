//! Pipelines of threads over in-memory links against single-process training: the same
//! parameters after 20 batches for 2 and 3 stages, GPipe and 1F1B, 1 and 4 micro-batches,
//! data-parallel replicas, a skip tensor over a stage; bounded activations; a lost stage
//! named.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use flotilla_engine::{
    BatchRef, BurnEngine, Engine, ModelSpec, ModelState, StageCut, cross_entropy,
};

use super::{Pipeline, PipelineOptions, Schedule};
use crate::testkit::{sgd, world};

pub(super) const SEED: u64 = 5;
const BATCH: usize = 8;
pub(super) const BATCHES: usize = 20;
const LR: f64 = 0.1;

/// Layers 0..10; `a` (layer 0) is taken by layer 4, `b` (layer 6) by layer 8.
pub(super) fn spec() -> ModelSpec {
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
        "pipeline-test",
    )
    .expect("spec")
}

pub(super) fn options(
    schedule: Schedule,
    micro_batches: usize,
    data_parallel: usize,
) -> PipelineOptions {
    PipelineOptions {
        micro_batches,
        schedule,
        data_parallel,
        lr: LR,
        optimizer: sgd(LR, 0.0),
        device: "flex".into(),
        seed: SEED,
        clip_grad_norm: None,
        zero: 0,
        group_bytes: 0,
        prefetch: true,
        offload: None,
    }
}

/// Batch `b`: `BATCH` samples of 12 values and their labels.
fn batch(b: usize) -> (Vec<f32>, Vec<i64>) {
    let images = (0..BATCH * 12)
        .map(|i| (((i + 31 * b) * 37 % 101) as f32 / 50.0) - 1.0)
        .collect();
    let labels = (0..BATCH).map(|i| ((i * 7 + b) % 3) as i64).collect();
    (images, labels)
}

/// The rows of `batch(b)` that replica `r` of `d` trains on.
fn shard(b: usize, r: usize, d: usize) -> (Vec<f32>, Vec<i64>) {
    let (images, labels) = batch(b);
    let per = BATCH / d;
    (
        images[r * per * 12..(r + 1) * per * 12].to_vec(),
        labels[r * per..(r + 1) * per].to_vec(),
    )
}

pub(super) fn named(state: &dyn ModelState) -> HashMap<String, Vec<f32>> {
    let mut flat = vec![0.0; state.num_params()];
    state.read_params(&mut flat).expect("read");
    state
        .layout()
        .params
        .iter()
        .map(|p| (p.name.clone(), flat[p.offset..p.offset + p.len].to_vec()))
        .collect()
}

/// Single-process training on the same batches.
pub(super) fn reference() -> (HashMap<String, Vec<f32>>, HashMap<String, Vec<f32>>) {
    reference_clipped(None)
}

/// [`reference`] with the gradient clipped to global norm `clip` before each step, as
/// PyTorch's `clip_grad_norm_` does (its norm in `f64` here).
pub(super) fn reference_clipped(
    clip: Option<f64>,
) -> (HashMap<String, Vec<f32>>, HashMap<String, Vec<f32>>) {
    let mut e = BurnEngine::new(&spec(), &sgd(LR, 0.0), "flex", SEED).expect("engine");
    let initial = named(&e);
    for b in 0..BATCHES {
        let (images, labels) = batch(b);
        e.forward_backward(BatchRef {
            images: &images,
            labels: &labels,
        })
        .expect("train");
        let mut g = vec![0.0; e.num_params()];
        e.read_grads(&mut g).expect("grads");
        if let Some(max) = clip {
            let norm = g.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>().sqrt();
            let factor = (max / (norm + 1e-6)).min(1.0) as f32;
            g.iter_mut().for_each(|v| *v *= factor);
        }
        e.apply_grads(&g, LR).expect("step");
    }
    (initial, named(&e))
}

/// What one rank ends with.
pub(super) struct Ended {
    pub(super) stage: usize,
    pub(super) replica: usize,
    pub(super) params: HashMap<String, Vec<f32>>,
    pub(super) peak: usize,
    pub(super) losses: Vec<f32>,
}

/// Runs a pipeline of `points.len() + 1` stages × `d` replicas as threads; `train` runs one
/// batch on one rank.
fn run(
    points: &[usize],
    opts: PipelineOptions,
    train: fn(&mut Pipeline, usize) -> Option<f32>,
) -> Vec<Ended> {
    run_model(&spec(), points, opts, BATCHES, train)
}

/// [`run`] for any model and number of batches.
pub(super) fn run_model(
    spec: &ModelSpec,
    points: &[usize],
    opts: PipelineOptions,
    batches: usize,
    train: fn(&mut Pipeline, usize) -> Option<f32>,
) -> Vec<Ended> {
    let cut = StageCut::at(spec, points).expect("cut");
    let d = opts.data_parallel;
    let handles: Vec<_> = world(cut.stages() * d)
        .into_iter()
        .map(|group| {
            let (spec, cut, opts) = (spec.clone(), cut.clone(), opts.clone());
            std::thread::spawn(move || {
                let mut pipe = Pipeline::new(&spec, cut, opts, group).expect("pipeline");
                let losses = (0..batches).filter_map(|b| train(&mut pipe, b)).collect();
                pipe.gather_stage().expect("gather");
                Ended {
                    stage: pipe.stage_index(),
                    replica: pipe.replica(),
                    params: named(pipe.stage()),
                    peak: pipe.stage().peak_in_flight(),
                    losses,
                }
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread"))
        .collect()
}

pub(super) fn train_batch(pipe: &mut Pipeline, b: usize) -> Option<f32> {
    let d = pipe.options().data_parallel;
    let (images, labels) = shard(b, pipe.replica(), d);
    pipe.train_batch(&images, &labels).expect("train_batch")
}

/// The PyTorch-style loop: forward, the loss and its gradient on the last stage, backward,
/// step.
fn plain_loop(pipe: &mut Pipeline, b: usize) -> Option<f32> {
    let (images, labels) = shard(b, pipe.replica(), pipe.options().data_parallel);
    let logits = pipe.forward(&images, labels.len()).expect("forward");
    let (loss, grad) = match &logits {
        Some(l) => {
            let (loss, grad) = cross_entropy(l, &labels);
            (Some(loss), Some(grad))
        }
        None => (None, None),
    };
    pipe.backward(grad.as_deref()).expect("backward");
    pipe.step().expect("step");
    loss
}

fn assert_matches_reference(ended: &[Ended], what: &str) {
    let (initial, expected) = reference();
    for (name, want) in &expected {
        assert_ne!(&initial[name], want, "{what}: {name} moved");
    }
    assert_matches(ended, &expected, what);
}

/// The parameters of replica 0's stages together equal `expected` (relative error ≤ 1e-5),
/// and the replicas of a stage agree bitwise.
pub(super) fn assert_matches(ended: &[Ended], expected: &HashMap<String, Vec<f32>>, what: &str) {
    let mut replica0 = HashMap::new();
    for e in ended {
        if e.replica == 0 {
            replica0.extend(e.params.clone());
        }
    }
    assert_eq!(
        replica0.len(),
        expected.len(),
        "{what}: every parameter placed once"
    );
    for (name, want) in expected {
        let got = &replica0[name];
        assert_eq!(got.len(), want.len(), "{what}: {name} length");
        let scale = want.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
        let err = got
            .iter()
            .zip(want)
            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            err / scale <= 1e-5,
            "{what}: {name} relative error {}",
            err / scale
        );
    }
    // Replicas of a stage hold the same parameters.
    for e in ended {
        for (name, v) in &e.params {
            assert_eq!(
                &replica0[name], v,
                "{what}: replica {} of {name}",
                e.replica
            );
        }
    }
}

#[test]
fn two_and_three_stages_equal_single_process_training() {
    for points in [&[4][..], &[2, 4][..]] {
        for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
            for m in [1, 4] {
                let what = format!("stages at {points:?}, {schedule}, {m} micro-batches");
                let ended = run(points, options(schedule, m, 1), train_batch);
                assert_matches_reference(&ended, &what);
                let last = ended
                    .iter()
                    .find(|e| e.stage == points.len())
                    .expect("last");
                assert_eq!(last.losses.len(), BATCHES, "{what}: a loss per batch");
                assert!(
                    ended
                        .iter()
                        .filter(|e| e.stage != points.len())
                        .all(|e| e.losses.is_empty())
                );
            }
        }
    }
}

#[test]
fn the_plain_loop_equals_single_process_training() {
    let ended = run(&[2, 4], options(Schedule::GPipe, 4, 1), plain_loop);
    assert_matches_reference(&ended, "forward / backward / step");
}

#[test]
fn replicas_of_every_stage_equal_training_on_the_global_batch() {
    let ended = run(&[4], options(Schedule::OneFOneB, 2, 2), train_batch);
    assert_eq!(ended.len(), 4);
    assert_matches_reference(&ended, "2 stages × 2 replicas");
}

/// Three replicas of unequal batches (8 samples as 3, 3 and 2), each weighing its gradient
/// by its share of the samples (an elastic job's, `Pipeline::set_share`): the model of one
/// process trained on the whole batch. Without the weights, the plain mean of the three.
#[test]
fn replicas_of_unequal_batches_weighted_by_their_share_train_as_one_process() {
    let ended = run(&[4], options(Schedule::OneFOneB, 2, 3), |pipe, b| {
        let (images, labels) = batch(b);
        let rows = [0..3, 3..6, 6..8][pipe.replica()].clone();
        pipe.set_share(Some(rows.len() as f32 / BATCH as f32));
        let images = &images[rows.start * 12..rows.end * 12];
        pipe.train_batch(images, &labels[rows])
            .expect("train_batch")
    });
    assert_matches_reference(&ended, "3 replicas of 3, 3 and 2 samples");
}

#[test]
fn one_f_one_b_keeps_at_most_the_pipeline_depth_in_flight() {
    let ended = run(&[2, 4], options(Schedule::OneFOneB, 8, 1), train_batch);
    for e in &ended {
        // Measured on the stage, and what the schedule (and so the partitioner) expects.
        assert_eq!(e.peak, 3 - e.stage, "stage {}", e.stage);
        assert_eq!(e.peak, Schedule::OneFOneB.peak_in_flight(3, e.stage, 8));
    }
    let ended = run(&[2, 4], options(Schedule::GPipe, 8, 1), train_batch);
    assert!(ended.iter().all(|e| e.peak == 8));
}

#[test]
fn evaluation_through_the_pipeline_equals_the_whole_model_on_every_rank() {
    let spec = spec();
    let cut = StageCut::at(&spec, &[2, 4]).expect("cut");
    let whole = BurnEngine::new(&spec, &sgd(LR, 0.0), "flex", SEED).expect("engine");
    let (mut images, mut labels) = (Vec::new(), Vec::new());
    for b in 0..3 {
        let (x, y) = batch(b);
        images.extend(x);
        labels.extend(y);
    }
    let expected = whole.evaluate(&images, &labels, 5).expect("evaluate");
    // Two replicas: replica 0 evaluates, every rank gets the totals; chunks of 5 leave a
    // short last chunk.
    let handles: Vec<_> = world(6)
        .into_iter()
        .map(|g| {
            let (spec, cut) = (spec.clone(), cut.clone());
            let (images, labels) = (images.clone(), labels.clone());
            std::thread::spawn(move || {
                let mut pipe =
                    Pipeline::new(&spec, cut, options(Schedule::GPipe, 2, 2), g).expect("pipeline");
                pipe.evaluate(&images, &labels, 5).expect("evaluate")
            })
        })
        .collect();
    for h in handles {
        let got = h.join().expect("rank");
        assert_eq!((got.count, got.correct), (expected.count, expected.correct));
        assert!(
            (got.loss() - expected.loss()).abs() < 1e-5,
            "{got:?} vs {expected:?}"
        );
    }
}

#[test]
fn a_rank_with_other_options_is_named() {
    let spec = spec();
    let cut = StageCut::at(&spec, &[4]).expect("cut");
    let handles: Vec<_> = world(2)
        .into_iter()
        .enumerate()
        .map(|(r, g)| {
            let (spec, cut) = (spec.clone(), cut.clone());
            std::thread::spawn(move || {
                let m = if r == 1 { 4 } else { 2 };
                Pipeline::new(&spec, cut, options(Schedule::GPipe, m, 1), g)
                    .expect_err("options differ")
                    .to_string()
            })
        })
        .collect();
    for h in handles {
        let err = h.join().expect("rank");
        assert!(
            err.contains("rank 1 runs a different model, split or pipeline options"),
            "{err}"
        );
    }
}

#[test]
fn a_lost_stage_is_named_and_bad_shapes_are_refused() {
    let spec = spec();
    let cut = StageCut::at(&spec, &[2, 4]).expect("cut");
    let mut groups = world(3);
    // Wrong world size: named numbers.
    let err = Pipeline::new(
        &spec,
        cut.clone(),
        options(Schedule::GPipe, 2, 2),
        groups[0].clone(),
    )
    .expect_err("refused")
    .to_string();
    assert!(err.contains("need 6 ranks, but the world has 3"), "{err}");
    // Stage 1 leaves after the first batch; stage 2 waits for its activation and names it.
    let last = groups.pop().expect("rank 2");
    let handles: Vec<_> = groups
        .into_iter()
        .map(|g| {
            let (spec, cut) = (spec.clone(), cut.clone());
            std::thread::spawn(move || {
                let mut pipe =
                    Pipeline::new(&spec, cut, options(Schedule::GPipe, 2, 1), g).expect("pipeline");
                let (images, labels) = batch(0);
                pipe.train_batch(&images, &labels).expect("first batch");
                if pipe.stage_index() == 0 {
                    let _ = pipe.train_batch(&images, &labels);
                }
                // Stage 1 returns here, and its communicator is dropped.
            })
        })
        .collect();
    let mut pipe =
        Pipeline::new(&spec, cut, options(Schedule::GPipe, 2, 1), last).expect("pipeline");
    let (images, labels) = batch(0);
    pipe.train_batch(&images, &labels).expect("first batch");
    let started = Instant::now();
    let err = pipe
        .train_batch(&images, &labels)
        .expect_err("stage 1 is gone")
        .to_string();
    assert!(started.elapsed() < Duration::from_secs(8), "bounded wait");
    assert!(err.contains("from stage 1 (rank 1)"), "{err}");
    assert!(err.contains("micro-batch 0"), "{err}");
    let short = pipe
        .train_batch(&images[..12], &labels[..1])
        .expect_err("too small")
        .to_string();
    assert!(
        short.contains("cannot be cut into 2 micro-batches"),
        "{short}"
    );
    drop(pipe);
    for h in handles {
        h.join().expect("thread");
    }
}
