//! Causal attention in burn's own ops on any backend's primitives: what
//! [`super::attention`]'s trait does on backends without a fused kernel, and the reference its
//! Flex kernel is tested against. The same steps as burn's `MultiHeadAttention` (heads split
//! by reshape and swap, scores `Q·Kᵀ·scale`, masked above the diagonal, softmax, `P·V`, heads
//! merged), and their gradients; on Q, K and V as three tensors, or packed as one `[n, t, 3d]`
//! (the one product of the three projections: [`forward_packed`], [`backward_packed`]).

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, TensorMetadata};
use burn::tensor::{Shape, Slice, TensorData};

/// `[n, t, d]` → `[n, heads, t, d/heads]`.
fn split<B: Backend>(x: FloatTensor<B>, heads: usize) -> FloatTensor<B> {
    let dims = x.shape();
    let (n, t, d) = (dims[0], dims[1], dims[2]);
    B::float_swap_dims(
        B::float_reshape(x, Shape::new([n, t, heads, d / heads])),
        1,
        2,
    )
}

/// `[n, heads, t, dk]` → `[n, t, heads·dk]`.
fn merge<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
    let dims = x.shape();
    let (n, h, t, dk) = (dims[0], dims[1], dims[2], dims[3]);
    B::float_reshape(B::float_swap_dims(x, 1, 2), Shape::new([n, t, h * dk]))
}

fn scale<B: Backend>(q: &FloatTensor<B>, heads: usize) -> f32 {
    1.0 / ((q.shape()[2] / heads) as f32).sqrt()
}

/// The context and the probabilities, as burn's attention computes them.
pub(crate) fn forward<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    heads: usize,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let t = q.shape()[1];
    let scale = scale::<B>(&q, heads);
    let device = q.device();
    let (q, k, v) = (
        split::<B>(q, heads),
        split::<B>(k, heads),
        split::<B>(v, heads),
    );
    let scores = B::float_mul_scalar(
        B::float_matmul(q, B::float_swap_dims(k, 2, 3)),
        scale.into(),
    );
    let mask: Vec<f32> = (0..t * t)
        .map(|i| {
            if i % t > i / t {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    let mask = B::float_from_data(TensorData::new(mask, [1, 1, t, t]), &device);
    let probs = B::softmax(B::float_add(scores, mask), 3);
    let out = merge::<B>(B::float_matmul(probs.clone(), v));
    (out, probs)
}

/// The gradients of `q`, `k`, `v` given the context's gradient `grad`.
pub(crate) fn backward<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    probs: FloatTensor<B>,
    grad: FloatTensor<B>,
    heads: usize,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let scale = scale::<B>(&q, heads);
    let [q, k, v, g] = [q, k, v, grad].map(|x| split::<B>(x, heads));
    let dv = B::float_matmul(B::float_swap_dims(probs.clone(), 2, 3), g.clone());
    let dp = B::float_matmul(g, B::float_swap_dims(v, 2, 3));
    let dot = B::float_sum_dim(B::float_mul(dp.clone(), probs.clone()), 3);
    let ds = B::float_mul_scalar(B::float_mul(probs, B::float_sub(dp, dot)), scale.into());
    let dq = B::float_matmul(ds.clone(), k);
    let dk = B::float_matmul(B::float_swap_dims(ds, 2, 3), q);
    (merge::<B>(dq), merge::<B>(dk), merge::<B>(dv))
}

/// The Q, K and V parts `[n, t, d]` of a packed `[n, t, 3d]` tensor.
fn unpack<B: Backend>(qkv: FloatTensor<B>) -> [FloatTensor<B>; 3] {
    let d = qkv.shape()[2] / 3;
    [0, 1, 2].map(|i| {
        B::float_slice(
            qkv.clone(),
            &[
                Slice::from(..),
                Slice::from(..),
                Slice::from(i * d..(i + 1) * d),
            ],
        )
    })
}

/// [`forward`] on Q, K and V packed in `qkv` `[n, t, 3d]`.
pub(crate) fn forward_packed<B: Backend>(
    qkv: FloatTensor<B>,
    heads: usize,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let [q, k, v] = unpack::<B>(qkv);
    forward::<B>(q, k, v, heads)
}

/// [`backward`] on Q, K and V packed in `qkv`: their gradients packed the same way.
pub(crate) fn backward_packed<B: Backend>(
    qkv: FloatTensor<B>,
    probs: FloatTensor<B>,
    grad: FloatTensor<B>,
    heads: usize,
) -> FloatTensor<B> {
    let [q, k, v] = unpack::<B>(qkv);
    let (dq, dk, dv) = backward::<B>(q, k, v, probs, grad, heads);
    B::float_cat(vec![dq, dk, dv], 2)
}
