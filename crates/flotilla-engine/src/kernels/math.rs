//! Branch-free `f32` approximations of `erf` and `exp` that the compiler vectorizes (plain
//! arithmetic, no calls into libm), for the GELU kernels of [`super::gelu`] and the softmax of
//! the causal attention (`attention_flex.rs`).
//!
//! - [`erf`]: the rational minimax approximation Eigen and XLA use for `f32`
//!   (`x·P(x²)/Q(x²)` on `x` clamped to `[-4, 4]`), within 2 ulp-ish of libm's `erff`
//!   (checked to 5e-7 absolute below).
//! - [`exp_neg`]: Cephes' `expf` (range reduction by `ln 2` in two parts, a degree-6
//!   polynomial, the power of two put into the exponent bits) for arguments `≤ 0`, clamped at
//!   `-87` (where the result is below `1.7e-38`, and the GELU slope that uses it is `0` in f32).

/// `erf(x)`, within 5e-7 of libm's `erff`.
#[inline(always)]
pub(crate) fn erf(x: f32) -> f32 {
    let x = x.clamp(-4.0, 4.0);
    let x2 = x * x;
    let mut p = x2 * -2.726_142_3e-10 + 2.770_681_4e-8;
    p = p * x2 + -2.101_024e-6;
    p = p * x2 + -5.692_506_4e-5;
    p = p * x2 + -7.349_906_3e-4;
    p = p * x2 + -2.954_600_2e-3;
    p = p * x2 + -1.609_603_3e-2;
    let mut q = x2 * -1.456_607_2e-5 + -2.133_740_6e-4;
    q = q * x2 + -1.682_827e-3;
    q = q * x2 + -7.373_329e-3;
    q = q * x2 + -1.426_474e-2;
    x * p / q
}

/// `exp(v)` for `v ≤ 0` (relative error about 1e-7; `v < -87` counts as `-87`).
#[inline(always)]
pub(crate) fn exp_neg(v: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // Adding and subtracting 1.5·2^23 rounds to the nearest integer in f32 arithmetic.
    const ROUND: f32 = 12_582_912.0;
    let v = v.clamp(-87.0, 0.0);
    let shifted = v * LOG2E + ROUND;
    let n = shifted - ROUND;
    let r = v - n * 0.693_359_4 - n * -2.121_944_4e-4;
    let mut p = 1.987_569_1e-4 * r + 1.398_2e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let e = p * r * r + r + 1.0;
    // n is an integer in [-126, 0], held in the low bits of `shifted`'s mantissa (its
    // exponent is that of ROUND), read there rather than by `n as i32`, whose saturating
    // conversion does not vectorize; 2^n is the float with exponent bits n + 127.
    let n_int = shifted.to_bits() as i32 - ROUND.to_bits() as i32;
    let scale = f32::from_bits(((n_int + 127) as u32) << 23);
    e * scale
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grid() -> impl Iterator<Item = f32> {
        (-120_000..=120_000).map(|i| i as f32 * 1e-4)
    }

    #[test]
    fn erf_is_libm_erf_within_5e_7() {
        let worst = grid()
            .map(|x| (erf(x) - libm_erf(x)).abs())
            .fold(0.0f32, f32::max);
        assert!(worst < 5e-7, "worst |erf - erff| {worst}");
        assert_eq!(erf(0.0), 0.0);
        assert!((erf(30.0) - 1.0).abs() < 5e-7 && (erf(-30.0) + 1.0).abs() < 5e-7);
    }

    #[test]
    fn exp_neg_is_exp_within_3e_7_relative() {
        let worst = (0..=870_000)
            .map(|i| -(i as f32) * 1e-4)
            .map(|v| ((exp_neg(v) - v.exp()) / v.exp()).abs())
            .fold(0.0f32, f32::max);
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert!(exp_neg(-1e4) < 1e-37 && exp_neg(-1e4) >= 0.0);
    }

    fn libm_erf(x: f32) -> f32 {
        libm::erff(x)
    }
}
