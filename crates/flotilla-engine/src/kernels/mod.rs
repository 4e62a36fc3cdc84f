//! Host kernels for the layers that dominate a CPU step, as burn **backend extensions** on Flex
//! (other backends run burn's own ops behind the same extensions): the linear layer with its
//! bias and an optional ReLU fused ([`linear`]), and max pooling ([`max_pool`]). Each has a
//! hand-written backward on `Autodiff`. Their GEMMs run on rayon's pool, split by shape alone
//! (`gemm.rs`), so results are bitwise the same on any number of threads.

mod gemm;
mod host;
pub mod linear;
pub mod max_pool;
mod pool;

#[cfg(test)]
mod linear_tests;
#[cfg(test)]
mod max_pool_tests;
