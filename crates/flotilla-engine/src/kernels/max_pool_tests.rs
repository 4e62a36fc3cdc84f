//! The max-pool kernel against burn's `MaxPool2d`: outputs and input gradients on several
//! shapes and windows, ties and padding included.

use burn::nn::PaddingConfig2d;
use burn::nn::pool::{MaxPool2d, MaxPool2dConfig};
use burn::prelude::*;

use super::max_pool::max_pool2d;

fn device() -> Device {
    Device::flex().autodiff()
}

/// Values with many exact ties (a ReLU's zeros, repeated levels).
fn values(n: usize, seed: u64) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let h =
                (i ^ seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            let v = ((h >> 40) % 64) as f32 / 8.0 - 3.0;
            v.max(0.0) + if h.is_multiple_of(7) { 0.25 } else { 0.0 }
        })
        .collect()
}

/// Output and input gradient of `Σ c·pool(x)`, ours or burn's.
fn run(m: &MaxPool2d, dims: [usize; 4], ours: bool) -> [Vec<f32>; 2] {
    let x = Tensor::<4>::from_data(
        TensorData::new(values(dims.iter().product(), 3), dims),
        &device(),
    )
    .require_grad();
    let y = if ours {
        max_pool2d(m, x.clone())
    } else {
        m.forward(x.clone())
    };
    let c = Tensor::<4>::from_data(
        TensorData::new(values(y.shape().num_elements(), 4), y.dims()),
        &device(),
    );
    let grads = (y.clone() * c).sum().backward();
    let read = |t: Tensor<4>| t.into_data().try_into_vec::<f32>().expect("f32");
    [read(y), read(x.grad(&grads).expect("input gradient"))]
}

#[test]
fn outputs_and_gradients_match_burns_max_pool() {
    let cases = [
        (MaxPool2dConfig::new([2, 2]), [4, 6, 28, 28]),
        (MaxPool2dConfig::new([2, 2]), [3, 2, 9, 7]),
        (
            MaxPool2dConfig::new([3, 3]).with_strides([2, 2]),
            [2, 3, 11, 12],
        ),
        (
            MaxPool2dConfig::new([3, 3])
                .with_strides([1, 2])
                .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1)),
            [2, 2, 8, 9],
        ),
        (
            MaxPool2dConfig::new([2, 3]).with_dilation([2, 1]),
            [1, 4, 10, 10],
        ),
    ];
    for (config, dims) in cases {
        let m = config.init();
        let ours = run(&m, dims, true);
        let theirs = run(&m, dims, false);
        for (part, (o, t)) in ["output", "input grad"]
            .iter()
            .zip(ours.iter().zip(&theirs))
        {
            assert_eq!(o.len(), t.len(), "{config:?} {dims:?} {part}");
            for (i, (a, b)) in o.iter().zip(t).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-5,
                    "{config:?} {dims:?} {part}[{i}]: {a} against {b}"
                );
            }
        }
    }
}

/// Without autodiff (evaluation), the pooling runs on the backend itself: the same outputs as
/// burn's `MaxPool2d`, bitwise (a maximum is one of the inputs).
#[test]
fn inference_outputs_match_burns_max_pool_bitwise() {
    let device = Device::flex();
    let dims = [2, 3, 9, 8];
    let x = Tensor::<4>::from_data(TensorData::new(values(2 * 3 * 9 * 8, 5), dims), &device);
    for config in [
        MaxPool2dConfig::new([2, 2]),
        MaxPool2dConfig::new([3, 3])
            .with_strides([2, 1])
            .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1)),
    ] {
        let m = config.init();
        let read = |t: Tensor<4>| t.into_data().try_into_vec::<f32>().expect("f32");
        let (ours, theirs) = (read(max_pool2d(&m, x.clone())), read(m.forward(x.clone())));
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&ours), bits(&theirs), "{config:?}");
    }
}
