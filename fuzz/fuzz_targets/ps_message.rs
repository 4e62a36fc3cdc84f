//! The parameter-server message codec. Properties: garbage is an error naming the sender,
//! never a panic, and a claimed length never allocates beyond the input; a decoded message
//! re-encodes to bytes that decode to the same message; an arbitrary message survives
//! encode → decode (compared by encoding, so NaN values count as equal bit patterns).
#![no_main]

use flotilla_ps::PsMessage;
use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;

fn floats(u: &mut Unstructured<'_>) -> Result<Vec<f32>> {
    let n = u.int_in_range(0..=64)?;
    (0..n).map(|_| Ok(f32::from_bits(u.arbitrary()?))).collect()
}

fn message_from(u: &mut Unstructured<'_>) -> Result<PsMessage> {
    Ok(match u.int_in_range(0..=6)? {
        0 => PsMessage::Pull,
        1 => PsMessage::Push {
            version: u.arbitrary()?,
            staleness: u.arbitrary()?,
            samples: u.arbitrary()?,
            loss: f32::from_bits(u.arbitrary()?),
            delta: u.arbitrary()?,
            values: floats(u)?,
        },
        2 => PsMessage::Params {
            version: u.arbitrary()?,
            values: floats(u)?,
        },
        3 => PsMessage::Reject {
            reason: u.arbitrary()?,
            retry: u.arbitrary()?,
        },
        4 => PsMessage::Stop {
            reason: u.arbitrary()?,
        },
        5 => PsMessage::State {
            bytes: u.arbitrary()?,
        },
        _ => PsMessage::Gather {
            version: u.arbitrary()?,
            state: u.arbitrary()?,
        },
    })
}

fuzz_target!(|data: &[u8]| {
    match PsMessage::decode(data, 7) {
        Ok(m) => {
            let bytes = m.encode();
            let again = PsMessage::decode(&bytes, 7).expect("own encoding decodes");
            assert_eq!(again.encode(), bytes, "{} does not round-trip", m.name());
        }
        Err(e) => assert!(e.to_string().contains("rank 7"), "{e}"),
    }
    if let Ok(m) = message_from(&mut Unstructured::new(data)) {
        let bytes = m.encode();
        let back = PsMessage::decode(&bytes, 7).expect("own encoding decodes");
        assert_eq!(back.encode(), bytes);
    }
});
