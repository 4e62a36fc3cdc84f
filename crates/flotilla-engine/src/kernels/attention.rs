//! Causal multi-head self-attention's core, `softmax(Q·Kᵀ/√dₖ + causal mask)·V` over the heads
//! of projected `q`, `k`, `v` `[n, t, d]`, as a burn backend extension: on Flex one pass per
//! (sample, head) through `gemm` on the heads' strided columns (no head split or merge copies,
//! no mask tensor, the softmax over each row's visible prefix only) and a hand-written backward
//! from the kept probabilities (`dV = Pᵀ·dO`, `dS = P ∘ (dO·Vᵀ − rowsum)`, `dQ = dS·K/√dₖ`,
//! `dK = dSᵀ·Q/√dₖ`); burn's ops ([`reference`]) on the other backends.
//!
//! The result is burn's `MultiHeadAttention` between its input and output projections with the
//! mask of `generate_autoregressive_mask` (position `i` sees `0..=i`): burn fills masked scores
//! with `-1e4`, whose `exp` is `0` in `f32` as the skipped entries here are.

// burn 0.22 deprecates NdArray and LibTorch but still ships them: the extension names them.
#![cfg_attr(any(feature = "ndarray", feature = "libtorch"), allow(deprecated))]

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, Flex};
use burn::prelude::*;
use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops};

use super::attention_flex::{Heads, backward_f32, forward_f32};
use super::autodiff::{fused, record};
use super::backends::{engine_extension, impl_on_burn_backends};
use super::host::contiguous_f32_all;
use super::reference;

engine_extension! {
    /// The backend side of [`causal_attention`]: `q`, `k`, `v` and the context are `[n, t, d]`,
    /// the probabilities `[n, heads, t, t]` (zero above the diagonal).
    pub trait CausalAttentionOps: Backend {
        /// The context of causal attention over `heads` heads.
        fn causal_attention(
            q: FloatTensor<Self>,
            k: FloatTensor<Self>,
            v: FloatTensor<Self>,
            heads: usize,
        ) -> FloatTensor<Self> {
            Self::causal_attention_probs(q, k, v, heads).0
        }

        /// The context and the attention probabilities (what the backward needs).
        fn causal_attention_probs(
            q: FloatTensor<Self>,
            k: FloatTensor<Self>,
            v: FloatTensor<Self>,
            heads: usize,
        ) -> (FloatTensor<Self>, FloatTensor<Self>) {
            reference::forward::<Self>(q, k, v, heads)
        }

        /// The gradients of `q`, `k` and `v` given the context's gradient `grad`.
        fn causal_attention_backward(
            q: FloatTensor<Self>,
            k: FloatTensor<Self>,
            v: FloatTensor<Self>,
            probs: FloatTensor<Self>,
            grad: FloatTensor<Self>,
            heads: usize,
        ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
            reference::backward::<Self>(q, k, v, probs, grad, heads)
        }
    }
}

impl CausalAttentionOps for Flex {
    fn causal_attention_probs(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        heads: usize,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        match contiguous_f32_all([&q, &k, &v]) {
            Some([q, k, v]) => forward_f32(&q, &k, &v, Heads::of(&q, heads)),
            None => reference::forward::<Self>(q, k, v, heads),
        }
    }

    fn causal_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        probs: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        heads: usize,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        match contiguous_f32_all([&q, &k, &v, &probs, &grad]) {
            Some([q, k, v, p, g]) => backward_f32([&q, &k, &v, &p, &g], Heads::of(&q, heads)),
            None => reference::backward::<Self>(q, k, v, probs, grad, heads),
        }
    }
}

// NdArray, LibTorch and wgpu's `Cube`: burn's own ops ([`reference`]).
impl_on_burn_backends!(CausalAttentionOps);

/// The attention's backward: the backend's, from the kept inputs and probabilities.
#[derive(Debug)]
struct AttentionBackward;

/// What the backward keeps: `q`, `k`, `v`, the probabilities and the number of heads.
type Kept<B> = (
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    usize,
);

impl<B: Backend + CausalAttentionOps> Backward<B, 3> for AttentionBackward {
    type State = Kept<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        fused::<B, _, 3>(ops, grads, |(q, k, v, probs, heads), grad| {
            let (dq, dk, dv) = B::causal_attention_backward(q, k, v, probs, grad, heads);
            [dq, dk, dv]
        });
    }
}

impl<B: Backend + CausalAttentionOps, C: CheckpointStrategy> CausalAttentionOps for Autodiff<B, C> {
    fn causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        heads: usize,
    ) -> FloatTensor<Self> {
        let nodes = [q.node(), k.node(), v.node()];
        record(
            AttentionBackward.prepare::<C>(nodes),
            [q, k, v].map(|t| t.into_primitive()),
            |[q, k, v]| {
                let (out, probs) =
                    B::causal_attention_probs(q.clone(), k.clone(), v.clone(), heads);
                (out, (q, k, v, probs, heads))
            },
            |[q, k, v]| B::causal_attention(q, k, v, heads),
        )
    }
}

/// Causal self-attention's context `[n, t, d]` of the projections `q`, `k`, `v` `[n, t, d]`
/// over `heads` heads of `d / heads` features (scores scaled by `1/√(d/heads)`),
/// differentiable; fused on Flex.
pub(crate) fn causal_attention(
    q: Tensor<3>,
    k: Tensor<3>,
    v: Tensor<3>,
    heads: usize,
) -> Tensor<3> {
    Tensor::from_dispatch(<Dispatch as CausalAttentionOps>::causal_attention(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        heads,
    ))
}
