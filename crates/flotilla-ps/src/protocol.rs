//! The parameter-server wire messages, carried as point-to-point payloads under [`TAG`]. Every message that carries numbers says which parameter version it was
//! computed from or holds.
//!
//! Layout (little endian): `kind: u8`, then per kind:
//! - `Pull`: nothing.
//! - `Push`: `version: u64, staleness: u32, samples: u32, loss: f32, delta: u8, len: u64,
//!   len x f32`.
//! - `Params`: `version: u64, len: u64, len x f32`.
//! - `Reject`: `retry: u8`, then as `Stop`.
//! - `Stop` / `Abort`: `len: u32, len bytes of UTF-8 reason`.
//! - `Gather`: `version: u64`.
//! - `Members`: `len: u32, len x u32` (ranks, ascending).

use flotilla_group::{CommError, Tag};

type Result<T> = std::result::Result<T, CommError>;

/// The point-to-point tag of parameter-server messages.
pub const TAG: Tag = 1;

const PULL: u8 = 1;
const PUSH: u8 = 2;
const PARAMS: u8 = 3;
const REJECT: u8 = 4;
const STOP: u8 = 5;
const GATHER: u8 = 6;
const ABORT: u8 = 7;
const STATE: u8 = 8;
const MEMBERS: u8 = 9;

/// One parameter-server message.
#[derive(Debug, Clone, PartialEq)]
pub enum PsMessage {
    /// Child → parent: send me your current parameters.
    Pull,
    /// Child → parent: a gradient (or, for model averaging, a weight delta) computed from the
    /// parameters of `version` on `samples` samples.
    Push {
        /// The parameter version the values were computed from.
        version: u64,
        /// Staleness already accrued below the sender (an asynchronous local server pushes the
        /// mean of gradients computed on older versions than `version`); 0 from workers.
        staleness: u32,
        /// How many samples they summarise (the averaging weight).
        samples: u32,
        /// Mean training loss over those samples.
        loss: f32,
        /// `true`: `values` is a weight delta (model averaging), `false`: a gradient.
        delta: bool,
        /// The flat gradient or delta.
        values: Vec<f32>,
    },
    /// Parent → child: the parameters of `version`.
    Params {
        /// The version.
        version: u64,
        /// The flat parameters.
        values: Vec<f32>,
    },
    /// Parent → child: the last push was refused (and changed nothing).
    Reject {
        /// Why.
        reason: String,
        /// Whether a push computed on newer parameters may be taken (it was stale): pull and
        /// recompute. `false`: the same refusal would follow every retry (its length, kind or
        /// claimed samples, values that are not finite in a sync round), so the child stops.
        retry: bool,
    },
    /// Parent → child: training is over.
    Stop {
        /// Why (target reached, rounds done, ...).
        reason: String,
    },
    /// Any rank → its parameter-server peers: the sender failed (a lost or silent rank, a
    /// refused message) and the job cannot go on; `reason` is its error, which names the rank
    /// at fault, so that every rank of the tree fails naming it, not only its neighbours.
    Abort {
        /// The sender's error.
        reason: String,
    },
    /// Root → shard server: send me your shard once it has reached `version` (for evaluation
    /// and the checkpoint), and with `state` your optimizer's state after it.
    Gather {
        /// The version the shard must have reached (0: whatever it has).
        version: u64,
        /// Whether the optimizer state follows the shard (a [`PsMessage::State`]).
        state: bool,
    },
    /// Shard server → root: its optimizer's state (an engine's whole-model state bytes, of
    /// which its shard's part counts), for the checkpoint.
    State {
        /// The state's bytes.
        bytes: Vec<u8>,
    },
    /// Local server → its parent, in an elastic job: the workers under it now left out
    /// (lost, silent past the deadline), sent whenever that changes, so that the root can
    /// stop the job when fewer than its minimum remain across every group.
    Members {
        /// The workers left out, ascending (empty: every worker is back).
        left_out: Vec<u32>,
    },
}

fn put_f32s(out: &mut Vec<u8>, values: &[f32]) {
    out.extend_from_slice(&(values.len() as u64).to_le_bytes());
    out.reserve(values.len() * 4);
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
}

/// The bytes of `PsMessage::Params { version, values }`, without copying `values` into a
/// message first (servers answer every pull and every round with this).
pub fn encode_params(version: u64, values: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(17 + values.len() * 4);
    out.push(PARAMS);
    out.extend_from_slice(&version.to_le_bytes());
    put_f32s(&mut out, values);
    out
}

