//! The sharded pass (ZeRO-3: parameters gathered group by group, forward off the tape,
//! each group recomputed in backward) against the grouped backward of the same groups: the
//! same loss and gradients bit for bit, reported in the same order; the model holds no
//! parameter after it; batch norm's running statistics are those of one forward, read and
//! written while the parameters are released.

use std::ops::Range;

use crate::engine_tests::sgd;
use crate::error::Result;
use crate::{
    BatchRef, BurnEngine, Engine, EngineError, ModelSpec, ModelState, ShardSink, ShardedPass,
};

const SEED: u64 = 29;

/// A [`ShardedPass`] over a whole flat copy of the parameters, recording what it was asked.
pub(crate) struct Gatherer {
    pub(crate) whole: Vec<f32>,
    pub(crate) layout: crate::ParamLayout,
    pub(crate) gathered: Vec<Range<usize>>,
    pub(crate) grads: Vec<f32>,
    pub(crate) order: Vec<usize>,
}

impl Gatherer {
    /// Gathers from `whole` (in `layout`'s order); gradients into zeros of its length.
    pub(crate) fn new(whole: Vec<f32>, layout: &crate::ParamLayout) -> Self {
        Self {
            grads: vec![0.0; whole.len()],
            whole,
            layout: layout.clone(),
            gathered: Vec::new(),
            order: Vec::new(),
        }
    }
}

impl ShardedPass for Gatherer {
    fn gather(&mut self, params: Range<usize>, out: &mut [f32]) -> Result<()> {
        let first = &self.layout.params[params.start];
        let last = &self.layout.params[params.end - 1];
        out.copy_from_slice(&self.whole[first.offset..last.offset + last.len]);
        self.gathered.push(params);
        Ok(())
    }

    fn ready(&mut self, param: usize, grad: &[f32]) -> Result<()> {
        let p = &self.layout.params[param];
        self.grads[p.offset..p.offset + p.len].copy_from_slice(grad);
        self.order.push(param);
        Ok(())
    }
}

/// A deterministic batch of `n` samples for `spec` (token ids for a sequence model).
pub(crate) fn batch(spec: &ModelSpec, n: usize, salt: u32) -> (Vec<f32>, Vec<i64>) {
    let per = spec.input_shape().expect("input").numel();
    let lps = spec.labels_per_sample().expect("labels");
    let classes = spec.output_shape().expect("output").numel() / lps;
    let mut x = salt.wrapping_mul(2654435761).wrapping_add(777);
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        x
    };
    let images = match spec.token_vocab() {
        Some(v) => (0..n * per).map(|_| (next() % v as u32) as f32).collect(),
        None => (0..n * per)
            .map(|_| (next() % 1000) as f32 / 500.0 - 1.0)
            .collect(),
    };
    let labels = (0..n * lps)
        .map(|_| (next() % classes as u32) as i64)
        .collect();
    (images, labels)
}

pub(crate) fn engine(spec: &ModelSpec, max_bytes: usize) -> BurnEngine {
    let mut e = BurnEngine::new(spec, &sgd(0.05, 0.9), "flex", SEED).expect("engine");
    e.set_backward_group_bytes(max_bytes).expect("groups");
    e
}

pub(crate) fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Shipped specs, two with dropout (an MLP; a GPT with dropout after each block), which a
/// recomputed forward must draw again, and a GPT whose head is tied to its embedding.
pub(crate) fn specs() -> Vec<(String, ModelSpec)> {
    let mut specs: Vec<_> = ["mlp", "lenet5", "resmlp", "gpt-char"]
        .into_iter()
        .map(|name| {
            (
                name.to_string(),
                ModelSpec::builtin(name).expect("shipped spec"),
            )
        })
        .collect();
    for (name, yaml) in [
        (
            "mlp-dropout",
            "input: [8]\nlayers:\n  - linear: {out: 16}\n  - relu\n  - dropout: {p: 0.3}\n  \
             - linear: {out: 16}\n  - dropout: {p: 0.3}\n  - linear: {out: 3}\n",
        ),
        (
            "gpt-dropout",
            "input: [16]\nlayers:\n  - embedding: {vocab: 20, dim: 16}\n  \
             - pos_embedding: {max_len: 16}\n  - transformer_block: {heads: 2, mlp: 2}\n  \
             - dropout: {p: 0.2}\n  - transformer_block: {heads: 2, mlp: 2}\n  \
             - dropout: {p: 0.2}\n  - layer_norm\n  - linear: {out: 20}\n",
        ),
        (
            // Batch norm's running statistics: updated by the first forward only (the last
            // group's, which runs once, in backward, too).
            "mlp-bn",
            "input: [8]\nlayers:\n  - linear: {out: 16}\n  - batch_norm\n  - relu\n  \
             - linear: {out: 3}\n  - batch_norm\n",
        ),
        (
            // A head tied to the embedding: its group borrows the first group's table.
            "gpt-tied",
            "input: [16]\nlayers:\n  - embedding: {vocab: 20, dim: 16}\n  \
             - pos_embedding: {max_len: 16}\n  - transformer_block: {heads: 2, mlp: 2}\n  \
             - transformer_block: {heads: 2, mlp: 2}\n  - layer_norm\n  \
             - linear: {out: 20, tie_embedding: true}\n",
        ),
    ] {
        specs.push((
            name.to_string(),
            ModelSpec::from_yaml(yaml, name).expect(name),
        ));
    }
    specs
}

