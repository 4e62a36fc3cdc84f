//! The pipeline's tensor payload decoders: a plain payload with an arbitrary expected length
//! (the first 8 bytes), and the whole input as a shaped payload. Properties: never a panic; a
//! plain payload decodes exactly when it holds `expected` values, and a decoded payload of
//! either kind re-encodes to the same bytes.
#![no_main]

use flotilla_tcp::pipeline::wire;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok((dims, values)) = wire::decode_shaped(data) {
        assert_eq!(wire::encode_shaped(&dims, &values), data);
    }
    let Some((head, payload)) = data.split_first_chunk::<8>() else {
        return;
    };
    let expected = u64::from_le_bytes(*head) as usize;
    match wire::decode(payload, expected) {
        Some(values) => {
            assert_eq!(values.len(), expected);
            assert_eq!(wire::encode(&values), payload);
        }
        None => assert_ne!(Some(payload.len()), expected.checked_mul(4)),
    }
});
