//! A user's module through [`ModuleEngine`] trains bit for bit as the same model from a spec
//! through [`BurnEngine`]: the one model abstraction the strategies are written against.

use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use burn::tensor::TensorData;

use crate::engine::labels_tensor;
use crate::engine_tests::sgd;
use crate::{
    BatchRef, BurnEngine, DecayParams, Engine, ModelSpec, ModelState, ModuleEngine, OptimizerSpec,
    TrainModule, kernels,
};

/// `models/mlp.yaml` written as a user writes a burn module, with the engine's kernels.
#[derive(Module, Debug)]
struct Mlp {
    fc1: Linear,
    fc2: Linear,
    fc3: Linear,
}

impl Mlp {
    fn new(device: &Device) -> Self {
        Mlp {
            fc1: LinearConfig::new(784, 256).init(device),
            fc2: LinearConfig::new(256, 128).init(device),
            fc3: LinearConfig::new(128, 10).init(device),
        }
    }
}

impl TrainModule for Mlp {
    fn loss(&self, batch: BatchRef<'_>, device: &Device) -> Tensor<1> {
        let logits = self.logits(batch.images, batch.labels.len(), device);
        let loss = CrossEntropyLossConfig::new().init(device);
        loss.forward(logits, labels_tensor(batch.labels, device))
    }

    fn logits(&self, inputs: &[f32], n: usize, device: &Device) -> Tensor<2> {
        let x = Tensor::<2>::from_data(TensorData::new(inputs.to_vec(), [n, 784]), device);
        let x = kernels::linear::linear(&self.fc1, x, true);
        let x = kernels::linear::linear(&self.fc2, x, true);
        kernels::linear::linear(&self.fc3, x, false)
    }
}

fn adam() -> OptimizerSpec {
    OptimizerSpec::Adam {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        epsilon: 1e-8,
        weight_decay: 0.0,
        decay_params: DecayParams::All,
    }
}

/// A deterministic batch of `n` MNIST-shaped samples.
fn batch(n: usize, salt: u64) -> (Vec<f32>, Vec<i64>) {
    let mut x = salt.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let images = (0..n * 784).map(|_| (next() % 1000) as f32 / 500.0 - 1.0);
    let images = images.collect();
    let labels = (0..n).map(|_| (next() % 10) as i64).collect();
    (images, labels)
}

fn flat(e: &dyn Engine, grads: bool) -> Vec<u32> {
    let mut v = vec![0.0; e.num_params()];
    if grads {
        e.read_grads(&mut v).expect("grads");
    } else {
        e.read_params(&mut v).expect("params");
    }
    v.into_iter().map(f32::to_bits).collect()
}

#[test]
fn a_user_module_trains_bitwise_as_the_same_spec_model() {
    for opt in [sgd(0.05, 0.9), adam()] {
        let spec = ModelSpec::builtin("mlp").expect("mlp");
        let mut by_spec = BurnEngine::new(&spec, &opt, "flex", 7).expect("spec engine");
        let module = Mlp::new(&Device::flex());
        let mut by_user = ModuleEngine::new(module, &opt, "flex").expect("module engine");
        let shapes = |e: &dyn Engine| -> Vec<Vec<usize>> {
            e.layout().params.iter().map(|p| p.shape.clone()).collect()
        };
        assert_eq!(shapes(&by_spec), shapes(&by_user));
        let mut start = vec![0.0; by_spec.num_params()];
        by_spec.read_params(&mut start).expect("read");
        by_user.write_params(&start).expect("write");
        for step in 0..4 {
            let (images, labels) = batch(32, step);
            let b = BatchRef {
                images: &images,
                labels: &labels,
            };
            let (a, u) = (
                by_spec.forward_backward(b).expect("spec step"),
                by_user.forward_backward(b).expect("user step"),
            );
            assert_eq!(a.to_bits(), u.to_bits(), "loss of step {step}: {a} vs {u}");
            assert!(
                flat(&by_spec, true) == flat(&by_user, true),
                "gradients of step {step}"
            );
            let mut g = vec![0.0; by_user.num_params()];
            by_user.read_grads(&mut g).expect("grads");
            by_spec.apply_grads(&g, 0.05).expect("spec update");
            by_user.apply_grads(&g, 0.05).expect("user update");
            assert!(
                flat(&by_spec, false) == flat(&by_user, false),
                "params after {step}"
            );
        }
        // The optimizer state of one loads into the other (a checkpoint of either resumes
        // either), and the next step is again the same.
        let state = by_spec.optimizer_state().expect("state");
        let mut by_user = ModuleEngine::new(Mlp::new(&Device::flex()), &opt, "flex").expect("new");
        let mut now = vec![0.0; by_spec.num_params()];
        by_spec.read_params(&mut now).expect("read");
        by_user.write_params(&now).expect("write");
        by_user
            .load_optimizer_state(&state)
            .expect("the spec model's state");
        let (images, labels) = batch(32, 50);
        let b = BatchRef {
            images: &images,
            labels: &labels,
        };
        by_spec.forward_backward(b).expect("spec step");
        let mut g = vec![0.0; by_spec.num_params()];
        by_spec.read_grads(&mut g).expect("grads");
        by_spec.apply_grads(&g, 0.05).expect("spec update");
        by_user.apply_grads(&g, 0.05).expect("user update");
        assert!(
            flat(&by_spec, false) == flat(&by_user, false),
            "after a loaded state"
        );
        let (images, labels) = batch(100, 99);
        let (a, u) = (
            by_spec.evaluate(&images, &labels, 32).expect("spec eval"),
            by_user.evaluate(&images, &labels, 32).expect("user eval"),
        );
        assert_eq!((a.correct, a.count), (u.correct, u.count));
        assert_eq!(a.loss_sum.to_bits(), u.loss_sum.to_bits());
    }
}

