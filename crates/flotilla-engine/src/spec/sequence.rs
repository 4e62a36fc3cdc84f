//! The forward passes of the sequence layers, on burn's own modules, and the check of token
//! ids.
//!
//! - `embedding`: burn's `Embedding` (weight `[vocab, dim]`, PyTorch's `nn.Embedding`
//!   layout) on the token ids of the input, which arrive as `f32` values (exact integers, checked
//!   by [`check_tokens`] before any tensor exists) and are cast to integers here.
//! - `pos_embedding`: the weight `[max_len, d]` of a burn `Embedding`, whose first `T` rows are
//!   added to every sample (burn has no learned positional embedding; its `PositionalEncoding`
//!   is the fixed sinusoidal one).
//! - `attention`: burn's `MultiHeadAttention` (separate `query`, `key`, `value` and `output`
//!   linear layers with biases, scores scaled by `1/sqrt(d/heads)`), causal as with the mask of
//!   `generate_autoregressive_mask` (position `i` attends to `0..=i`); its projections run
//!   through the fused linear kernel of [`crate::kernels`] (bias in the GEMM) and between them
//!   the fused causal attention runs instead of burn's score, mask, softmax and head
//!   split/merge ops.
//! - `transformer_block`: burn's `TransformerEncoderLayer` with `norm_first` (pre-LN), no
//!   dropout, and the same causal mask. Its tensors keep burn's names: `mha.{query,key,value,
//!   output}`, `pwff.linear_inner` and `pwff.linear_outer` (GELU between them), and the two
//!   layer norms `norm_2` (before the attention: burn names them for the post-LN order) and
//!   `norm_1` (before the MLP). Its forward is written out here (the same sums in the same
//!   order as burn's) so that its layer norms, linear layers and GELU are the fused kernels of
//!   [`crate::kernels`].

use burn::nn::attention::MultiHeadAttention;
use burn::nn::transformer::TransformerEncoderLayer;
use burn::nn::{Embedding, Linear};
use burn::prelude::*;

use crate::error::{EngineError, Result};
use crate::kernels;
use crate::kernels::gelu::gelu;
use crate::kernels::layer_norm::layer_norm;
use crate::kernels::linear::linear;

/// Checks that every value of `ids` (a batch's token input) is an integer in `0..vocab`.
pub(crate) fn check_tokens(ids: &[f32], vocab: usize) -> Result<()> {
    let bad = ids
        .iter()
        .position(|&v| !(v >= 0.0 && v.fract() == 0.0 && (v as f64) < vocab as f64));
    match bad {
        None => Ok(()),
        Some(i) => Err(EngineError::Batch(format!(
            "token id {} at input value {i} is not an integer in 0..{vocab} (the embedding's vocab)",
            ids[i]
        ))),
    }
}

/// The embeddings `[n, t, dim]` of token ids `[n, t]` (checked integers, as floats).
pub(crate) fn embed_tokens(table: &Embedding, ids: Tensor<2>) -> Tensor<3> {
    table.forward(ids.int())
}

/// `x` `[n, t, d]` plus the first `t` rows of the positional table.
pub(crate) fn add_positions(table: &Embedding, x: Tensor<3>) -> Tensor<3> {
    let [_, t, _] = x.dims();
    let rows: Tensor<2> = table.weight.val().slice(0..t);
    x + rows.unsqueeze::<3>()
}

/// Causal multi-head self-attention on `x` `[n, t, d]`: burn's `MultiHeadAttention` (its
/// projections, no dropout) with the fused core of [`crate::kernels`] between them.
pub(crate) fn causal_attention(attention: &MultiHeadAttention, x: Tensor<3>) -> Tensor<3> {
    // One product for the three projections: their weights side by side `[d, 3d]` (and their
    // biases), so the input is packed once forward and its gradient is one product backward,
    // not three added together.
    let parts = [&attention.query, &attention.key, &attention.value];
    let w = Tensor::cat(parts.map(|p| p.weight.val()).to_vec(), 1);
    let bias = parts.iter().any(|p| p.bias.is_some()).then(|| {
        let of = |p: &Linear| match &p.bias {
            Some(b) => b.val(),
            None => Tensor::zeros([p.weight.dims()[1]], &p.weight.device()),
        };
        Tensor::cat(parts.map(of).to_vec(), 0)
    });
    let qkv = kernels::linear::linear_of(w, bias, x, false);
    let context = kernels::attention::causal_attention(qkv, attention.n_heads);
    linear(&attention.output, context, false)
}

/// A pre-LN transformer block with causal attention on `x` `[n, t, d]`: burn's
/// `TransformerEncoderLayer::forward` with `norm_first` and no dropout, its layer norms, linear
/// layers and GELU the fused kernels.
pub(crate) fn block(block: &TransformerEncoderLayer, x: Tensor<3>) -> Tensor<3> {
    let x = x.clone() + causal_attention(&block.mha, layer_norm(&block.norm_2, x));
    let mlp = &block.pwff;
    let hidden = gelu(linear(
        &mlp.linear_inner,
        layer_norm(&block.norm_1, x.clone()),
        false,
    ));
    x + linear(&mlp.linear_outer, hidden, false)
}