#[test]
fn a_sharded_pass_gives_the_grouped_pass_gradients_bit_for_bit() {
    sharded_pass_against_grouped(true);
}

/// Kept from forward to backward (`reshard_after_forward` false): the same loss, gradients
/// and order, each group gathered once, nothing recomputed.
#[test]
fn a_sharded_pass_that_keeps_its_groups_gives_the_grouped_pass_gradients_bit_for_bit() {
    sharded_pass_against_grouped(false);
}

/// The sharded pass, resharding after forward as `reshard` says, against the grouped pass
/// of every spec of [`specs`].
fn sharded_pass_against_grouped(reshard: bool) {
    for (name, spec) in specs() {
        let mut grouped = engine(&spec, 1);
        let mut sharded = engine(&spec, 1);
        sharded.set_reshard_after_forward(reshard).expect("reshard");
        // Dropout draws the same masks in the sharded pass, recomputed, as in the grouped one.
        grouped.set_dropout_seed(11);
        sharded.set_dropout_seed(11);
        let layout = grouped.layout().clone();
        let groups = grouped.backward_groups();
        assert!(groups.len() >= 3, "{name}: {groups:?}");
        let mut whole = vec![0.0; layout.total];
        grouped.read_params(&mut whole).expect("params");
        sharded.release_params().expect("release");
        let n = if spec.token_vocab().is_some() { 2 } else { 8 };
        let (images, labels) = batch(&spec, n, 3);
        let b = BatchRef {
            images: &images,
            labels: &labels,
        };
        let mut expected = vec![0.0; layout.total];
        let mut order = Vec::new();
        let loss = grouped
            .forward_backward_streaming(b, &mut |i, g| {
                let p = &layout.params[i];
                expected[p.offset..p.offset + p.len].copy_from_slice(g);
                order.push(i);
                Ok(())
            })
            .expect("grouped");
        let mut pass = Gatherer {
            whole: whole.clone(),
            layout: layout.clone(),
            gathered: Vec::new(),
            grads: vec![f32::NAN; layout.total],
            order: Vec::new(),
        };
        let got = sharded
            .forward_backward_sharded(b, &mut pass)
            .expect("sharded");
        assert_eq!(
            got.to_bits(),
            loss.to_bits(),
            "{name}: loss {got} vs {loss}"
        );
        assert_eq!(
            pass.order, order,
            "{name}: the order gradients are handed on"
        );
        assert!(
            bits(&pass.grads) == bits(&expected),
            "{name}: gradients differ first at {:?}",
            pass.grads
                .iter()
                .zip(&expected)
                .position(|(a, b)| a.to_bits() != b.to_bits())
        );
        same_statistics(&name, &grouped, &mut sharded);
        // Forward gathers every group but the last once, backward every group again; kept,
        // forward gathers every group, once.
        let mut want: Vec<Range<usize>> = groups.iter().rev().cloned().collect();
        want.pop();
        want.extend(groups.iter().cloned());
        if !reshard {
            want = groups.iter().rev().cloned().collect();
        }
        assert_eq!(pass.gathered, want, "{name}: what was gathered");
        // Nothing is held after the pass: a whole-model read is refused until the
        // parameters are written back.
        let mut out = vec![0.0; layout.total];
        let refused = sharded.read_params(&mut out).expect_err("released");
        assert!(
            matches!(refused, EngineError::ParamsSharded(_)),
            "{refused}"
        );
        sharded.write_params(&whole).expect("write back");
        sharded.read_params(&mut out).expect("whole again");
        assert_eq!(bits(&out), bits(&whole), "{name}: written back");
        sharded.write_params(&whole).expect("write back");
        let loss_whole = sharded.forward_backward(b).expect("whole pass");
        assert_eq!(
            loss_whole.to_bits(),
            loss.to_bits(),
            "{name}: trains whole again"
        );
    }
}

