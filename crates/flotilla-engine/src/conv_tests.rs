//! The im2col convolution against burn's own `Conv2d::forward`: outputs and the gradients of
//! input, weight and bias, for the shapes of the specs and the options around them.

use burn::nn::PaddingConfig2d;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::prelude::*;
use burn::tensor::TensorData;

use crate::conv::conv2d;
use crate::patches::{Patches, col2im, im2col};

/// Deterministic values in [-1, 1).
fn values(n: usize, salt: u32) -> Vec<f32> {
    let mut x = salt.wrapping_mul(2654435761).wrapping_add(7);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x % 2000) as f32 / 1000.0 - 1.0
        })
        .collect()
}

fn read<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().try_into_vec::<f32>().expect("f32")
}

fn assert_close(what: &str, ours: &[f32], burn: &[f32]) {
    assert_eq!(ours.len(), burn.len(), "{what}: length");
    for (i, (a, b)) in ours.iter().zip(burn).enumerate() {
        assert!(
            (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
            "{what}[{i}]: im2col {a} against burn {b}"
        );
    }
}

/// Output, input gradient, weight gradient, bias gradient of `forward` on `x` for `conv`,
/// with the loss `Σ y · r` for a fixed `r`.
fn run(
    conv: &Conv2d,
    x: &[f32],
    dims: [usize; 4],
    forward: impl Fn(&Conv2d, Tensor<4>) -> Tensor<4>,
) -> [Vec<f32>; 4] {
    let device = Device::flex().autodiff();
    let x = Tensor::<4>::from_data(TensorData::new(x.to_vec(), dims), &device).require_grad();
    let y = forward(conv, x.clone());
    let r = Tensor::<4>::from_data(
        TensorData::new(values(y.dims().iter().product(), 99), y.dims()),
        &device,
    );
    let grads = (y.clone() * r).sum().backward();
    let bias = conv.bias.as_ref().expect("bias");
    [
        read(y),
        read(x.grad(&grads).expect("dx")),
        read(conv.weight.grad(&grads).expect("dw")),
        read(bias.grad(&grads).expect("db")),
    ]
}

fn check(config: Conv2dConfig, dims: [usize; 4]) {
    let conv = config.init(&Device::flex().autodiff());
    let x = values(dims.iter().product(), 3);
    let ours = run(&conv, &x, dims, conv2d);
    let burn = run(&conv, &x, dims, |c, x| c.forward(x));
    for (what, (a, b)) in ["y", "dx", "dw", "db"].iter().zip(ours.iter().zip(&burn)) {
        assert_close(&format!("{config:?} {what}"), a, b);
    }
}

#[test]
fn lenet5_layers_match_burn() {
    let first =
        Conv2dConfig::new([1, 6], [5, 5]).with_padding(PaddingConfig2d::Explicit(2, 2, 2, 2));
    check(first, [4, 1, 28, 28]);
    check(Conv2dConfig::new([6, 16], [5, 5]), [3, 6, 14, 14]);
}

#[test]
fn strides_rectangles_and_uneven_padding_match_burn() {
    let strided = Conv2dConfig::new([3, 4], [3, 3])
        .with_stride([2, 2])
        .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1));
    check(strided, [2, 3, 9, 7]);
    let uneven = Conv2dConfig::new([2, 5], [3, 2])
        .with_stride([1, 2])
        .with_padding(PaddingConfig2d::Explicit(1, 0, 2, 1));
    check(uneven, [2, 2, 6, 8]);
    let valid = Conv2dConfig::new([2, 3], [2, 2]).with_padding(PaddingConfig2d::Valid);
    check(valid, [1, 2, 5, 5]);
}

#[test]
fn same_padding_and_groups_fall_back_to_burn() {
    // Not covered by im2col: burn's own forward, so the results are burn's bit for bit.
    let device = Device::flex().autodiff();
    for config in [
        Conv2dConfig::new([2, 2], [3, 3]).with_padding(PaddingConfig2d::Same),
        Conv2dConfig::new([2, 4], [3, 3]).with_groups(2),
    ] {
        let conv = config.init(&device);
        let x = values(2 * 2 * 6 * 6, 5);
        let ours = run(&conv, &x, [2, 2, 6, 6], conv2d);
        let burn = run(&conv, &x, [2, 2, 6, 6], |c, x| c.forward(x));
        assert_eq!(ours, burn, "{config:?}");
    }
}

#[test]
fn the_gradient_is_deterministic() {
    let config = Conv2dConfig::new([6, 16], [5, 5]);
    let conv = config.init(&Device::flex().autodiff());
    let x = values(8 * 6 * 14 * 14, 11);
    let first = run(&conv, &x, [8, 6, 14, 14], conv2d);
    let second = run(&conv, &x, [8, 6, 14, 14], conv2d);
    assert_eq!(first, second);
}

#[test]
fn col2im_is_the_adjoint_of_im2col() {
    // <im2col(x), c> == <x, col2im(c)>, in small integers (exact sums), against a serial sum.
    let p = Patches {
        input: [2, 3, 5, 4],
        kernel: [3, 2],
        stride: [2, 1],
        pad: [1, 1],
        output: [3, 5],
    };
    let int = |n: usize, salt| -> Vec<f32> {
        values(n, salt).iter().map(|v| (v * 8.0).round()).collect()
    };
    let x = int(p.input.iter().product(), 1);
    let c = int(p.rows() * p.cols(), 2);
    let dot =
        |a: &[f32], b: &[f32]| -> f64 { a.iter().zip(b).map(|(a, b)| f64::from(a * b)).sum() };
    assert_eq!(dot(&p.im2col(&x), &c), dot(&x, &p.col2im(&c)));
    // The same through the backend ops.
    let device = Device::flex();
    let xt = Tensor::<4>::from_data(TensorData::new(x.clone(), p.input), &device);
    let ct = Tensor::<2>::from_data(TensorData::new(c.clone(), [p.rows(), p.cols()]), &device);
    assert_eq!(read(im2col(xt, p)), p.im2col(&x));
    assert_eq!(read(col2im(ct, p)), p.col2im(&c));
}
