//! A small GPT (token and positional embeddings, two pre-LN transformer blocks, a head) cut
//! between its blocks: the pipeline cuts micro-batches by windows, computes the loss over
//! positions and so trains exactly what one process trains on the same batches (GPipe and
//! 1F1B, 1 and 4 micro-batches, 2 replicas of each stage); its evaluation over positions
//! equals the whole model's.

use flotilla_engine::{BatchRef, BurnEngine, Engine, ModelSpec, ModelState, StageCut};

use super::tests::{assert_matches, named, run_model};
use super::{Pipeline, PipelineOptions, Schedule};
use crate::testkit::{sgd, world};

const SEED: u64 = 11;
/// Windows per batch.
const BATCH: usize = 4;
/// Tokens per window (the context).
const T: usize = 8;
const VOCAB: usize = 16;
const BATCHES: usize = 12;
const LR: f64 = 0.05;
/// The cut: stage 0 is the embeddings and block 0, stage 1 block 1, the norm and the head.
const CUT: [usize; 1] = [3];

fn spec() -> ModelSpec {
    ModelSpec::from_yaml(
        "input: [8]
layers:
  - embedding: {vocab: 16, dim: 16}
  - pos_embedding: {max_len: 8}
  - transformer_block: {heads: 2, mlp: 2}
  - transformer_block: {heads: 2, mlp: 2}
  - layer_norm
  - linear: {out: 16}
",
        "gpt-pipeline-test",
    )
    .expect("spec")
}

fn options(schedule: Schedule, micro_batches: usize, data_parallel: usize) -> PipelineOptions {
    PipelineOptions {
        micro_batches,
        schedule,
        data_parallel,
        lr: LR,
        optimizer: sgd(LR, 0.9),
        device: "flex".into(),
        seed: SEED,
        clip_grad_norm: None,
        zero: 0,
        group_bytes: 0,
        prefetch: true,
        offload: None,
    }
}

/// The token at position `i` of a text: a fixed pseudo-random walk over the vocabulary.
fn token(i: usize) -> usize {
    (i * 7 + i / 3 * 5 + i * i % 11) % VOCAB
}

/// Batch `b`: `BATCH` windows of `T` token ids (as `f32`) and their next tokens.
fn batch(b: usize) -> (Vec<f32>, Vec<i64>) {
    let (mut ids, mut labels) = (Vec::new(), Vec::new());
    for w in 0..BATCH {
        let start = (b * BATCH + w) * 5;
        ids.extend((start..start + T).map(|i| token(i) as f32));
        labels.extend((start + 1..start + T + 1).map(|i| token(i) as i64));
    }
    (ids, labels)
}

/// The windows of `batch(b)` that replica `r` of `d` trains on.
fn shard(b: usize, r: usize, d: usize) -> (Vec<f32>, Vec<i64>) {
    let (ids, labels) = batch(b);
    let per = BATCH / d * T;
    (
        ids[r * per..(r + 1) * per].to_vec(),
        labels[r * per..(r + 1) * per].to_vec(),
    )
}

fn train_batch(pipe: &mut Pipeline, b: usize) -> Option<f32> {
    let (ids, labels) = shard(b, pipe.replica(), pipe.options().data_parallel);
    pipe.train_batch(&ids, &labels).expect("train_batch")
}

/// Parameters by name.
type Named = std::collections::HashMap<String, Vec<f32>>;

/// One process on the whole batches: the initial and final parameters, and each loss.
fn reference() -> (Named, Named, Vec<f32>) {
    let mut e = BurnEngine::new(&spec(), &sgd(LR, 0.9), "flex", SEED).expect("engine");
    assert_eq!(e.labels_per_sample(), T);
    let initial = named(&e);
    let mut losses = Vec::new();
    for b in 0..BATCHES {
        let (images, labels) = batch(b);
        let loss = e
            .forward_backward(BatchRef {
                images: &images,
                labels: &labels,
            })
            .expect("train");
        let mut g = vec![0.0; e.num_params()];
        e.read_grads(&mut g).expect("grads");
        e.apply_grads(&g, LR).expect("step");
        losses.push(loss);
    }
    (initial, named(&e), losses)
}

#[test]
fn a_gpt_cut_between_blocks_trains_what_one_process_trains() {
    let (initial, want, losses) = reference();
    for (name, w) in &want {
        // A key bias adds the same score to every key of a query, which the softmax
        // cancels: its gradient is zero and it never moves. Everything else trained.
        if !name.ends_with("key.bias") {
            assert_ne!(&initial[name], w, "{name} moved");
        }
    }
    let cases = [
        (Schedule::GPipe, 1, 1),
        (Schedule::GPipe, 4, 1),
        (Schedule::OneFOneB, 4, 1),
        (Schedule::OneFOneB, 2, 2),
    ];
    for (schedule, m, d) in cases {
        let what = format!("GPT at {CUT:?}, {schedule}, {m} micro-batches, {d} replica(s)");
        let ended = run_model(&spec(), &CUT, options(schedule, m, d), BATCHES, train_batch);
        assert_matches(&ended, &want, &what);
        // The last stage's loss of each batch is the batch's mean over its positions.
        let last = ended
            .iter()
            .find(|e| e.stage == 1 && e.replica == 0)
            .expect("last stage");
        assert_eq!(last.losses.len(), BATCHES, "{what}");
        if d == 1 {
            for (b, (got, want)) in last.losses.iter().zip(&losses).enumerate() {
                assert!(
                    (got - want).abs() <= 1e-5 * want.abs(),
                    "{what}: loss of batch {b}: {got} vs {want}"
                );
            }
        }
    }
}

#[test]
fn a_gpt_pipeline_evaluates_over_positions_as_the_whole_model() {
    let spec = spec();
    let cut = StageCut::at(&spec, &CUT).expect("cut");
    let whole = BurnEngine::new(&spec, &sgd(LR, 0.9), "flex", SEED).expect("engine");
    let (mut ids, mut labels) = (Vec::new(), Vec::new());
    for b in 0..3 {
        let (x, y) = batch(b);
        ids.extend(x);
        labels.extend(y);
    }
    let expected = whole.evaluate(&ids, &labels, 5).expect("evaluate");
    assert_eq!(expected.count, 3 * BATCH * T, "counted in positions");
    let handles: Vec<_> = world(2)
        .into_iter()
        .map(|g| {
            let (spec, cut) = (spec.clone(), cut.clone());
            let (ids, labels) = (ids.clone(), labels.clone());
            std::thread::spawn(move || {
                let mut pipe =
                    Pipeline::new(&spec, cut, options(Schedule::GPipe, 2, 1), g).expect("pipeline");
                // Chunks of 5 windows leave a short last chunk.
                let stats = pipe.evaluate(&ids, &labels, 5).expect("evaluate");
                // A batch whose labels are not whole windows is refused, naming the numbers.
                let err = pipe
                    .train_batch(&ids[..2 * T], &labels[..2 * T - 1])
                    .expect_err("not whole windows")
                    .to_string();
                (stats, err)
            })
        })
        .collect();
    for h in handles {
        let (got, err) = h.join().expect("rank");
        assert_eq!((got.count, got.correct), (expected.count, expected.correct));
        assert!(
            (got.loss() - expected.loss()).abs() < 1e-5,
            "{got:?} vs {expected:?}"
        );
        assert!(
            err.contains("15 labels are not whole samples of 8"),
            "{err}"
        );
    }
}
