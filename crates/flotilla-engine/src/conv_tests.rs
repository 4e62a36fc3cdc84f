//! Flotilla's convolution (`conv`) against burn's own `Conv2d`: outputs and the gradients of
//! input, weight and bias on several shapes (padding, stride, one and several channels,
//! batch 1, odd sizes, a batch that is not a whole number of blocks), with and without the
//! fused ReLU (against burn's `relu` after burn's convolution), and bitwise the same values on
//! one thread and on two.

use burn::module::Param;
use burn::nn::PaddingConfig2d;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::prelude::*;

use crate::conv::{IMAGES_PER_BLOCK, conv2d_fused};

/// One convolution to compare: batch, input `[C, H, W]`, out channels, kernel, stride,
/// padding, bias.
#[derive(Clone, Copy, Debug)]
struct Case {
    n: usize,
    input: [usize; 3],
    out: usize,
    k: usize,
    stride: usize,
    pad: usize,
    bias: bool,
}

const CASES: [Case; 7] = [
    // LeNet-5's two convolutions.
    Case {
        n: 3,
        input: [1, 28, 28],
        out: 6,
        k: 5,
        stride: 1,
        pad: 2,
        bias: true,
    },
    Case {
        n: 9,
        input: [6, 14, 14],
        out: 16,
        k: 5,
        stride: 1,
        pad: 0,
        bias: true,
    },
    // Stride 2 on an odd, non-square image.
    Case {
        n: 5,
        input: [3, 9, 7],
        out: 4,
        k: 3,
        stride: 2,
        pad: 1,
        bias: true,
    },
    // Batch 1, no bias.
    Case {
        n: 1,
        input: [2, 5, 6],
        out: 3,
        k: 3,
        stride: 1,
        pad: 1,
        bias: false,
    },
    // A 1×1 kernel.
    Case {
        n: 6,
        input: [4, 4, 4],
        out: 2,
        k: 1,
        stride: 1,
        pad: 0,
        bias: true,
    },
    // Stride 3, padding wider than a stride, the last windows partly over the padding.
    Case {
        n: 2,
        input: [2, 8, 11],
        out: 3,
        k: 4,
        stride: 3,
        pad: 2,
        bias: true,
    },
    // Padding as wide as the kernel minus one: windows that see one pixel only.
    Case {
        n: 2,
        input: [1, 3, 3],
        out: 2,
        k: 3,
        stride: 1,
        pad: 2,
        bias: true,
    },
];

/// Values in [-1, 1) from a seed, without burn's generator (so every run draws the same).
fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn tensor<const D: usize>(shape: [usize; D], seed: u64, device: &Device) -> Tensor<D> {
    let len = shape.iter().product();
    Tensor::from_data(TensorData::new(values(len, seed), shape), device)
}

/// burn's `Conv2d` for `case`, its parameters drawn from `seed`.
fn layer(case: Case, device: &Device) -> Conv2d {
    let c = case.input[0];
    let mut conv = Conv2dConfig::new([c, case.out], [case.k, case.k])
        .with_stride([case.stride; 2])
        .with_padding(PaddingConfig2d::Explicit(
            case.pad, case.pad, case.pad, case.pad,
        ))
        .with_bias(case.bias)
        .init(device);
    conv.weight = Param::from_tensor(tensor([case.out, c, case.k, case.k], 1, device));
    if case.bias {
        conv.bias = Some(Param::from_tensor(tensor([case.out], 2, device)));
    }
    conv
}

/// Output, then the gradients of input, weight and bias (empty without a bias), of
/// `Σ y · r` for a fixed `r`, through `f`.
fn run(case: Case, f: impl Fn(&Conv2d, Tensor<4>) -> Tensor<4>) -> [Vec<f32>; 4] {
    let device = Device::flex().autodiff();
    let conv = layer(case, &device);
    let [c, h, w] = case.input;
    let x = tensor([case.n, c, h, w], 3, &device).require_grad();
    let y = f(&conv, x.clone());
    let r = tensor(y.dims(), 4, &device);
    let grads = (y.clone() * r).sum().backward();
    let read = |t: Option<Tensor<4>>| t.map(|t| t.into_data().try_to_vec::<f32>().expect("f32"));
    let bias_grad = conv
        .bias
        .as_ref()
        .and_then(|b| b.grad(&grads))
        .map(|g| g.into_data().try_to_vec::<f32>().expect("f32"));
    [
        read(Some(y.inner())).unwrap_or_default(),
        read(x.grad(&grads)).expect("input gradient"),
        read(conv.weight.grad(&grads)).expect("weight gradient"),
        bias_grad.unwrap_or_default(),
    ]
}

