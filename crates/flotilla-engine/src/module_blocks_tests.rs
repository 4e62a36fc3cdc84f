//! ZeRO-3 of a user's module run as its blocks ([`ModuleEngine::released`]): drawn one tensor
//! at a time with the whole module's values; the sharded pass (blocks gathered one at a time,
//! forward off the tape, recomputed in backward, a skip tensor between blocks) gives the whole
//! module's loss and gradients bit for bit; dropout draws the same masks in the recomputed
//! forward as in the first; evaluation gives the whole module's figures; blocks that are not
//! the module's are refused; batch norm's running statistics are carried from the module
//! into its blocks and back, those of one forward.

use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Dropout, DropoutConfig, Linear, LinearConfig, Relu};
use burn::prelude::*;
use burn::tensor::TensorData;

use crate::engine::labels_tensor;
use crate::engine_tests::sgd;
use crate::params;
use crate::pipeline::module_stage::StageBuilder;
use crate::rng::mask_seed;
use crate::rng::under_rng_lock;
use crate::sharded_tests::{Everything, Gatherer, bits};
use crate::{
    BatchRef, Engine, EngineError, ModelState, ModuleEngine, NamedTensors, Shape, StageModule,
    TrainModule,
};

const SEED: u64 = 41;
const FEATURES: usize = 20;

/// Block 0: the inputs to a hidden state `h`.
#[derive(Module, Debug)]
struct In {
    fc: Linear,
}

/// Block 1: `h` to `g`, through dropout.
#[derive(Module, Debug)]
struct Mid {
    fc: Linear,
    drop: Dropout,
}

/// Block 2: `g` and `h` (a skip tensor from block 0) to the logits.
#[derive(Module, Debug)]
struct Out {
    fc: Linear,
}

/// The whole module: the three blocks' fields in their order.
#[derive(Module, Debug)]
struct Net {
    a: In,
    b: Mid,
    c: Out,
}

impl In {
    fn new(device: &Device) -> Self {
        In {
            fc: LinearConfig::new(FEATURES, 16).init(device),
        }
    }
    fn run(&self, x: Tensor<2>) -> Tensor<2> {
        Relu::new().forward(self.fc.forward(x))
    }
}

impl Mid {
    fn new(device: &Device, p: f64) -> Self {
        Mid {
            fc: LinearConfig::new(16, 16).init(device),
            drop: DropoutConfig::new(p).init(),
        }
    }
    fn run(&self, h: Tensor<2>) -> Tensor<2> {
        Relu::new().forward(self.fc.forward(self.drop.forward(h)))
    }
}

impl Out {
    fn new(device: &Device) -> Self {
        Out {
            fc: LinearConfig::new(16, 5).init(device),
        }
    }
    fn run(&self, g: Tensor<2>, h: Tensor<2>) -> Tensor<2> {
        self.fc.forward(g + h)
    }
}

impl StageModule for In {
    fn inputs(&self) -> Vec<String> {
        vec!["x".into()]
    }
    fn outputs(&self) -> Vec<String> {
        vec!["h".into()]
    }
    fn forward(&self, mut t: NamedTensors) -> crate::Result<NamedTensors> {
        Ok(NamedTensors::new().with("h", self.run(t.take::<2>("x")?)))
    }
}

impl StageModule for Mid {
    fn inputs(&self) -> Vec<String> {
        vec!["h".into()]
    }
    fn outputs(&self) -> Vec<String> {
        vec!["g".into()]
    }
    fn forward(&self, mut t: NamedTensors) -> crate::Result<NamedTensors> {
        Ok(NamedTensors::new().with("g", self.run(t.take::<2>("h")?)))
    }
}

impl StageModule for Out {
    fn inputs(&self) -> Vec<String> {
        vec!["g".into(), "h".into()]
    }
    fn outputs(&self) -> Vec<String> {
        vec!["logits".into()]
    }
    fn forward(&self, mut t: NamedTensors) -> crate::Result<NamedTensors> {
        let (g, h) = (t.take::<2>("g")?, t.take::<2>("h")?);
        Ok(NamedTensors::new().with("logits", self.run(g, h)))
    }
}

impl Net {
    fn new(device: &Device, p: f64) -> Self {
        Net {
            a: In::new(device),
            b: Mid::new(device, p),
            c: Out::new(device),
        }
    }
}

/// The cross-entropy of `model`'s logits on `batch`: both test modules' loss.
fn loss_of(model: &impl TrainModule, batch: BatchRef<'_>, device: &Device) -> Tensor<1> {
    let logits = model.logits(batch.images, batch.labels.len(), device);
    let loss = CrossEntropyLossConfig::new().init(device);
    loss.forward(logits, labels_tensor(batch.labels, device))
}

