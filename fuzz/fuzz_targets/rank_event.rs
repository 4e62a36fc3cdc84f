//! The launcher's parser of rank event lines (`@event {json}`). Properties: garbage is an
//! error (or not an event line), never a panic; a parsed event's line parses to the same
//! event; an arbitrary event (any loss, any figures) survives line → parse.
#![no_main]

use std::collections::BTreeMap;

use flotilla_telemetry::RankEvent;
use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;

fn event_from(u: &mut Unstructured<'_>) -> Result<RankEvent> {
    Ok(match u.int_in_range(0..=2)? {
        0 => RankEvent::Progress {
            step: u.arbitrary()?,
            total: u.arbitrary()?,
            epoch: u.arbitrary()?,
            epochs: u.arbitrary()?,
            loss: f32::from_bits(u.arbitrary()?),
        },
        1 => RankEvent::Failed {
            blamed: u.arbitrary()?,
        },
        _ => {
            let n = u.int_in_range(0..=4)?;
            let mut figures = BTreeMap::new();
            for _ in 0..n {
                figures.insert(u.arbitrary::<String>()?, f64::from_bits(u.arbitrary()?));
            }
            RankEvent::Finished {
                role: u.arbitrary()?,
                figures,
            }
        }
    })
}

/// An event's line must parse back to an event whose line is the same.
fn round_trip(e: &RankEvent) {
    let line = e.line();
    match RankEvent::parse(&line) {
        Some(Ok(back)) => assert_eq!(back.line(), line),
        other => panic!("{line:?} does not parse back: {other:?}"),
    }
}

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    if let Some(Ok(e)) = RankEvent::parse(&text) {
        round_trip(&e);
    }
    if let Ok(e) = event_from(&mut Unstructured::new(data)) {
        round_trip(&e);
    }
});
