//! Host kernels for the layers that dominate a CPU step, as burn **backend extensions**
//! ([`#[backend_extension]`](burn::backend::backend_extension), as [`crate::collective`]):
//! a fast path on Flex, burn's own ops on the other backends behind the same extensions, and
//! a hand-written backward on `Autodiff`. Each is tested against burn's op, outputs and
//! gradients.
//!
//! - [`linear`]: the linear layer with its bias and an optional ReLU fused; its GEMMs run on
//!   rayon's pool, split by shape alone (`gemm.rs`), so results are bitwise the same on any
//!   number of threads.
//! - [`max_pool`]: max pooling (a 2×2 stride-2 loop and a general one, `pool.rs`).
//! - `gelu`: GELU forward and backward in one vectorized pass each.
//! - `causal_attention` (`attention.rs`): `softmax(Q·Kᵀ/√dₖ + mask)·V` over the
//!   heads of Q, K, V packed in one `[n, t, 3d]` tensor, per (sample, head) on strided views
//!   (`attention_flex`), its backward from the kept probabilities; `reference`: the same in
//!   burn's ops, for the other backends.
//! - `layer_norm`: layer normalization forward (keeping each row's
//!   mean and `1/σ`) and backward (input, scale and shift gradients) in one pass each over
//!   blocks of rows (`norm_rows`), instead of burn's recorded chain of element-wise ops.
//! - `math`: the vectorizable `erf` and `exp` GELU and the attention's softmax use; `host`: Flex
//!   tensors as host memory.
//!
//! The release build targets baseline x86-64 (SSE2), as a binary shipped to any host must; the
//! element-wise and row kernels (GELU, layer norm, the attention's softmax) are compiled once
//! more for AVX2 + FMA by `multiversion` and picked at run time, as gemm and Flex pick theirs.
//! No operation is fused or reordered by it (Rust never contracts `a·b + c` into an FMA), so
//! both give the same bits. GEMM outputs are written by the product alone, never zeroed first.
//! - `backends`: the backends of every extension, listed once (the `#[backend_extension]`
//!   list and the impls on the backends running burn's own ops); `autodiff`: the recording of
//!   an op with its kept state on `Autodiff`, and the backward of an op with several inputs.

pub(crate) mod attention;
mod attention_flex;
pub(crate) mod autodiff;
pub(crate) mod backends;
pub(crate) mod gelu;
pub(crate) mod gemm;
pub(crate) mod gemm_rate;
pub(crate) mod host;
pub(crate) mod layer_norm;
pub mod linear;
mod math;
pub mod max_pool;
mod norm_rows;
mod pool;
mod reference;

#[cfg(test)]
mod layer_norm_tests;
#[cfg(test)]
mod linear_tests;
#[cfg(test)]
mod max_pool_tests;
#[cfg(test)]
mod tests;