#[test]
fn a_user_modules_state_round_trips_through_its_files() {
    let opt = adam();
    let mut e = ModuleEngine::new(Mlp::new(&Device::flex()), &opt, "flex").expect("engine");
    let (images, labels) = batch(8, 3);
    let b = BatchRef {
        images: &images,
        labels: &labels,
    };
    e.forward_backward(b).expect("step");
    let mut g = vec![0.0; e.num_params()];
    e.read_grads(&mut g).expect("grads");
    e.apply_grads(&g, 1e-3).expect("update");
    let (weights, state) = (
        e.weights_bytes().expect("w"),
        e.optimizer_state().expect("s"),
    );
    let mut other = ModuleEngine::new(Mlp::new(&Device::flex()), &opt, "flex").expect("other");
    other.load_weights_bytes(&weights).expect("load weights");
    other.load_optimizer_state(&state).expect("load state");
    assert!(flat(&e, false) == flat(&other, false));
    // The same next step from the same state.
    for engine in [&mut e, &mut other] {
        engine.forward_backward(b).expect("step");
        engine.apply_grads(&g, 1e-3).expect("update");
    }
    assert!(flat(&e, false) == flat(&other, false));
    assert!(e.set_batch_norm_sync(None).is_ok());
    e.drop_grads();
    assert!(
        e.read_grads(&mut g).is_err(),
        "no gradients after drop_grads"
    );
}

#[test]
fn a_modules_gradients_are_handed_on_in_bucket_sized_layer_groups_last_layer_first() {
    let opt = sgd(0.05, 0.0);
    let mut engine = ModuleEngine::new(Mlp::new(&Device::flex()), &opt, "flex").expect("engine");
    assert_eq!(engine.backward_groups(), vec![0..6], "one group by default");
    // fc3 and fc2 (5,160 + 131,584 bytes) fit 140,000; fc1 (803,840) is a group of its own.
    engine.set_backward_group_bytes(140_000).expect("groups");
    assert_eq!(engine.backward_groups(), vec![2..6, 0..2]);
    let (images, labels) = batch(16, 3);
    let b = BatchRef {
        images: &images,
        labels: &labels,
    };
    let mut order = Vec::new();
    let mut streamed = vec![0.0; engine.num_params()];
    let layout = engine.layout().clone();
    engine
        .forward_backward_streaming(b, &mut |i, g| {
            order.push(i);
            let p = &layout.params[i];
            streamed[p.offset..p.offset + p.len].copy_from_slice(g);
            Ok(())
        })
        .expect("streaming step");
    assert_eq!(order, vec![2, 3, 4, 5, 0, 1]);
    let mut whole = vec![0.0; engine.num_params()];
    engine.read_grads(&mut whole).expect("grads");
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert!(bits(&streamed) == bits(&whole), "streamed gradients differ");
}
