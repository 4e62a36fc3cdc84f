//! Sequence models through the public API: causality of attention (numbers compared), the
//! errors of a bad spec or bad token ids (each naming the numbers), evaluation per position,
//! a pipeline cut between transformer blocks, and gpt-char learning a tiny repeated text.

mod common;

use common::{engine_of, grads, token_batch};
use flotilla_engine::StageEngine;
use flotilla_engine::{
    BatchRef, BurnEngine, DecayParams, Engine, ModelSpec, ModelState, OptimizerSpec, Shape, Stage,
    StageCut,
};

/// Embeddings, an attention layer and a transformer block: every layer that mixes positions.
const SMALL_GPT: &str = "name: small-gpt
input: [6]
layers:
  - embedding: {vocab: 11, dim: 8}
  - pos_embedding: {max_len: 8}
  - attention: {heads: 2}
  - transformer_block: {heads: 4, mlp: 2}
  - transformer_block: {heads: 2}
  - layer_norm
  - linear: {out: 11}
";

fn sgd() -> OptimizerSpec {
    common::plain_sgd(0.1)
}

/// The whole model's outputs on `n` samples of token ids, as one pipeline stage computes them
/// (evaluation: no gradients).
fn outputs(spec: &ModelSpec, seed: u64, ids: &[f32], n: usize) -> Vec<f32> {
    let cut = StageCut::at(spec, &[]).expect("cut");
    let stage = Stage::new(spec, &cut, 0, &sgd(), "flex", seed).expect("stage");
    let mut out = stage.forward_eval(n, &[ids]).expect("forward");
    out.remove(0)
}

fn spec_error(layers: &str, input: &str) -> String {
    let text = format!("input: {input}\nlayers:\n{layers}");
    ModelSpec::from_yaml(&text, "t")
        .expect_err("refused")
        .to_string()
}

#[test]
fn a_token_changes_no_output_before_its_position() {
    let spec = ModelSpec::from_yaml(SMALL_GPT, "t").expect("spec");
    assert_eq!(
        spec.output_shape().expect("out"),
        Shape::Seq { t: 6, d: 11 }
    );
    let (t, v) = (6, 11);
    let (ids, _) = token_batch(2, t, v, 3);
    let base = outputs(&spec, 41, &ids, 2);
    assert_eq!(base.len(), 2 * t * v);
    for j in 0..t {
        let mut changed = ids.clone();
        // Sample 1's token j becomes another id.
        changed[t + j] = ((ids[t + j] as usize + 5) % v) as f32;
        let out = outputs(&spec, 41, &changed, 2);
        for pos in 0..t {
            let row = |o: &[f32]| o[(t + pos) * v..(t + pos + 1) * v].to_vec();
            let diff = row(&out)
                .iter()
                .zip(row(&base))
                .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
            if pos < j {
                assert_eq!(diff, 0.0, "token {j} changed position {pos} by {diff}");
            } else {
                assert!(diff > 1e-4, "token {j} left position {pos} as it was");
            }
        }
        // Sample 0 did not change at all.
        assert_eq!(
            out[..t * v],
            base[..t * v],
            "token {j} changed another sample"
        );
    }
}

#[test]
fn bad_sequence_specs_are_refused_naming_the_numbers() {
    let e = spec_error(
        "  - embedding: {vocab: 5, dim: 10}\n  - attention: {heads: 4}\n  - linear: {out: 5}\n",
        "[3]",
    );
    assert!(
        e.contains("layer 1 (attention)") && e.contains("4 heads do not divide d_model 10"),
        "{e}"
    );
    let e = spec_error(
        "  - embedding: {vocab: 5, dim: 12}\n  - transformer_block: {heads: 5}\n  - linear: {out: 5}\n",
        "[3]",
    );
    assert!(e.contains("5 heads do not divide d_model 12"), "{e}");
    let e = spec_error(
        "  - embedding: {vocab: 5, dim: 8}\n  - pos_embedding: {max_len: 16}\n  - linear: {out: 5}\n",
        "[32]",
    );
    assert!(
        e.contains("layer 1 (pos_embedding)")
            && e.contains("context 32 is larger than the positional table (max_len 16)"),
        "{e}"
    );
    let e = spec_error(
        "  - linear: {out: 4}\n  - embedding: {vocab: 5, dim: 8}\n  - linear: {out: 5}\n",
        "[3]",
    );
    assert!(
        e.contains("layer 1 (embedding)") && e.contains("must be the first layer"),
        "{e}"
    );
    let e = spec_error(
        "  - embedding: {vocab: 5, dim: 8}\n  - flatten\n  - linear: {out: 5}\n",
        "[1, 4, 4]",
    );
    assert!(
        e.contains("layer 0 (embedding)")
            && e.contains("takes token ids")
            && e.contains("[1, 4, 4]"),
        "{e}"
    );
    let e = spec_error("  - attention: {heads: 1}\n  - linear: {out: 5}\n", "[8]");
    assert!(
        e.contains("layer 0 (attention)") && e.contains("needs a sequence input"),
        "{e}"
    );
    let e = spec_error(
        "  - embedding: {vocab: 5, dim: 8}\n  - batch_norm\n  - linear: {out: 5}\n",
        "[3]",
    );
    assert!(
        e.contains("layer 1 (batch_norm)") && e.contains("layer_norm"),
        "{e}"
    );
    let e = spec_error(
        "  - embedding: {vocab: 16777217, dim: 1}\n  - linear: {out: 5}\n",
        "[3]",
    );
    assert!(e.contains("vocab 16777217") && e.contains("2^24"), "{e}");
}