/// `sharded`'s running statistics (its parameters released) are `grouped`'s, those of one
/// forward; and they are written while released.
fn same_statistics(name: &str, grouped: &BurnEngine, sharded: &mut BurnEngine) {
    let buffers = |e: &BurnEngine| {
        let mut b = vec![0.0; e.buffer_layout().total];
        e.read_buffers(&mut b).expect("buffers");
        b
    };
    let moved = buffers(grouped);
    assert!(
        bits(&buffers(sharded)) == bits(&moved),
        "{name}: running statistics"
    );
    sharded
        .write_buffers(&moved)
        .expect("buffers written released");
}

#[test]
fn an_evaluation_through_the_shards_gives_the_whole_models_figures() {
    for (name, spec) in specs() {
        // Evaluation draws no dropout mask, seed or not.
        let mut e = engine(&spec, 1);
        e.set_dropout_seed(3);
        let layout = e.layout().clone();
        let groups = e.backward_groups();
        let mut whole = vec![0.0; layout.total];
        e.read_params(&mut whole).expect("params");
        let (images, labels) = batch(&spec, 3, 5);
        let expected = e.evaluate(&images, &labels, 3).expect("whole evaluation");
        e.release_params().expect("release");
        let mut pass = Gatherer {
            whole,
            layout: layout.clone(),
            gathered: Vec::new(),
            grads: Vec::new(),
            order: Vec::new(),
        };
        let got = e
            .evaluate_sharded(&images, &labels, &mut pass)
            .expect("sharded evaluation");
        assert_eq!(got, expected, "{name}: bit for bit");
        // Each group gathered once, in layer order; a rank without samples gathers too.
        let in_layer_order: Vec<Range<usize>> = groups.iter().rev().cloned().collect();
        assert_eq!(pass.gathered, in_layer_order, "{name}");
        let none = e.evaluate_sharded(&[], &[], &mut pass).expect("no samples");
        assert_eq!(none.count, 0, "{name}");
        assert_eq!(pass.gathered.len(), 2 * groups.len(), "{name}");
    }
}

/// A [`ShardSink`] keeping every value it is handed.
#[derive(Default)]
pub(crate) struct Everything {
    pub(crate) groups: Vec<Range<usize>>,
    pub(crate) values: Vec<f32>,
    pub(crate) params: Vec<usize>,
}

impl ShardSink for Everything {
    fn plan(&mut self, layout: &crate::ParamLayout, groups: &[Range<usize>]) -> Result<()> {
        assert!(self.values.is_empty(), "the plan comes first");
        self.groups = groups.to_vec();
        self.values.reserve(layout.total);
        Ok(())
    }

    fn values(&mut self, param: usize, values: &[f32]) -> Result<()> {
        self.params.push(param);
        self.values.extend_from_slice(values);
        Ok(())
    }
}

#[test]
fn a_released_engine_draws_the_whole_engines_values_one_layer_at_a_time() {
    for name in ["mlp", "lenet5", "gpt-char"] {
        let spec = ModelSpec::builtin(name).expect("shipped spec");
        let whole = engine(&spec, 1);
        let mut expected = vec![0.0; whole.num_params()];
        whole.read_params(&mut expected).expect("params");
        let mut sink = Everything::default();
        let released =
            BurnEngine::new_released(&spec, &sgd(0.05, 0.9), ("flex", SEED), 1, &mut sink)
                .expect("released engine");
        assert_eq!(
            bits(&sink.values),
            bits(&expected),
            "{name}: the same values"
        );
        let count = whole.layout().params.len();
        assert_eq!(
            sink.params,
            (0..count).collect::<Vec<_>>(),
            "{name}: flat order"
        );
        assert_eq!(sink.groups, whole.backward_groups(), "{name}: the groups");
        assert_eq!(released.layout(), whole.layout(), "{name}: the layout");
        assert_eq!(
            released.backward_groups(),
            whole.backward_groups(),
            "{name}"
        );
        let mut out = vec![0.0; count];
        assert!(
            released.read_params(&mut out).is_err(),
            "{name}: nothing held"
        );
    }
}