impl TrainModule for Net {
    fn loss(&self, batch: BatchRef<'_>, device: &Device) -> Tensor<1> {
        loss_of(self, batch, device)
    }

    fn logits(&self, inputs: &[f32], n: usize, device: &Device) -> Tensor<2> {
        let x = Tensor::<2>::from_data(TensorData::new(inputs.to_vec(), [n, FEATURES]), device);
        let h = self.a.run(x);
        self.c.run(self.b.run(h.clone()), h)
    }
}

/// The three blocks, `p` the dropout's probability.
fn blocks(p: f64) -> Vec<StageBuilder> {
    vec![
        Box::new(|d: &Device| Box::new(In::new(d)) as Box<dyn crate::AnyStageModule>),
        Box::new(move |d: &Device| Box::new(Mid::new(d, p)) as Box<dyn crate::AnyStageModule>),
        Box::new(|d: &Device| Box::new(Out::new(d)) as Box<dyn crate::AnyStageModule>),
    ]
}

/// A deterministic batch of `n` samples.
fn batch(n: usize) -> (Vec<f32>, Vec<i64>) {
    let images = (0..n * FEATURES)
        .map(|i| ((i * 37 % 101) as f32) / 50.0 - 1.0)
        .collect();
    let labels = (0..n).map(|i| (i * 3 % 5) as i64).collect();
    (images, labels)
}

fn whole(p: f64) -> ModuleEngine<Net> {
    ModuleEngine::seeded(|d| Net::new(d, p), SEED, &sgd(0.05, 0.9), "flex").expect("whole")
}

fn released(p: f64, sink: &mut Everything) -> ModuleEngine<Net> {
    let blocks = blocks(p);
    let input = (blocks.as_slice(), Shape::Flat(FEATURES));
    ModuleEngine::released(
        |d| Net::new(d, p),
        input,
        &sgd(0.05, 0.9),
        ("flex", SEED),
        sink,
    )
    .expect("released")
}

fn params_of(e: &dyn Engine) -> Vec<f32> {
    let mut v = vec![0.0; e.num_params()];
    e.read_params(&mut v).expect("params");
    v
}

#[test]
fn a_released_module_draws_the_whole_modules_values_one_tensor_at_a_time() {
    let whole = whole(0.0);
    let expected = params_of(&whole);
    let mut sink = Everything::default();
    let released = released(0.0, &mut sink);
    assert_eq!(bits(&sink.values), bits(&expected), "the same values");
    assert_eq!(
        sink.params,
        (0..6).collect::<Vec<_>>(),
        "one tensor at a time"
    );
    // The blocks are the groups, the last one's gradients ready first.
    assert_eq!(sink.groups, vec![4..6, 2..4, 0..2]);
    assert_eq!(released.backward_groups(), sink.groups);
    assert_eq!(released.layout(), whole.layout());
    let mut out = vec![0.0; expected.len()];
    assert!(released.read_params(&mut out).is_err(), "nothing held");
}

#[test]
fn the_blocks_sharded_pass_gives_the_whole_modules_loss_and_gradients_bit_for_bit() {
    let (images, labels) = batch(6);
    let batch = BatchRef {
        images: &images,
        labels: &labels,
    };
    let mut whole = whole(0.0);
    let values = params_of(&whole);
    let loss = whole.forward_backward(batch).expect("whole pass");
    let mut grads = vec![0.0; values.len()];
    whole.read_grads(&mut grads).expect("grads");
    let mut e = released(0.0, &mut Everything::default());
    let mut pass = Gatherer::new(values.clone(), e.layout());
    let got = e
        .forward_backward_sharded(batch, &mut pass)
        .expect("sharded");
    assert_eq!(got.to_bits(), loss.to_bits(), "the loss");
    assert_eq!(bits(&pass.grads), bits(&grads), "the gradients");
    // Gathered: blocks 0 and 1 forward, 2 once, then 1 and 0 again.
    assert_eq!(pass.gathered, vec![0..2, 2..4, 4..6, 2..4, 0..2]);
    assert_eq!(
        pass.order,
        vec![4, 5, 2, 3, 0, 1],
        "block by block from the last"
    );
    assert!(params_of_err(&e), "released after the pass");
    // Evaluation through the blocks: the whole module's figures.
    let expected = whole
        .evaluate(&images, &labels, 6)
        .expect("whole evaluation");
    let got = e
        .evaluate_sharded(&images, &labels, &mut pass)
        .expect("sharded");
    assert_eq!(got, expected);
}

