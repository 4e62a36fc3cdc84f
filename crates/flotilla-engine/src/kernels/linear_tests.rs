//! The linear kernel against burn's `Linear` (then `relu`), outputs and every gradient, and
//! bitwise the same on 1 and 2 threads.

use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use burn::tensor::activation::relu;

use super::linear::linear;

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let h =
                (i ^ seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            ((h >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn device() -> Device {
    Device::flex().autodiff()
}

fn layer(k: usize, n: usize, bias: bool) -> Linear {
    LinearConfig::new(k, n).with_bias(bias).init(&device())
}

/// Output, input gradient, weight gradient and bias gradient (empty without one) of
/// `Σ c·f(x)`, with `f` ours or burn's.
fn run(m: &Linear, dims: &[usize], relu_too: bool, ours: bool) -> [Vec<f32>; 4] {
    let x = Tensor::<3>::from_data(
        TensorData::new(values(dims.iter().product(), 1), dims.to_vec()),
        &device(),
    )
    .require_grad();
    let y = if ours {
        linear(m, x.clone(), relu_too)
    } else if relu_too {
        relu(m.forward(x.clone()))
    } else {
        m.forward(x.clone())
    };
    let c = Tensor::<3>::from_data(
        TensorData::new(values(y.shape().num_elements(), 2), y.dims()),
        &device(),
    );
    let grads = (y.clone() * c).sum().backward();
    let read = |t: Option<Tensor<3>>| t.map(|t| t.into_data().try_into_vec::<f32>().expect("f32"));
    let read2 = |t: Option<Tensor<2>>| t.map(|t| t.into_data().try_into_vec::<f32>().expect("f32"));
    let read1 = |t: Option<Tensor<1>>| t.map(|t| t.into_data().try_into_vec::<f32>().expect("f32"));
    [
        y.into_data().try_into_vec::<f32>().expect("f32"),
        read(x.grad(&grads)).expect("input gradient"),
        read2(m.weight.val().grad(&grads)).expect("weight gradient"),
        read1(m.bias.as_ref().and_then(|b| b.val().grad(&grads))).unwrap_or_default(),
    ]
}

fn assert_close(ours: &[f32], theirs: &[f32], what: &str) {
    assert_eq!(ours.len(), theirs.len(), "{what}: lengths");
    for (i, (a, b)) in ours.iter().zip(theirs).enumerate() {
        assert!(
            (a - b).abs() <= 1e-5 * b.abs().max(1.0),
            "{what}[{i}]: {a} against {b}"
        );
    }
}

#[test]
fn outputs_and_gradients_match_burns_linear_and_relu() {
    // Draws from the backend RNG: see `rng::rng_lock`.
    let _rng = crate::rng::rng_lock();
    // (batch dims, in, out, bias, relu)
    let cases: [([usize; 2], usize, usize, bool, bool); 5] = [
        ([64, 1], 784, 256, true, true),
        ([7, 1], 13, 5, true, false),
        ([33, 1], 300, 10, false, true),
        ([4, 16], 32, 48, true, true),
        ([257, 1], 129, 131, false, false),
    ];
    for ([a, b], k, n, bias, relu_too) in cases {
        let m = layer(k, n, bias);
        let dims = [a, b, k];
        let ours = run(&m, &dims, relu_too, true);
        let theirs = run(&m, &dims, relu_too, false);
        for (part, (o, t)) in ["output", "input grad", "weight grad", "bias grad"]
            .iter()
            .zip(ours.iter().zip(&theirs))
        {
            assert_close(
                o,
                t,
                &format!("{dims:?}->{n} bias {bias} relu {relu_too}: {part}"),
            );
        }
    }
}

#[test]
fn one_and_two_threads_give_the_same_bits() {
    // Draws from the backend RNG: see `rng::rng_lock`.
    let _rng = crate::rng::rng_lock();
    for (dims, k, n) in [([256, 1, 784], 784, 256), ([64, 1, 256], 256, 128)] {
        let m = layer(k, n, true);
        let on = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("pool");
            pool.install(|| run(&m, &dims, true, true))
        };
        let (one, two) = (on(1), on(2));
        for (a, b) in one.iter().zip(&two) {
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(a), bits(b), "{dims:?}->{n}");
        }
    }
}

/// Without autodiff (evaluation), the layer runs on the backend itself: the same outputs as
/// burn's `Linear` (then `relu`), with and without bias and ReLU.
#[test]
fn inference_outputs_match_burns_linear_and_relu() {
    // Draws from the backend RNG: see `rng::rng_lock`.
    let _rng = crate::rng::rng_lock();
    let device = Device::flex();
    let (dims, k, n) = ([5, 3, 24], 24, 17);
    let x = Tensor::<3>::from_data(TensorData::new(values(5 * 3 * k, 5), dims), &device);
    for (bias, relu_too) in [(true, true), (true, false), (false, true), (false, false)] {
        let m = LinearConfig::new(k, n).with_bias(bias).init(&device);
        let ours = linear(&m, x.clone(), relu_too);
        let theirs = match relu_too {
            true => relu(m.forward(x.clone())),
            false => m.forward(x.clone()),
        };
        let read = |t: Tensor<3>| t.into_data().try_into_vec::<f32>().expect("f32");
        assert_close(
            &read(ours),
            &read(theirs),
            &format!("inference bias {bias} relu {relu_too}"),
        );
    }
}
