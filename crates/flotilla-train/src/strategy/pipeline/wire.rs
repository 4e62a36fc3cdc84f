//! How pipeline tensors travel: tags and payloads of the point-to-point messages between
//! stages.
//!
//! A tag is `(direction << 30) | (crossing << 20) | micro_batch`: the direction (forward
//! activation, backward gradient, evaluation activation), the crossing's index in the
//! list of crossings every rank derives alike (`flotilla_engine::StageCut::crossings`: cut
//! from a spec, or routed by the names a user's stage modules declare), so it names the
//! tensor, and the micro-batch (or evaluation chunk) modulo 2^20. Messages with the same tag
//! from the same sender arrive in order, so chunk numbers may wrap. Every tag is below
//! [`flotilla_tcp::tags::RESERVED`]. The payload is the tensor's `f32` values, little-endian,
//! row-major, with no header: its length is checked against the crossing's shape (a user's
//! stage modules' shapes are learned before training, from a one-sample forward pass).

use flotilla_tcp::Tag;

/// Which way a message goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// An activation, downstream, during training.
    Forward = 0,
    /// An activation's gradient, upstream.
    Backward = 1,
    /// An activation, downstream, during evaluation.
    Eval = 2,
    /// A stage's weights or optimizer state, to or from the rank that writes checkpoints
    /// (the crossing field numbers the part).
    State = 3,
}

/// Most crossings a cut may have (the tag has 10 bits for them).
pub const MAX_CROSSINGS: usize = 1 << 10;

/// Most micro-batches per batch (the tag has 20 bits for them).
pub const MAX_MICRO_BATCHES: usize = 1 << 20;

/// The tag of crossing `crossing` for micro-batch `mb` going `dir`.
pub fn tag(dir: Direction, crossing: usize, mb: usize) -> Tag {
    ((dir as u32) << 30)
        | (((crossing % MAX_CROSSINGS) as u32) << 20)
        | ((mb % MAX_MICRO_BATCHES) as u32)
}

/// The payload of a tensor.
pub fn encode(values: &[f32]) -> &[u8] {
    bytemuck::cast_slice(values)
}

/// The tensor in a payload, if it has exactly `expected` values (the payload's length, itself
/// bounded by the frame limit, is checked before anything is allocated).
pub fn decode(bytes: &[u8], expected: usize) -> Option<Vec<f32>> {
    if expected.checked_mul(4) != Some(bytes.len()) {
        return None;
    }
    let mut values = vec![0.0f32; expected];
    bytemuck::cast_slice_mut::<f32, u8>(&mut values).copy_from_slice(bytes);
    Some(values)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_payload_of_another_length_is_refused_without_allocating() {
        assert_eq!(decode(&[0; 8], 2), Some(vec![0.0, 0.0]));
        assert_eq!(decode(&[0; 8], 3), None);
        // An expected length whose byte size overflows never matches (nor wraps around).
        assert_eq!(decode(&[], usize::MAX / 4 + 1), None);
        assert_eq!(decode(&[0; 4], usize::MAX), None);
    }

    #[test]
    fn tags_are_distinct_and_below_the_reserved_range() {
        let mut seen = std::collections::HashSet::new();
        for dir in [Direction::Forward, Direction::Backward, Direction::Eval] {
            for c in [0, 1, MAX_CROSSINGS - 1] {
                for mb in [0, 1, MAX_MICRO_BATCHES - 1] {
                    let t = tag(dir, c, mb);
                    assert!(t < flotilla_tcp::tags::RESERVED);
                    assert!(seen.insert(t), "{dir:?} {c} {mb}");
                }
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

        #[test]
        fn any_tensor_round_trips(bits in proptest::collection::vec(proptest::prelude::any::<u32>(), 0..64)) {
            let v: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
            let back = decode(encode(&v), v.len()).expect("right length");
            proptest::prop_assert_eq!(encode(&back), encode(&v));
        }
    }

    #[test]
    fn payloads_round_trip_and_wrong_lengths_are_refused() {
        let v = [1.5f32, -2.0, f32::MIN_POSITIVE];
        assert_eq!(decode(encode(&v), 3), Some(v.to_vec()));
        assert_eq!(decode(encode(&v), 4), None);
        assert_eq!(decode(&[0u8; 5], 1), None);
    }

    /// Fuzzing found: an expected length whose byte size overflows panicked (overflow check).
    #[test]
    fn an_expected_length_beyond_memory_is_refused() {
        assert_eq!(decode(&[0u8; 4], usize::MAX), None);
        assert_eq!(decode(&[], usize::MAX / 4 + 1), None);
    }
}