fn params_of_err(e: &dyn Engine) -> bool {
    let mut v = vec![0.0; e.num_params()];
    e.read_params(&mut v).is_err()
}

/// The blocks run once on the tape, each forward under its own block's dropout seed: what
/// a recomputed forward must draw again.
fn once_on_the_tape(net: &Net, images: &[f32], labels: &[i64], seed: u64) -> Vec<f32> {
    let device = Device::flex().autodiff();
    let n = labels.len();
    let x = Tensor::<2>::from_data(TensorData::new(images.to_vec(), [n, FEATURES]), &device);
    let seeded = |block: usize| device.seed(mask_seed(seed, block));
    let h = under_rng_lock(|| {
        seeded(0);
        net.a.run(x)
    });
    let g = under_rng_lock(|| {
        seeded(1);
        net.b.run(h.clone())
    });
    let logits = net.c.run(g, h);
    let loss = CrossEntropyLossConfig::new().init(&device);
    let grads = loss
        .forward(logits, labels_tensor(labels, &device))
        .backward();
    let layout = crate::ParamLayout::of(net);
    let mut flat = vec![0.0; layout.total];
    params::for_each_grad(net, &grads, &layout, &mut |i, g| {
        let p = &layout.params[i];
        flat[p.offset..p.offset + p.len].copy_from_slice(g);
        Ok(())
    })
    .expect("grads");
    flat
}

/// Dropout draws the same masks in the recomputed forward; kept from forward to backward
/// (`reshard_after_forward` false) each block is gathered once, before its forward, and
/// nothing is recomputed: either way the gradients are those of the blocks run once on the
/// tape, and nothing is held after the pass.
#[test]
fn dropout_draws_the_same_masks_in_the_recomputed_forward_and_when_kept() {
    let (images, labels) = batch(8);
    let batch = BatchRef {
        images: &images,
        labels: &labels,
    };
    let whole = whole(0.5);
    let values = params_of(&whole);
    let net = whole.module().expect("module").clone();
    for reshard in [true, false] {
        let mut e = released(0.5, &mut Everything::default());
        e.set_reshard_after_forward(reshard).expect("reshard");
        let mut per_seed = Vec::new();
        for seed in [3, 4] {
            e.set_dropout_seed(seed);
            let mut pass = Gatherer::new(values.clone(), e.layout());
            e.forward_backward_sharded(batch, &mut pass)
                .expect("sharded");
            let expected = once_on_the_tape(&net, &images, &labels, seed);
            let what = format!("seed {seed}, reshard {reshard}");
            assert_eq!(bits(&pass.grads), bits(&expected), "{what}");
            assert_eq!(pass.order, vec![4, 5, 2, 3, 0, 1], "{what}: from the last");
            if !reshard {
                assert_eq!(pass.gathered, vec![0..2, 2..4, 4..6], "{what}: each once");
            }
            assert!(params_of_err(&e), "{what}: released after the pass");
            per_seed.push(pass.grads);
        }
        assert_ne!(bits(&per_seed[0]), bits(&per_seed[1]), "dropout drew masks");
    }
}

#[test]
fn blocks_that_are_not_the_modules_are_refused() {
    let mut two = blocks(0.0);
    two.pop();
    let input = (two.as_slice(), Shape::Flat(FEATURES));
    let e = ModuleEngine::released(
        |d| Net::new(d, 0.0),
        input,
        &sgd(0.05, 0.9),
        ("flex", SEED),
        &mut Everything::default(),
    );
    let Err(EngineError::ParamsSharded(why)) = e else {
        panic!("accepted blocks without the last's parameters");
    };
    assert!(why.contains("4 parameter tensors, the module 6"), "{why}");
    let e = whole(0.0).release_params().expect_err("no blocks");
    assert!(e.to_string().contains("with_stages"), "{e}");
}