#[test]
fn a_token_id_outside_the_vocabulary_is_an_error_not_a_panic() {
    let mut e = engine_of(SMALL_GPT, 42, 0.1);
    let (mut ids, labels) = token_batch(2, 6, 11, 4);
    for bad in [11.0, 300.0, -1.0, 2.5, f32::NAN] {
        ids[7] = bad;
        let b = BatchRef {
            images: &ids,
            labels: &labels,
        };
        let err = e.forward_backward(b).expect_err("refused").to_string();
        assert!(
            err.contains(&format!("token id {bad} at input value 7")) && err.contains("0..11"),
            "{err}"
        );
        let err = e
            .evaluate(&ids, &labels, 1)
            .expect_err("refused")
            .to_string();
        assert!(err.contains("0..11"), "{err}");
    }
    let spec = ModelSpec::from_yaml(SMALL_GPT, "t").expect("spec");
    let cut = StageCut::at(&spec, &[]).expect("cut");
    let mut stage = Stage::new(&spec, &cut, 0, &sgd(), "flex", 1).expect("stage");
    let err = stage
        .forward(0, 2, &[&ids])
        .expect_err("refused")
        .to_string();
    assert!(err.contains("0..11"), "{err}");
    // One label per position: 2 samples need 12 labels.
    let b = BatchRef {
        images: &ids[..12],
        labels: &labels[..5],
    };
    let err = e.forward_backward(b).expect_err("refused").to_string();
    assert!(
        err.contains("5 labels") && err.contains("6 labels"),
        "{err}"
    );
}

#[test]
fn evaluation_counts_positions_and_agrees_with_the_training_loss() {
    let mut e = engine_of(SMALL_GPT, 43, 0.1);
    assert_eq!(e.labels_per_sample(), 6);
    let (ids, labels) = token_batch(5, 6, 11, 5);
    let loss = e
        .forward_backward(BatchRef {
            images: &ids,
            labels: &labels,
        })
        .expect("forward");
    let stats = e.evaluate(&ids, &labels, 2).expect("evaluate");
    assert_eq!(stats.count, 5 * 6);
    assert!(stats.correct <= stats.count);
    assert!(
        (stats.loss() - loss as f64).abs() < 1e-5,
        "{} vs {loss}",
        stats.loss()
    );
}

