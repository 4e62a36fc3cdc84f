//! Causal multi-head self-attention's core, `softmax(Q·Kᵀ/√dₖ + causal mask)·V` over the heads
//! of the projections Q, K, V `[n, t, d]` packed side by side in one `[n, t, 3d]` tensor (the
//! output of one product of the three projections, `spec/sequence.rs::causal_attention`; its
//! gradient comes back packed the same way, one product for the input's gradient), as a burn
//! backend extension: on Flex one pass per
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
use burn_autodiff::ops::{Backward, Ops, unary};

use super::attention_flex::{Heads, backward_f32, forward_f32};
use super::autodiff::record;
use super::backends::{engine_extension, impl_on_burn_backends};
use super::host::{contiguous_f32, contiguous_f32_all};
use super::reference;

engine_extension! {
    /// The backend side of [`causal_attention`]: `qkv` is Q, K and V `[n, t, d]` packed along
    /// the features as `[n, t, 3d]` (the one product of the three projections), the context
    /// `[n, t, d]`, the probabilities `[n, heads, t, t]` (zero above the diagonal).
    pub trait CausalAttentionOps: Backend {
        /// The context of causal attention over `heads` heads.
        fn causal_attention(qkv: FloatTensor<Self>, heads: usize) -> FloatTensor<Self> {
            Self::causal_attention_probs(qkv, heads).0
        }

        /// The context and the attention probabilities (what the backward needs).
        fn causal_attention_probs(
            qkv: FloatTensor<Self>,
            heads: usize,
        ) -> (FloatTensor<Self>, FloatTensor<Self>) {
            reference::forward_packed::<Self>(qkv, heads)
        }

        /// The gradients of Q, K and V, packed as `qkv` is, given the context's gradient
        /// `grad`.
        fn causal_attention_backward(
            qkv: FloatTensor<Self>,
            probs: FloatTensor<Self>,
            grad: FloatTensor<Self>,
            heads: usize,
        ) -> FloatTensor<Self> {
            reference::backward_packed::<Self>(qkv, probs, grad, heads)
        }
    }
}

impl CausalAttentionOps for Flex {
    fn causal_attention_probs(
        qkv: FloatTensor<Self>,
        heads: usize,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        match contiguous_f32(&qkv) {
            Some(qkv) => forward_f32(&qkv, Heads::of(&qkv, heads)),
            None => reference::forward_packed::<Self>(qkv, heads),
        }
    }

    fn causal_attention_backward(
        qkv: FloatTensor<Self>,
        probs: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        heads: usize,
    ) -> FloatTensor<Self> {
        match contiguous_f32_all([&qkv, &probs, &grad]) {
            Some([qkv, p, g]) => backward_f32([&qkv, &p, &g], Heads::of(&qkv, heads)),
            None => reference::backward_packed::<Self>(qkv, probs, grad, heads),
        }
    }
}

// NdArray, LibTorch and wgpu's `Cube`: burn's own ops ([`reference`]).
impl_on_burn_backends!(CausalAttentionOps);

/// Causal attention's backward: the packed Q, K, V's gradient from the kept inputs and
/// probabilities.
#[derive(Debug)]
struct AttentionBackward;

impl<B: Backend + CausalAttentionOps> Backward<B, 1> for AttentionBackward {
    type State = (FloatTensor<B>, FloatTensor<B>, usize);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (qkv, probs, heads) = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            B::causal_attention_backward(qkv, probs, grad, heads)
        });
    }
}

impl<B: Backend + CausalAttentionOps, C: CheckpointStrategy> CausalAttentionOps for Autodiff<B, C> {
    fn causal_attention(qkv: FloatTensor<Self>, heads: usize) -> FloatTensor<Self> {
        let (qkv, node) = qkv.into_parts();
        record(
            AttentionBackward.prepare::<C>([node]),
            qkv,
            |qkv| {
                let (out, probs) = B::causal_attention_probs(qkv.clone(), heads);
                (out, (qkv, probs, heads))
            },
            |qkv| B::causal_attention(qkv, heads),
        )
    }
}

/// Causal self-attention's context `[n, t, d]` of the projections Q, K, V packed in `qkv`
/// `[n, t, 3d]` over `heads` heads of `d / heads` features (scores scaled by `1/√(d/heads)`),
/// differentiable; fused on Flex.
pub(crate) fn causal_attention(qkv: Tensor<3>, heads: usize) -> Tensor<3> {
    Tensor::from_dispatch(<Dispatch as CausalAttentionOps>::causal_attention(
        qkv.into_dispatch(),
        heads,
    ))
}
