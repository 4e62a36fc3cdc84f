//! A linear layer tied to the token embedding (`tie_embedding`): the table's gradient is the
//! sum of its two uses (the untied model's embedding and head gradients, the head's
//! transposed, with the head's weight set to the table), one backward pass and the grouped
//! one give it bit for bit (recomputed and ZeRO-3's too: `sharded_tests.rs`), and the step
//! keeps the model tied (one table, no head weight).

use crate::engine_tests::sgd;
use crate::{BatchRef, BurnEngine, Engine, ModelSpec, ModelState};

const SEED: u64 = 5;
const VOCAB: usize = 32;
const DIM: usize = 16;
const T: usize = 8;

fn spec(tied: bool) -> ModelSpec {
    let head = match tied {
        true => format!("linear: {{out: {VOCAB}, tie_embedding: true}}"),
        false => format!("linear: {{out: {VOCAB}}}"),
    };
    let text = format!(
        "name: tiny-gpt\ninput: [{T}]\nlayers:\n  - embedding: {{vocab: {VOCAB}, dim: {DIM}}}\n  \
         - pos_embedding: {{max_len: {T}}}\n  - transformer_block: {{heads: 2, mlp: 2}}\n  \
         - transformer_block: {{heads: 2, mlp: 2}}\n  - layer_norm\n  - {head}\n"
    );
    ModelSpec::from_yaml(&text, "tiny-gpt").expect("spec")
}

/// Token windows and their next tokens, deterministic.
fn batch(n: usize) -> (Vec<f32>, Vec<i64>) {
    let ids: Vec<i64> = (0..n * T).map(|i| ((i * 7 + 3) % VOCAB) as i64).collect();
    let labels = ids.iter().map(|&x| (x * 5 + 1) % VOCAB as i64).collect();
    (ids.iter().map(|&x| x as f32).collect(), labels)
}

fn values(e: &dyn ModelState) -> Vec<f32> {
    let mut out = vec![0.0; e.num_params()];
    e.read_params(&mut out).expect("params");
    out
}

fn grads(e: &BurnEngine) -> Vec<f32> {
    let mut g = vec![0.0; e.num_params()];
    e.read_grads(&mut g).expect("grads");
    g
}

/// The values of parameter `name` in `flat` (of `e`'s layout).
fn slice<'a>(e: &BurnEngine, flat: &'a [f32], name: &str) -> &'a [f32] {
    let p = e
        .layout()
        .params
        .iter()
        .find(|p| p.name == name)
        .expect(name);
    &flat[p.offset..p.offset + p.len]
}

fn close(what: &str, a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let scale = b.iter().map(|x| x.abs()).fold(0.0f32, f32::max).max(1e-6);
    let worst = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max);
    assert!(
        worst <= 1e-4 * scale,
        "{what}: off by {worst} (scale {scale})"
    );
}

#[test]
fn the_tables_gradient_is_the_sum_of_the_embeddings_and_the_heads() {
    let build = |t: bool| BurnEngine::new(&spec(t), &sgd(0.1, 0.0), "flex", SEED).expect("engine");
    let (mut tied, mut untied) = (build(true), build(false));
    assert_eq!(untied.num_params() - tied.num_params(), VOCAB * DIM);
    // The untied model takes the tied one's values, its head's weight the table transposed.
    let shared = values(&tied);
    let table = slice(&tied, &shared, "layers.0.weight").to_vec();
    let mut whole = Vec::with_capacity(untied.num_params());
    for p in &untied.layout().params.clone() {
        match p.name.as_str() {
            // burn's linear weight is [in, out] = [dim, vocab]: the table's transpose.
            "layers.5.weight" => {
                whole.extend((0..DIM * VOCAB).map(|k| table[(k % VOCAB) * DIM + k / VOCAB]))
            }
            name => whole.extend_from_slice(slice(&tied, &shared, name)),
        }
    }
    untied.write_params(&whole).expect("write");
    let (ids, labels) = batch(4);
    let b = BatchRef {
        images: &ids,
        labels: &labels,
    };
    let (lt, lu) = (
        tied.forward_backward(b).expect("tied"),
        untied.forward_backward(b).expect("untied"),
    );
    assert!((lt - lu).abs() <= 1e-5 * lu.abs(), "losses {lt} vs {lu}");
    let (gt, gu) = (grads(&tied), grads(&untied));
    let head = slice(&untied, &gu, "layers.5.weight");
    let sum: Vec<f32> = slice(&untied, &gu, "layers.0.weight")
        .iter()
        .enumerate()
        .map(|(k, g)| g + head[(k % DIM) * VOCAB + k / DIM])
        .collect();
    close(
        "the table's gradient",
        slice(&tied, &gt, "layers.0.weight"),
        &sum,
    );
    for p in &tied.layout().params.clone() {
        if p.name != "layers.0.weight" {
            close(
                &p.name,
                slice(&tied, &gt, &p.name),
                slice(&untied, &gu, &p.name),
            );
        }
    }
}

