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

/// Equal numbers; NaN equals NaN, and an `f64` may move by a few units in the last place
/// (serde_json's default float parser is best-effort for 17-digit numbers; accepted).
fn close(a: f64, b: f64) -> bool {
    a == b || (a.is_nan() && b.is_nan()) || a.to_bits().abs_diff(b.to_bits()) <= 16
}

/// Whether two events carry the same values (see [`close`]).
fn same(a: &RankEvent, b: &RankEvent) -> bool {
    match (a, b) {
        (
            RankEvent::Progress {
                step,
                total,
                epoch,
                epochs,
                loss,
            },
            RankEvent::Progress {
                step: s,
                total: t,
                epoch: e,
                epochs: es,
                loss: l,
            },
        ) => {
            (step, total, epoch, epochs) == (s, t, e, es) && close(f64::from(*loss), f64::from(*l))
        }
        (
            RankEvent::Finished { role, figures },
            RankEvent::Finished {
                role: r,
                figures: f,
            },
        ) => {
            role == r
                && figures.len() == f.len()
                && figures
                    .iter()
                    .zip(f)
                    .all(|((k, v), (k2, v2))| k == k2 && close(*v, *v2))
        }
        _ => a == b,
    }
}

/// An event's line must parse back to the same event.
fn round_trip(e: &RankEvent) {
    let line = e.line();
    match RankEvent::parse(&line) {
        Some(Ok(back)) => assert!(same(&back, e), "{e:?} -> {line} -> {back:?}"),
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
