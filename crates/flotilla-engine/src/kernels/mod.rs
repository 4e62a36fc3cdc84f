//! Fused CPU kernels for the sequence models, as burn **backend extensions**
//! ([`#[backend_extension]`](burn::backend::backend_extension), as
//! [`crate::collective`]): a fast path on Flex, burn's own ops on the other backends, and a
//! hand-written backward on `Autodiff`. Each is tested against burn's op, outputs and
//! gradients.
//!
//! - [`gelu`](gelu::gelu): GELU forward and backward in one vectorized pass each.
//! - [`causal_attention`](attention::causal_attention): `softmax(Q·Kᵀ/√dₖ + mask)·V` over the
//!   heads, per (sample, head) on strided views (`attention_flex`), its backward from the kept
//!   probabilities; `reference`: the same in burn's ops, for the other backends.
//! - `math`: the vectorizable `erf` and `exp` GELU uses; `host`: Flex tensors as `f32` slices.

pub(crate) mod attention;
mod attention_flex;
pub(crate) mod gelu;
mod host;
mod math;
mod reference;

#[cfg(test)]
mod tests;