fn assert_close(case: Case, what: &str, ours: &[f32], burn: &[f32]) {
    assert_eq!(ours.len(), burn.len(), "{case:?} {what}: lengths");
    for (i, (a, b)) in ours.iter().zip(burn).enumerate() {
        let tolerance = 1e-4 * (1.0 + b.abs());
        assert!(
            (a - b).abs() <= tolerance,
            "{case:?} {what}[{i}]: {a} against burn's {b}"
        );
    }
}

/// burn's convolution, then burn's ReLU when `relu`.
fn burns(conv: &Conv2d, x: Tensor<4>, relu: bool) -> Tensor<4> {
    let y = conv.forward(x);
    if relu {
        burn::tensor::activation::relu(y)
    } else {
        y
    }
}

#[test]
fn output_and_gradients_match_burns_conv2d() {
    // Draws from the backend RNG: see `rng::rng_lock`.
    let _rng = crate::rng::rng_lock();
    for (case, relu) in CASES.into_iter().flat_map(|c| [(c, false), (c, true)]) {
        let ours = run(case, |conv, x| conv2d_fused(conv, x, relu));
        let burn = run(case, |conv, x| burns(conv, x, relu));
        let names = [
            "output",
            "input gradient",
            "weight gradient",
            "bias gradient",
        ];
        for ((name, o), b) in names.iter().zip(&ours).zip(&burn) {
            assert_close(case, &format!("relu {relu}, {name}"), o, b);
        }
        if relu {
            // The ReLU cut something, so its mask is tested.
            assert!(ours[0].contains(&0.0), "{case:?}: no output was cut");
        }
        assert!(!ours[1].is_empty() && !ours[2].is_empty(), "{case:?}");
        assert_eq!(ours[3].is_empty(), !case.bias, "{case:?}: bias gradient");
    }
}

#[test]
fn one_and_two_threads_give_the_same_bits() {
    // Draws from the backend RNG: see `rng::rng_lock`.
    let _rng = crate::rng::rng_lock();
    let pool = |threads| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("pool")
    };
    // Batches of several blocks, one of them short, so two threads share the blocks.
    let cases = [
        Case {
            n: 4 * IMAGES_PER_BLOCK + 3,
            ..CASES[0]
        },
        Case {
            n: 8 * IMAGES_PER_BLOCK + 1,
            ..CASES[1]
        },
        Case {
            n: 5 * IMAGES_PER_BLOCK - 1,
            ..CASES[2]
        },
    ];
    for (case, relu) in cases.into_iter().flat_map(|c| [(c, false), (c, true)]) {
        let one = pool(1).install(|| run(case, |conv, x| conv2d_fused(conv, x, relu)));
        let two = pool(2).install(|| run(case, |conv, x| conv2d_fused(conv, x, relu)));
        for (a, b) in one.iter().zip(&two) {
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(a), bits(b), "{case:?}, relu {relu}");
        }
    }
}

#[test]
fn layers_outside_the_kernels_run_burns_conv2d() {
    // Draws from the backend RNG: see `rng::rng_lock`.
    let _rng = crate::rng::rng_lock();
    // Dilation 2: burn's own convolution, the same values as calling it directly.
    let device = Device::flex().autodiff();
    let conv = Conv2dConfig::new([2, 3], [3, 3])
        .with_dilation([2, 2])
        .init(&device);
    let x = tensor([2, 2, 9, 9], 5, &device);
    for relu in [false, true] {
        let ours = conv2d_fused(&conv, x.clone(), relu)
            .into_data()
            .try_to_vec::<f32>()
            .expect("f32");
        let burn = burns(&conv, x.clone(), relu)
            .into_data()
            .try_to_vec::<f32>()
            .expect("f32");
        assert_eq!(ours, burn, "relu {relu}");
    }
}
