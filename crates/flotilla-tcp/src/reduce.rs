//! Reduction kernels and the bf16 wire encoding.

/// `dst[i] += src[i]` where `src` holds little-endian f32 bytes (`src.len() == 4 * dst.len()`).
pub(crate) fn add_assign_le_bytes(dst: &mut [f32], src: &[u8]) {
    debug_assert_eq!(src.len(), dst.len() * 4);
    if let Ok(aligned) = bytemuck::try_cast_slice::<u8, f32>(src) {
        add_assign(dst, aligned);
    } else {
        for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
            *d += f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
        }
    }
}

/// `dst[i] += src[i]`; a simple zip loop that LLVM vectorises.
#[inline]
pub(crate) fn add_assign(dst: &mut [f32], src: &[f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d += *s;
    }
}

/// `dst[i] = a[i] + b[i]` (all three of one length).
#[inline]
pub(crate) fn add_to(dst: &mut [f32], a: &[f32], b: &[f32]) {
    let (a, b) = (&a[..dst.len()], &b[..dst.len()]);
    for ((d, x), y) in dst.iter_mut().zip(a).zip(b) {
        *d = *x + *y;
    }
}

/// The two-rank reduction of one slice, written to both places in one pass:
/// `mine[i] = peer[i] = mine[i] + peer[i]`. IEEE 754 addition is commutative, so these are
/// the bits of the rank-order sum whichever rank's value is `mine`.
pub(crate) fn add_both(mine: &mut [f32], peer: &mut [f32]) {
    let peer = &mut peer[..mine.len()];
    for (m, p) in mine.iter_mut().zip(peer.iter_mut()) {
        let v = *m + *p;
        (*m, *p) = (v, v);
    }
}

/// Rounds an f32 to the nearest bf16 (round-to-nearest-even), returned as its 16 bits.
#[inline]
pub(crate) fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) as u16) | 0x40;
    }
    let round = 0x7FFF + ((b >> 16) & 1);
    (b.wrapping_add(round) >> 16) as u16
}

/// Widens bf16 bits to f32.
#[inline]
pub(crate) fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// Encodes `src` as little-endian bf16 into `out` (cleared first).
pub(crate) fn encode_bf16(src: &[f32], out: &mut Vec<u8>) {
    out.clear();
    out.reserve(src.len() * 2);
    out.extend(src.iter().flat_map(|&x| f32_to_bf16(x).to_le_bytes()));
}

/// `dst[i] += bf16(src[i])`.
pub(crate) fn add_assign_bf16(dst: &mut [f32], src: &[u8]) {
    debug_assert_eq!(src.len(), dst.len() * 2);
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *d += bf16_to_f32(u16::from_le_bytes([s[0], s[1]]));
    }
}

/// `dst[i] = bf16(src[i])`.
pub(crate) fn copy_bf16(dst: &mut [f32], src: &[u8]) {
    debug_assert_eq!(src.len(), dst.len() * 2);
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *d = bf16_to_f32(u16::from_le_bytes([s[0], s[1]]));
    }
}

/// Rounds every element to bf16 precision in place (so all ranks end bit-identical).
pub(crate) fn round_to_bf16(buf: &mut [f32]) {
    for x in buf {
        *x = bf16_to_f32(f32_to_bf16(*x));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn add_bytes_aligned_and_unaligned() {
        let src: Vec<f32> = (0..37).map(|i| i as f32).collect();
        let bytes: Vec<u8> = src.iter().flat_map(|x| x.to_le_bytes()).collect();
        let mut dst = vec![1.0f32; 37];
        add_assign_le_bytes(&mut dst, &bytes);
        let mut shifted = vec![0u8];
        shifted.extend_from_slice(&bytes);
        add_assign_le_bytes(&mut dst, &shifted[1..]);
        for (i, d) in dst.iter().enumerate() {
            assert_eq!(*d, 1.0 + 2.0 * i as f32);
        }
    }

    /// Both fused kernels give the bits of a plain `a + b`, written to both places.
    #[test]
    fn fused_sums_are_the_plain_sums_written_to_both_places() {
        let a: Vec<f32> = (0..37).map(|i| 1.0e7 * (i as f32).sin()).collect();
        let b: Vec<f32> = (0..37).map(|i| 0.37 * i as f32 - 3.0).collect();
        let want: Vec<u32> = a.iter().zip(&b).map(|(x, y)| (x + y).to_bits()).collect();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let mut d = vec![0.0f32; 37];
        add_to(&mut d, &a, &b);
        assert_eq!(bits(&d), want);
        let (mut m, mut p) = (a.clone(), b.clone());
        add_both(&mut m, &mut p);
        assert_eq!((bits(&m), bits(&p)), (want.clone(), want));
    }

    #[test]
    fn bf16_roundtrip() {
        for x in [0.0f32, 1.0, -2.0, 3.140625, 65280.0, f32::INFINITY] {
            assert_eq!(bf16_to_f32(f32_to_bf16(x)), x);
        }
        assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
        // Round to nearest even: 1 + 2^-8 is halfway between 1 and 1 + 2^-7.
        assert_eq!(bf16_to_f32(f32_to_bf16(1.0 + 1.0 / 256.0)), 1.0);
        let mut out = Vec::new();
        encode_bf16(&[1.5, -4.0], &mut out);
        let mut d = [0.0f32; 2];
        copy_bf16(&mut d, &out);
        assert_eq!(d, [1.5, -4.0]);
        add_assign_bf16(&mut d, &out);
        assert_eq!(d, [3.0, -8.0]);
    }
}
