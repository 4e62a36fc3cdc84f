//! The machine's measured GEMM rate: what a model's FLOP rate is a fraction of (`flotilla
//! bench gemm`). The product is the one every linear layer runs ([`super::gemm::gemm_into`]:
//! the `gemm` crate on pieces split over rayon's pool, all of its threads).

use std::time::Instant;

use super::gemm::{MatRef, gemm_into};

/// Floating-point operations per second of `dst = a · b` on square `size × size` matrices
/// (`2 size³` a product), the best of `reps` timed products after one untimed, on the
/// current rayon pool.
pub fn gemm_flops_per_s(size: usize, reps: usize) -> f64 {
    let a: Vec<f32> = (0..size * size)
        .map(|i| ((i * 7919) % 251) as f32 / 251.0 - 0.5)
        .collect();
    let b: Vec<f32> = a.iter().rev().copied().collect();
    let mut dst = vec![0.0f32; size * size];
    let mut best = f64::INFINITY;
    for rep in 0..=reps.max(1) {
        let started = Instant::now();
        gemm_into(
            &mut dst,
            MatRef::row_major(&a, size, size),
            MatRef::row_major(&b, size, size),
            false,
        );
        let took = started.elapsed().as_secs_f64();
        if rep > 0 {
            best = best.min(took);
        }
        std::hint::black_box(&dst);
    }
    2.0 * (size as f64).powi(3) / best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rate_is_positive_and_finite() {
        let rate = gemm_flops_per_s(64, 2);
        assert!(rate.is_finite() && rate > 1e6, "{rate}");
    }
}
