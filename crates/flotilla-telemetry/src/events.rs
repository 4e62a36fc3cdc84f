//! Machine-readable events from a rank to its launcher: one JSON object per stdout line,
//! after [`EVENT_PREFIX`], so that nothing parses human text.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Prefix of an event line on a rank's stdout.
pub const EVENT_PREFIX: &str = "@event ";

/// What a rank reports.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum RankEvent {
    /// Training progress (throttled by the rank).
    Progress {
        /// Steps done.
        step: u64,
        /// Steps planned.
        total: u64,
        /// 1-based epoch.
        epoch: u32,
        /// Epochs planned.
        epochs: u32,
        /// Loss of the last step.
        loss: f32,
    },
    /// The rank failed, and the failure points at rank `blamed` (possibly itself).
    Failed {
        /// The rank to blame.
        blamed: usize,
    },
    /// The rank finished: its role and figures (`test_acc`, `steps`, `wall_s`, and the
    /// role's own, e.g. a root's `updates_per_s` and `bytes_per_round`).
    Finished {
        /// The rank's role.
        role: String,
        /// Named numbers.
        figures: BTreeMap<String, f64>,
    },
}

impl RankEvent {
    /// The stdout line carrying this event.
    pub fn line(&self) -> String {
        // Serializing these plain enums cannot fail.
        let json = serde_json::to_string(self).unwrap_or_else(|_| "{}".into());
        format!("{EVENT_PREFIX}{json}")
    }

    /// The event on `line`, if it is an event line; `Some(Err)` if it is one but malformed.
    pub fn parse(line: &str) -> Option<Result<Self, serde_json::Error>> {
        line.strip_prefix(EVENT_PREFIX).map(serde_json::from_str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::{Strategy, any};

    fn event() -> impl Strategy<Value = RankEvent> {
        proptest::prop_oneof![
            (
                any::<u64>(),
                any::<u64>(),
                any::<u32>(),
                any::<u32>(),
                any::<u32>()
            )
                .prop_map(|(step, total, epoch, epochs, loss)| RankEvent::Progress {
                    step,
                    total,
                    epoch,
                    epochs,
                    loss: f32::from_bits(loss),
                }),
            any::<usize>().prop_map(|blamed| RankEvent::Failed { blamed }),
            (
                any::<String>(),
                proptest::collection::btree_map(any::<String>(), any::<u64>(), 0..4)
            )
                .prop_map(|(role, figures)| RankEvent::Finished {
                    role,
                    figures: figures
                        .into_iter()
                        .map(|(k, v)| (k, f64::from_bits(v)))
                        .collect(),
                }),
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

        /// Any event, whatever its numbers (NaN and infinite losses too), parses back from
        /// its line (compared by line, so NaN counts as equal).
        #[test]
        fn any_event_round_trips(e in event()) {
            let line = e.line();
            let back = RankEvent::parse(&line).expect("an event line");
            proptest::prop_assert!(back.is_ok(), "{} -> {:?}", line, back);
            proptest::prop_assert_eq!(back.expect("valid").line(), line);
        }
    }

    #[test]
    fn events_round_trip_through_a_line() {
        let events = [
            RankEvent::Progress {
                step: 3,
                total: 10,
                epoch: 1,
                epochs: 2,
                loss: 0.5,
            },
            RankEvent::Failed { blamed: 2 },
            RankEvent::Finished {
                role: "root".into(),
                figures: [("test_acc".to_string(), 0.99)].into(),
            },
        ];
        for e in events {
            let line = e.line();
            assert!(line.starts_with("@event {\"event\":"), "{line}");
            assert_eq!(RankEvent::parse(&line).expect("event").expect("valid"), e);
        }
        assert!(RankEvent::parse("[rank 0] epoch 1").is_none());
        assert!(
            RankEvent::parse("@event {\"event\":\"nope\"}")
                .expect("event")
                .is_err()
        );
    }
}