impl PsMessage {
    /// A short name for logs and errors.
    pub fn name(&self) -> &'static str {
        match self {
            PsMessage::Pull => "pull",
            PsMessage::Push { .. } => "push",
            PsMessage::Params { .. } => "params",
            PsMessage::Reject { .. } => "reject",
            PsMessage::Stop { .. } => "stop",
            PsMessage::Gather { .. } => "gather",
            PsMessage::State { .. } => "state",
            PsMessage::Abort { .. } => "abort",
            PsMessage::Members { .. } => "members",
        }
    }

    /// Serialises the message.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match self {
            PsMessage::Pull => out.push(PULL),
            PsMessage::Push {
                version,
                staleness,
                samples,
                loss,
                delta,
                values,
            } => {
                out.push(PUSH);
                out.extend_from_slice(&version.to_le_bytes());
                out.extend_from_slice(&staleness.to_le_bytes());
                out.extend_from_slice(&samples.to_le_bytes());
                out.extend_from_slice(&loss.to_le_bytes());
                out.push(u8::from(*delta));
                put_f32s(&mut out, values);
            }
            PsMessage::Params { version, values } => return encode_params(*version, values),
            PsMessage::Gather { version, state } => {
                out.push(GATHER);
                out.extend_from_slice(&version.to_le_bytes());
                out.push(u8::from(*state));
            }
            PsMessage::State { bytes } => {
                out.push(STATE);
                out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
                out.extend_from_slice(bytes);
            }
            PsMessage::Reject { reason, retry } => {
                out.push(REJECT);
                out.push(u8::from(*retry));
                out.extend_from_slice(&(reason.len() as u32).to_le_bytes());
                out.extend_from_slice(reason.as_bytes());
            }
            PsMessage::Stop { reason } | PsMessage::Abort { reason } => {
                out.push(match self {
                    PsMessage::Stop { .. } => STOP,
                    _ => ABORT,
                });
                out.extend_from_slice(&(reason.len() as u32).to_le_bytes());
                out.extend_from_slice(reason.as_bytes());
            }
            PsMessage::Members { left_out } => {
                out.push(MEMBERS);
                out.extend_from_slice(&(left_out.len() as u32).to_le_bytes());
                for rank in left_out {
                    out.extend_from_slice(&rank.to_le_bytes());
                }
            }
        }
        out
    }

    /// Parses a message from `from` (named in errors). Truncated or oversized payloads and
    /// unknown kinds are errors, never panics.
    pub fn decode(bytes: &[u8], from: usize) -> Result<Self> {
        let mut r = Reader { bytes, at: 0, from };
        let kind = r.u8()?;
        let msg = match kind {
            PULL => PsMessage::Pull,
            PUSH => {
                let version = r.u64()?;
                let staleness = r.u32()?;
                let samples = r.u32()?;
                let loss = f32::from_le_bytes(r.take(4)?.try_into().map_err(|_| r.bad("loss"))?);
                let delta = r.u8()? != 0;
                let values = r.f32s()?;
                PsMessage::Push {
                    version,
                    staleness,
                    samples,
                    loss,
                    delta,
                    values,
                }
            }
            PARAMS => {
                let version = r.u64()?;
                let values = r.f32s()?;
                PsMessage::Params { version, values }
            }
            GATHER => {
                let version = r.u64()?;
                let state = match r.u8()? {
                    0 => false,
                    1 => true,
                    other => return Err(r.bad(&format!("a gather's state flag is {other}"))),
                };
                PsMessage::Gather { version, state }
            }
            STATE => {
                let len = usize::try_from(r.u64()?).map_err(|_| r.bad("state length"))?;
                PsMessage::State {
                    bytes: r.take(len)?.to_vec(),
                }
            }
            REJECT | STOP | ABORT => {
                let retry = if kind == REJECT {
                    match r.u8()? {
                        0 => false,
                        1 => true,
                        other => return Err(r.bad(&format!("a reject's retry flag is {other}"))),
                    }
                } else {
                    false
                };
                let len = r.u32()? as usize;
                let reason = String::from_utf8_lossy(r.take(len)?).into_owned();
                match kind {
                    REJECT => PsMessage::Reject { reason, retry },
                    STOP => PsMessage::Stop { reason },
                    _ => PsMessage::Abort { reason },
                }
            }
            MEMBERS => {
                let len = r.u32()? as usize;
                // Checked against the payload before anything is allocated.
                let bytes = r.take(len.checked_mul(4).ok_or_else(|| r.bad("members length"))?)?;
                PsMessage::Members {
                    left_out: bytes
                        .chunks_exact(4)
                        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                        .collect(),
                }
            }
            other => return Err(r.bad(&format!("unknown message kind {other}"))),
        };
        if r.at != bytes.len() {
            return Err(r.bad(&format!(
                "{} trailing bytes after a {} message",
                bytes.len() - r.at,
                msg.name()
            )));
        }
        Ok(msg)
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
    from: usize,
}