#[test]
fn recomputing_by_the_blocks_gives_the_whole_modules_loss_and_gradients_bit_for_bit() {
    let (images, labels) = batch(6);
    let batch = BatchRef {
        images: &images,
        labels: &labels,
    };
    let mut plain = whole(0.0);
    let loss = plain.forward_backward(batch).expect("whole pass");
    let mut grads = vec![0.0; plain.num_params()];
    plain.read_grads(&mut grads).expect("grads");
    let blocks = blocks(0.0);
    let mut e = whole(0.0)
        .with_blocks((blocks.as_slice(), Shape::Flat(FEATURES)))
        .expect("blocks");
    e.set_recompute(true).expect("recompute");
    assert_eq!(e.backward_groups(), vec![4..6, 2..4, 0..2], "the blocks");
    let mut order = Vec::new();
    let mut streamed = vec![0.0; grads.len()];
    let layout = e.layout().clone();
    let got = e
        .forward_backward_streaming(batch, &mut |i, g| {
            let p = &layout.params[i];
            streamed[p.offset..p.offset + p.len].copy_from_slice(g);
            order.push(i);
            Ok(())
        })
        .expect("recomputing pass");
    assert_eq!(got.to_bits(), loss.to_bits(), "the loss");
    assert_eq!(bits(&streamed), bits(&grads), "the gradients handed on");
    assert_eq!(
        order,
        vec![4, 5, 2, 3, 0, 1],
        "block by block from the last"
    );
    let mut kept = vec![0.0; grads.len()];
    e.read_grads(&mut kept).expect("kept");
    assert_eq!(bits(&kept), bits(&grads), "the gradients kept");
    // Both step the same way, and go on alike.
    plain.apply_grads(&grads, 0.05).expect("step");
    e.apply_grads(&kept, 0.05).expect("step");
    assert_eq!(bits(&params_of(&e)), bits(&params_of(&plain)));
    let again = e.forward_backward(batch).expect("second pass");
    assert_eq!(
        again.to_bits(),
        plain.forward_backward(batch).expect("pass").to_bits()
    );
    assert!(
        whole(0.0).set_recompute(true).is_err(),
        "no blocks, no recomputation"
    );
}

#[test]
fn a_recomputing_module_draws_its_dropout_masks_per_block_and_again_in_recomputation() {
    let (images, labels) = batch(8);
    let batch = BatchRef {
        images: &images,
        labels: &labels,
    };
    let blocks = blocks(0.5);
    let mut e = whole(0.5)
        .with_blocks((blocks.as_slice(), Shape::Flat(FEATURES)))
        .expect("blocks");
    e.set_recompute(true).expect("recompute");
    let net = e.module().expect("module").clone();
    e.set_dropout_seed(9);
    e.forward_backward(batch).expect("recomputing pass");
    let mut grads = vec![0.0; e.num_params()];
    e.read_grads(&mut grads).expect("grads");
    let expected = once_on_the_tape(&net, &images, &labels, 9);
    assert_eq!(bits(&grads), bits(&expected));
}

/// Block 0 of [`Normed`]: a linear layer, a batch norm and a ReLU.
#[derive(Module, Debug)]
struct NormedIn {
    fc: Linear,
    bn: burn::nn::BatchNorm,
}

/// Block 1 of [`Normed`]: a linear layer and a batch norm on the logits.
#[derive(Module, Debug)]
struct NormedOut {
    fc: Linear,
    bn: burn::nn::BatchNorm,
}

/// A module with a batch norm in each of its two blocks.
#[derive(Module, Debug)]
struct Normed {
    a: NormedIn,
    b: NormedOut,
}

impl NormedIn {
    fn run(&self, x: Tensor<2>) -> Tensor<2> {
        burn::tensor::activation::relu(self.bn.forward(self.fc.forward(x)))
    }
}

impl NormedOut {
    fn run(&self, h: Tensor<2>) -> Tensor<2> {
        self.bn.forward(self.fc.forward(h))
    }
}

impl StageModule for NormedIn {
    fn inputs(&self) -> Vec<String> {
        vec!["x".into()]
    }
    fn outputs(&self) -> Vec<String> {
        vec!["h".into()]
    }
    fn forward(&self, mut t: NamedTensors) -> crate::Result<NamedTensors> {
        Ok(NamedTensors::new().with("h", self.run(t.take::<2>("x")?)))
    }
}

impl StageModule for NormedOut {
    fn inputs(&self) -> Vec<String> {
        vec!["h".into()]
    }
    fn outputs(&self) -> Vec<String> {
        vec!["logits".into()]
    }
    fn forward(&self, mut t: NamedTensors) -> crate::Result<NamedTensors> {
        Ok(NamedTensors::new().with("logits", self.run(t.take::<2>("h")?)))
    }
}

impl TrainModule for Normed {
    fn loss(&self, batch: BatchRef<'_>, device: &Device) -> Tensor<1> {
        loss_of(self, batch, device)
    }

    fn logits(&self, inputs: &[f32], n: usize, device: &Device) -> Tensor<2> {
        let x = Tensor::<2>::from_data(TensorData::new(inputs.to_vec(), [n, FEATURES]), device);
        self.b.run(self.a.run(x))
    }
}

fn normed_in(d: &Device) -> NormedIn {
    NormedIn {
        fc: LinearConfig::new(FEATURES, 8).init(d),
        bn: burn::nn::BatchNormConfig::new(8).init(d),
    }
}