#[test]
fn grouped_backward_gives_one_passs_tied_gradient_bit_for_bit() {
    let (ids, labels) = batch(4);
    let b = BatchRef {
        images: &ids,
        labels: &labels,
    };
    let mut one = BurnEngine::new(&spec(true), &sgd(0.1, 0.0), "flex", SEED).expect("engine");
    let loss = one.forward_backward(b).expect("one pass");
    let want = grads(&one);
    let mut grouped = BurnEngine::new(&spec(true), &sgd(0.1, 0.0), "flex", SEED).expect("engine");
    grouped.set_backward_group_bytes(4096).expect("groups");
    assert!(
        grouped.backward_groups().len() > 2,
        "{:?}",
        grouped.backward_groups()
    );
    let layout = grouped.layout().clone();
    let mut streamed = vec![f32::NAN; layout.total];
    let got = grouped
        .forward_backward_streaming(b, &mut |i, g| {
            let p = &layout.params[i];
            streamed[p.offset..p.offset + p.len].copy_from_slice(g);
            Ok(())
        })
        .expect("grouped");
    assert_eq!(got.to_bits(), loss.to_bits());
    let differ = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .filter(|(x, y)| x.to_bits() != y.to_bits())
            .count()
    };
    assert_eq!(differ(&streamed, &want), 0, "handed while streaming");
    assert_eq!(differ(&grads(&grouped), &want), 0, "read again");
    // A step moves the one table, which both layers read.
    one.apply_grads(&want, 0.1).expect("step");
    grouped.apply_grads(&streamed, 0.1).expect("step");
    assert_eq!(differ(&values(&one), &values(&grouped)), 0, "stepped");
}

/// Recomputation and ZeRO-3 take a tied model (`sharded_tests.rs`, `recompute_tests.rs`:
/// its gradients bit for bit); a pipeline's stages would part the table from the head.
#[test]
fn a_pipeline_refuses_a_tied_model_by_name() {
    let s = spec(true);
    let cut = crate::pipeline::cut::StageCut::at(&s, &[3]).expect("cut");
    let stage = crate::Stage::new(&s, &cut, 1, &sgd(0.1, 0.0), "flex", SEED);
    let why = stage.err().expect("refused").to_string();
    assert!(why.contains("tie_embedding"), "{why}");
}

#[test]
fn the_spec_counts_one_table_and_refuses_a_head_that_does_not_fit_it() {
    let e = BurnEngine::new(&spec(true), &sgd(0.1, 0.0), "flex", SEED).expect("engine");
    let counted = spec(true).param_count().expect("count");
    assert_eq!(counted, e.num_params() as u64);
    assert_eq!(spec(true).tied_table_values(), (VOCAB * DIM) as u64);
    assert_eq!(spec(false).tied_table_values(), 0);
    let refused = |text: &str| {
        let spec = ModelSpec::from_yaml(text, "bad").and_then(|s| s.infer_io());
        spec.expect_err("refused").to_string()
    };
    let wider = format!(
        "input: [{T}]\nlayers:\n  - embedding: {{vocab: {VOCAB}, dim: {DIM}}}\n  \
         - linear: {{out: {}, tie_embedding: true}}\n",
        VOCAB + 1
    );
    let why = refused(&wider);
    assert!(why.contains("vocab is 32"), "{why}");
    let flat =
        "input: [16]\nlayers:\n  - linear: {out: 16}\n  - linear: {out: 4, tie_embedding: true}\n";
    let why = refused(flat);
    assert!(why.contains("not an embedding"), "{why}");
}

/// Tied, both embedding tables are drawn N(0, 0.02²) (GPT-2's), not burn's N(0, 1), whose
/// table would give the tied head logits of standard deviation √dim.
#[test]
fn a_tied_models_tables_are_drawn_small() {
    let std = |tied: bool, name: &str| {
        let e = BurnEngine::new(&spec(tied), &sgd(0.1, 0.0), "flex", SEED).expect("engine");
        let all = values(&e);
        let v = slice(&e, &all, name);
        let mean = v.iter().sum::<f32>() / v.len() as f32;
        (v.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / v.len() as f32).sqrt()
    };
    for name in ["layers.0.weight", "layers.1.weight"] {
        let (tied, untied) = (std(true, name), std(false, name));
        assert!((0.015..0.025).contains(&tied), "{name}: tied std {tied}");
        assert!((0.8..1.2).contains(&untied), "{name}: untied std {untied}");
    }
}