impl Reader<'_> {
    fn bad(&self, what: &str) -> CommError {
        CommError::Protocol {
            peer: self.from,
            detail: format!("malformed parameter-server message: {what}"),
        }
    }

    fn take(&mut self, n: usize) -> Result<&[u8]> {
        let end = self.at.checked_add(n).filter(|e| *e <= self.bytes.len());
        match end {
            Some(end) => {
                let s = &self.bytes[self.at..end];
                self.at = end;
                Ok(s)
            }
            None => Err(self.bad(&format!(
                "truncated: needs {n} more bytes at offset {}, has {}",
                self.at,
                self.bytes.len() - self.at
            ))),
        }
    }

    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Result<u64> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    fn f32s(&mut self) -> Result<Vec<f32>> {
        let len = self.u64()? as usize;
        let bytes = self.take(
            len.checked_mul(4)
                .ok_or_else(|| self.bad("length overflow"))?,
        )?;
        Ok(bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_message_round_trips() {
        let msgs = [
            PsMessage::Pull,
            PsMessage::Push {
                version: 7,
                staleness: 2,
                samples: 64,
                loss: 0.25,
                delta: true,
                values: vec![1.0, -2.5, 3.25],
            },
            PsMessage::Params {
                version: u64::MAX,
                values: vec![],
            },
            PsMessage::Reject {
                reason: "too stale".into(),
                retry: true,
            },
            PsMessage::Reject {
                reason: "wrong length".into(),
                retry: false,
            },
            PsMessage::Stop {
                reason: "target".into(),
            },
            PsMessage::Gather {
                version: 12,
                state: true,
            },
            PsMessage::State {
                bytes: vec![1, 2, 3],
            },
            PsMessage::Members {
                left_out: vec![3, 7],
            },
            PsMessage::Members { left_out: vec![] },
        ];
        for m in msgs {
            assert_eq!(PsMessage::decode(&m.encode(), 3).expect("decode"), m);
        }
    }

    use proptest::prelude::{Strategy, any};

    fn floats() -> impl Strategy<Value = Vec<f32>> {
        proptest::collection::vec(any::<u32>().prop_map(f32::from_bits), 0..32)
    }

    fn message() -> impl Strategy<Value = PsMessage> {
        proptest::prop_oneof![
            proptest::strategy::Just(PsMessage::Pull),
            (
                any::<u64>(),
                any::<u32>(),
                any::<u32>(),
                any::<u32>(),
                any::<bool>(),
                floats()
            )
                .prop_map(|(version, staleness, samples, loss, delta, values)| {
                    PsMessage::Push {
                        version,
                        staleness,
                        samples,
                        loss: f32::from_bits(loss),
                        delta,
                        values,
                    }
                }),
            (any::<u64>(), floats())
                .prop_map(|(version, values)| PsMessage::Params { version, values }),
            (any::<String>(), any::<bool>())
                .prop_map(|(reason, retry)| PsMessage::Reject { reason, retry }),
            any::<String>().prop_map(|reason| PsMessage::Stop { reason }),
            any::<String>().prop_map(|reason| PsMessage::Abort { reason }),
            (any::<u64>(), any::<bool>())
                .prop_map(|(version, state)| PsMessage::Gather { version, state }),
            proptest::collection::vec(any::<u8>(), 0..64)
                .prop_map(|bytes| PsMessage::State { bytes }),
            proptest::collection::vec(any::<u32>(), 0..16)
                .prop_map(|left_out| PsMessage::Members { left_out }),
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

        /// Compared by encoding, so NaN values count as equal bit patterns.
        #[test]
        fn any_message_round_trips(m in message()) {
            let bytes = m.encode();
            let back = PsMessage::decode(&bytes, 1).expect("own encoding decodes");
            proptest::prop_assert_eq!(back.encode(), bytes);
        }

        #[test]
        fn garbage_is_an_error_or_round_trips(
            bytes in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            match PsMessage::decode(&bytes, 4) {
                Ok(m) => {
                    let again = PsMessage::decode(&m.encode(), 4).expect("decodes");
                    proptest::prop_assert_eq!(again.encode(), m.encode());
                }
                Err(e) => proptest::prop_assert!(e.to_string().contains("rank 4")),
            }
        }
    }

    #[test]
    fn malformed_messages_are_errors_naming_the_sender() {
        let good = PsMessage::Params {
            version: 1,
            values: vec![1.0, 2.0],
        }
        .encode();
        for bad in [&good[..good.len() - 1], &[][..], &[99u8][..]] {
            let e = PsMessage::decode(bad, 5)
                .expect_err("malformed")
                .to_string();
            assert!(e.contains("rank 5"), "{e}");
        }
        let mut long = good.clone();
        long.push(0);
        assert!(
            PsMessage::decode(&long, 5)
                .expect_err("trailing")
                .to_string()
                .contains("trailing")
        );
        // A length field that would overflow is an error, not a huge allocation.
        let mut huge = vec![PARAMS];
        huge.extend_from_slice(&1u64.to_le_bytes());
        huge.extend_from_slice(&u64::MAX.to_le_bytes());
        assert!(PsMessage::decode(&huge, 5).is_err());
        // A length of 2^40 values over an 8-byte payload: checked against the payload (bounded
        // by the frame limit) before anything is allocated, so it fails at once.
        let t = std::time::Instant::now();
        let mut big = vec![PARAMS];
        big.extend_from_slice(&1u64.to_le_bytes());
        big.extend_from_slice(&(1u64 << 40).to_le_bytes());
        let e = PsMessage::decode(&big, 5)
            .expect_err("announced length")
            .to_string();
        assert!(e.contains("truncated"), "{e}");
        assert!(t.elapsed() < std::time::Duration::from_millis(50));
    }
}