fn normed_out(d: &Device) -> NormedOut {
    NormedOut {
        fc: LinearConfig::new(8, 5).init(d),
        bn: burn::nn::BatchNormConfig::new(5).init(d),
    }
}

fn normed(d: &Device) -> Normed {
    Normed {
        a: normed_in(d),
        b: normed_out(d),
    }
}

fn normed_blocks() -> Vec<StageBuilder> {
    vec![
        Box::new(|d: &Device| Box::new(normed_in(d)) as Box<dyn crate::AnyStageModule>),
        Box::new(|d: &Device| Box::new(normed_out(d)) as Box<dyn crate::AnyStageModule>),
    ]
}

fn normed_whole() -> ModuleEngine<Normed> {
    ModuleEngine::seeded(normed, SEED, &sgd(0.05, 0.9), "flex").expect("whole")
}

fn buffers_of(e: &dyn Engine) -> Vec<f32> {
    let mut b = vec![0.0; e.buffer_layout().total];
    e.read_buffers(&mut b).expect("buffers");
    b
}

/// Recomputing by its blocks, a module with batch norm trains as without: the same losses,
/// gradients and (carried back from the blocks into the module, the recomputed forward's
/// update undone) running statistics, bit for bit, step after step.
#[test]
fn recomputing_blocks_carry_the_running_statistics_of_one_forward_back_to_the_module() {
    let mut plain = normed_whole();
    let blocks = normed_blocks();
    let mut e = normed_whole()
        .with_blocks((blocks.as_slice(), Shape::Flat(FEATURES)))
        .expect("blocks");
    e.set_recompute(true).expect("recompute");
    let initial = buffers_of(&plain);
    for step in 0..3 {
        let (images, labels) = batch(6 + step);
        let batch = BatchRef {
            images: &images,
            labels: &labels,
        };
        let want = plain.forward_backward(batch).expect("whole pass");
        let got = e.forward_backward(batch).expect("recomputing pass");
        assert_eq!(got.to_bits(), want.to_bits(), "step {step}: the loss");
        let mut grads = vec![0.0; plain.num_params()];
        plain.read_grads(&mut grads).expect("grads");
        let mut kept = vec![0.0; grads.len()];
        e.read_grads(&mut kept).expect("grads");
        assert_eq!(bits(&kept), bits(&grads), "step {step}: the gradients");
        let stats = buffers_of(&plain);
        assert_eq!(
            bits(&buffers_of(&e)),
            bits(&stats),
            "step {step}: statistics"
        );
        assert_ne!(stats, initial, "step {step}: the statistics moved");
        plain.apply_grads(&grads, 0.05).expect("step");
        e.apply_grads(&kept, 0.05).expect("step");
    }
}

/// ZeRO-3 of a module with batch norm: the sharded pass leaves the whole module's running
/// statistics in the module, and evaluation through the blocks uses them; a module's
/// statistics written before a pass (the ranks' average, a resume) reach the blocks.
#[test]
fn a_released_modules_blocks_carry_its_running_statistics() {
    let (images, labels) = batch(6);
    let batch = BatchRef {
        images: &images,
        labels: &labels,
    };
    let mut plain = normed_whole();
    let values = params_of(&plain);
    let blocks = normed_blocks();
    let input = (blocks.as_slice(), Shape::Flat(FEATURES));
    let mut sink = Everything::default();
    let mut e = ModuleEngine::released(normed, input, &sgd(0.05, 0.9), ("flex", SEED), &mut sink)
        .expect("released");
    for round in 0..2 {
        let want = plain.forward_backward(batch).expect("whole pass");
        let mut pass = Gatherer::new(values.clone(), e.layout());
        let got = e
            .forward_backward_sharded(batch, &mut pass)
            .expect("sharded");
        assert_eq!(got.to_bits(), want.to_bits(), "round {round}: the loss");
        let stats = buffers_of(&plain);
        assert_eq!(
            bits(&buffers_of(&e)),
            bits(&stats),
            "round {round}: statistics"
        );
        let expected = plain
            .evaluate(&images, &labels, 6)
            .expect("whole evaluation");
        let got = e
            .evaluate_sharded(&images, &labels, &mut pass)
            .expect("sharded");
        assert_eq!(got, expected, "round {round}: evaluation");
        // Written into the module between passes (as the ranks' average is): the next pass
        // starts from them, in the blocks as in the whole module.
        let halved: Vec<f32> = stats.iter().map(|v| v * 0.5).collect();
        e.write_buffers(&halved).expect("write");
        plain.write_buffers(&halved).expect("write");
    }
}