/// An untied spec reads back without the key, so its text and config hash are what they were
/// before it existed; a tied one keeps it.
#[test]
fn only_a_tied_spec_writes_the_key() {
    assert!(!spec(false).to_yaml().contains("tie_embedding"));
    assert!(spec(true).to_yaml().contains("tie_embedding: true"));
}

/// A program's own module tied in its own forward (`x · tableᵀ`), as a burn user writes it:
/// `x.matmul(self.table.weight.val().transpose())`.
#[derive(burn::module::Module, Debug)]
struct TiedLm {
    table: burn::nn::Embedding,
}

/// The context of [`TiedLm`]'s windows.
const CONTEXT: usize = 4;

impl crate::TrainModule for TiedLm {
    fn loss(
        &self,
        batch: BatchRef<'_>,
        device: &burn::prelude::Device,
    ) -> burn::prelude::Tensor<1> {
        let logits = self.logits(batch.images, batch.labels.len() / CONTEXT, device);
        let labels = crate::engine::labels_tensor(batch.labels, device);
        burn::nn::loss::CrossEntropyLossConfig::new()
            .init(device)
            .forward(logits, labels)
    }

    fn logits(
        &self,
        inputs: &[f32],
        n: usize,
        device: &burn::prelude::Device,
    ) -> burn::prelude::Tensor<2> {
        use burn::prelude::*;
        let data = burn::tensor::TensorData::new(inputs.to_vec(), [n, CONTEXT]);
        let x = self
            .table
            .forward(Tensor::<2>::from_data(data, device).int());
        let [rows, dim] = [n * CONTEXT, self.table.weight.dims()[1]];
        x.reshape([rows, dim])
            .matmul(self.table.weight.val().transpose())
    }
}

/// A program's module tied in its own forward trains the spec's tied model's bits (burn
/// differentiates the module in one pass, which sums the table's two gradients), step after
/// step.
#[test]
fn a_programs_module_tied_in_its_own_forward_trains_the_tied_specs_bits() {
    use burn::nn::EmbeddingConfig;
    let text = format!(
        "input: [{CONTEXT}]\nlayers:\n  - embedding: {{vocab: {VOCAB}, dim: {DIM}}}\n  \
         - linear: {{out: {VOCAB}, bias: false, tie_embedding: true}}\n"
    );
    let spec = ModelSpec::from_yaml(&text, "tiny-tied").expect("spec");
    let opt = sgd(0.5, 0.9);
    let mut by_spec = BurnEngine::new(&spec, &opt, "flex", SEED).expect("spec engine");
    let device = burn::prelude::Device::flex();
    let module = TiedLm {
        table: EmbeddingConfig::new(VOCAB, DIM).init(&device),
    };
    let mut by_user = crate::ModuleEngine::new(module, &opt, "flex").expect("module engine");
    assert_eq!(by_user.num_params(), by_spec.num_params());
    by_user
        .write_params(&values(&by_spec))
        .expect("the spec's start");
    let differ = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .filter(|(x, y)| x.to_bits() != y.to_bits())
            .count()
    };
    let start = values(&by_spec);
    for step in 0..4 {
        let ids: Vec<f32> = (0..8 * CONTEXT)
            .map(|i| ((i * 5 + step * 3) % VOCAB) as f32)
            .collect();
        let labels: Vec<i64> = (0..8 * CONTEXT)
            .map(|i| ((i * 3 + step) % VOCAB) as i64)
            .collect();
        let b = BatchRef {
            images: &ids,
            labels: &labels,
        };
        let (s, u) = (
            by_spec.forward_backward(b).expect("spec"),
            by_user.forward_backward(b).expect("user"),
        );
        assert_eq!(s.to_bits(), u.to_bits(), "loss of step {step}");
        let mut g = vec![0.0; by_user.num_params()];
        by_user.read_grads(&mut g).expect("grads");
        let mut gs = vec![0.0; by_spec.num_params()];
        by_spec.read_grads(&mut gs).expect("grads");
        assert_eq!(differ(&g, &gs), 0, "gradients of step {step}");
        by_spec.apply_grads(&gs, 0.5).expect("spec step");
        by_user.apply_grads(&g, 0.5).expect("user step");
        let mut now = vec![0.0; by_user.num_params()];
        by_user.read_params(&mut now).expect("params");
        assert_eq!(
            differ(&values(&by_spec), &now),
            0,
            "parameters after step {step}"
        );
    }
    assert!(differ(&values(&by_spec), &start) > 0, "trained");
}
