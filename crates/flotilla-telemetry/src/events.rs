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
        /// Loss of the last step (NaN and infinities travel as `"NaN"`, `"inf"`, `"-inf"`).
        #[serde(with = "nonfinite::f32")]
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
        /// Named numbers (non-finite ones as for `loss`).
        #[serde(with = "nonfinite::figures")]
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

/// JSON has no NaN or infinity (serde_json writes `null`, which then does not parse as a
/// number): such values travel as the strings `"NaN"`, `"inf"` and `"-inf"`.
mod nonfinite {
    use std::collections::BTreeMap;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    #[derive(Serialize, Deserialize)]
    #[serde(untagged)]
    enum Wire {
        Number(f64),
        Text(String),
    }

    fn to_wire(v: f64) -> Wire {
        if v.is_finite() {
            Wire::Number(v)
        } else {
            Wire::Text(v.to_string())
        }
    }

    fn from_wire<E: serde::de::Error>(w: Wire) -> Result<f64, E> {
        match w {
            Wire::Number(v) => Ok(v),
            Wire::Text(t) => match t.as_str() {
                "NaN" => Ok(f64::NAN),
                "inf" => Ok(f64::INFINITY),
                "-inf" => Ok(f64::NEG_INFINITY),
                other => Err(E::custom(format!("`{other}` is not a number"))),
            },
        }
    }

    /// An `f32` field.
    pub mod f32 {
        use super::*;

        /// Writes a finite value as a JSON number, others as text.
        pub fn serialize<S: Serializer>(v: &f32, s: S) -> Result<S::Ok, S::Error> {
            if v.is_finite() {
                s.serialize_f32(*v)
            } else {
                s.serialize_str(&v.to_string())
            }
        }

        /// Reads a number or one of the texts.
        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f32, D::Error> {
            from_wire(Wire::deserialize(d)?).map(|v| v as f32)
        }
    }

    /// A map of named `f64` figures.
    pub mod figures {
        use super::*;

        /// Writes the map with non-finite values as text.
        pub fn serialize<S: Serializer>(
            m: &BTreeMap<String, f64>,
            s: S,
        ) -> Result<S::Ok, S::Error> {
            s.collect_map(m.iter().map(|(k, v)| (k, to_wire(*v))))
        }

        /// Reads the map.
        pub fn deserialize<'de, D: Deserializer<'de>>(
            d: D,
        ) -> Result<BTreeMap<String, f64>, D::Error> {
            BTreeMap::<String, Wire>::deserialize(d)?
                .into_iter()
                .map(|(k, w)| from_wire::<D::Error>(w).map(|v| (k, v)))
                .collect()
        }
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

    /// Equal numbers; NaN equals NaN, and an `f64` may move by a few units in the last place
    /// (serde_json's default parser is best-effort for 17-digit numbers).
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
                (step, total, epoch, epochs) == (s, t, e, es)
                    && close(f64::from(*loss), f64::from(*l))
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

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

        /// Any event, whatever its numbers (NaN and infinite losses too), parses back from
        /// its line.
        #[test]
        fn any_event_round_trips(e in event()) {
            let line = e.line();
            let back = RankEvent::parse(&line).expect("an event line");
            proptest::prop_assert!(back.is_ok(), "{} -> {:?}", line, back);
            let back = back.expect("valid");
            proptest::prop_assert!(same(&back, &e), "{:?} -> {} -> {:?}", e, line, back);
        }
    }

    /// Fuzzing found: a NaN or infinite loss (a diverged run) was written as `null`, and the
    /// launcher could not parse the event.
    #[test]
    fn non_finite_numbers_survive_a_line() {
        let e = RankEvent::Progress {
            step: 1,
            total: 2,
            epoch: 1,
            epochs: 1,
            loss: f32::NAN,
        };
        let line = e.line();
        assert!(line.ends_with(r#""loss":"NaN"}"#), "{line}");
        match RankEvent::parse(&line) {
            Some(Ok(RankEvent::Progress { loss, .. })) => assert!(loss.is_nan()),
            other => panic!("{other:?}"),
        }
        let f = RankEvent::Finished {
            role: "root".into(),
            figures: [
                ("a".to_string(), f64::INFINITY),
                ("b".to_string(), f64::NEG_INFINITY),
            ]
            .into(),
        };
        assert_eq!(
            RankEvent::parse(&f.line()).expect("event").expect("valid"),
            f
        );
        assert!(
            RankEvent::parse(r#"@event {"event":"failed","blamed":"x"}"#)
                .expect("event")
                .is_err()
        );
        assert!(
            RankEvent::parse(
                r#"@event {"event":"progress","step":1,"total":1,"epoch":1,"epochs":1,"loss":"x"}"#
            )
            .expect("event")
            .is_err()
        );
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