#[test]
fn a_pipeline_cut_between_transformer_blocks_equals_the_whole_model() {
    let spec = ModelSpec::from_yaml(SMALL_GPT, "t").expect("spec");
    let cut = StageCut::at(&spec, &[4]).expect("cut");
    assert_eq!(cut.crossings[0].shape, Shape::Seq { t: 6, d: 8 });
    assert_eq!((cut.output, cut.classes), (Shape::Seq { t: 6, d: 11 }, 66));
    let (ids, labels) = token_batch(3, 6, 11, 6);
    let mut whole = BurnEngine::new(&spec, &sgd(), "flex", 44).expect("engine");
    let loss = whole
        .forward_backward(BatchRef {
            images: &ids,
            labels: &labels,
        })
        .expect("whole");
    let mut s0 = Stage::new(&spec, &cut, 0, &sgd(), "flex", 44).expect("stage 0");
    let mut s1 = Stage::new(&spec, &cut, 1, &sgd(), "flex", 44).expect("stage 1");
    let mid = s0.forward(0, 3, &[&ids]).expect("forward 0").remove(0);
    assert_eq!(mid.len(), 3 * 6 * 8);
    s1.forward(0, 3, &[&mid]).expect("forward 1");
    let (staged, grad_mid) = s1.backward_loss(0, &labels, 1.0).expect("loss");
    s0.backward(0, grad_mid).expect("backward 0");
    assert!((staged - loss).abs() < 1e-6, "{staged} vs {loss}");
    let g = grads(&whole);
    let staged_grads: Vec<f32> = s0
        .grads_mut()
        .iter()
        .chain(s1.grads_mut().iter())
        .copied()
        .collect();
    assert_eq!(staged_grads.len(), g.len());
    for (i, (a, b)) in staged_grads.iter().zip(&g).enumerate() {
        assert!(
            (a - b).abs() <= 1e-5 * b.abs().max(1e-2),
            "gradient {i}: {a} vs {b}"
        );
    }
}

/// `n` windows of 64 bytes of a repeated text and, as labels, the byte after each position.
fn text_batch(text: &[u8], n: usize, start: usize) -> (Vec<f32>, Vec<i64>) {
    let at = |i: usize| text[i % text.len()];
    let mut ids = Vec::with_capacity(n * 64);
    let mut labels = Vec::with_capacity(n * 64);
    for s in 0..n {
        let first = start + 7 * s;
        ids.extend((first..first + 64).map(|i| at(i) as f32));
        labels.extend((first + 1..first + 65).map(|i| at(i) as i64));
    }
    (ids, labels)
}

#[test]
fn gpt_char_learns_a_tiny_repeated_text() {
    let spec = ModelSpec::builtin("gpt-char").expect("gpt-char");
    let adam = OptimizerSpec::Adam {
        lr: 3e-3,
        beta1: 0.9,
        beta2: 0.999,
        epsilon: 1e-8,
        weight_decay: 0.0,
        decay_params: DecayParams::All,
    };
    let mut e = BurnEngine::new(&spec, &adam, "flex", 45).expect("engine");
    println!("gpt-char: {} parameters", e.num_params());
    assert_eq!(e.num_params(), 867_328);
    assert_eq!(e.labels_per_sample(), 64);
    assert!(e.buffer_layout().params.is_empty());
    let text = b"the quick brown fox jumps over the lazy dog. ";
    let mut losses = Vec::new();
    let mut g = vec![0.0; e.num_params()];
    for step in 0..30 {
        let (ids, labels) = text_batch(text, 8, step * 13);
        let loss = e
            .forward_backward(BatchRef {
                images: &ids,
                labels: &labels,
            })
            .expect("step");
        e.read_grads(&mut g).expect("grads");
        e.apply_grads(&g, 3e-3).expect("apply");
        losses.push(loss);
    }
    println!("gpt-char losses: {losses:?}");
    let (first, last) = (losses[0], losses[29]);
    assert!(
        (first - (256f32).ln()).abs() < 1.0,
        "an untrained model's loss {first} is near ln 256"
    );
    assert!(
        last < first / 2.0,
        "after 30 Adam steps the loss {last} is not below half the initial {first}"
    );
}

#[test]
fn a_grouped_backward_of_a_sequence_model_gives_the_same_gradients() {
    let (ids, labels) = token_batch(3, 6, 11, 8);
    let b = BatchRef {
        images: &ids,
        labels: &labels,
    };
    let mut one = engine_of(SMALL_GPT, 46, 0.1);
    let loss = one.forward_backward(b).expect("one pass");
    let mut grouped = engine_of(SMALL_GPT, 46, 0.1);
    // Small groups: a cut between every two layers with parameters.
    grouped.set_backward_group_bytes(4).expect("groups");
    assert!(
        grouped.backward_plan().len() >= 4,
        "{:?}",
        grouped.backward_plan()
    );
    let mut streamed = vec![0.0; grouped.num_params()];
    let layout = grouped.layout().clone();
    let grouped_loss = grouped
        .forward_backward_streaming(b, &mut |i, g| {
            let p = &layout.params[i];
            streamed[p.offset..p.offset + p.len].copy_from_slice(g);
            Ok(())
        })
        .expect("grouped");
    assert_eq!(grouped_loss, loss);
    assert_eq!(streamed, grads(&one), "bit for bit");
}
