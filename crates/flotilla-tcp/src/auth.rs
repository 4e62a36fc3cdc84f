//! The authentication handshake, without I/O: its messages, the proofs (HMAC-SHA256) and
//! their verification. The rendezvous and mesh code carry these messages in
//! [`crate::wire::Ctrl::Auth`] frames before any other frame of a connection.
//!
//! ```text
//! initiator (connects)                         responder (accepts)
//!   Challenge { version, nonce_i }      ->
//!                                       <-     Response { nonce_r, mac_r }
//!   checks mac_r; then
//!   Proof { mac_i }  (or Mismatch)      ->
//!                                       <-     Accepted (or Refused)      checks mac_i
//!
//! mac_x = HMAC-SHA256(secret, "flotilla-auth" | version | role_x | purpose | nonce_i | nonce_r)
//! ```
//!
//! Both nonces are fresh (32 bytes from `rand`'s OS-seeded generator), so a recorded proof
//! never verifies again (replay); the role label differs between the two proofs, so the
//! responder's proof echoed back as the initiator's fails (reflection); the purpose names the
//! rendezvous or the mesh session and accepting rank, so a proof made for one connection
//! kind is worthless for another. Proofs are compared in constant time (`verify_slice`).

use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;

use crate::secret::Secret;

/// Bytes of each side's nonce.
pub(crate) const NONCE_BYTES: usize = 32;
/// Bytes of a proof (an HMAC-SHA256 tag).
pub(crate) const MAC_BYTES: usize = 32;
/// Version of the handshake, bound into every proof.
pub(crate) const AUTH_VERSION: u8 = 1;
/// The largest encoded handshake message (a response).
pub(crate) const MAX_MESSAGE_BYTES: usize = 1 + NONCE_BYTES + MAC_BYTES;

const DOMAIN: &[u8] = b"flotilla-auth";
const INITIATOR: &[u8] = b"initiator->responder";
const RESPONDER: &[u8] = b"responder->initiator";

type HmacSha256 = Hmac<Sha256>;

/// What a connection is for; bound into both proofs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Purpose {
    /// A rank's connection to rank 0's rendezvous listener.
    Rendezvous,
    /// A mesh connection of the session `session` to the rank `acceptor`.
    Mesh {
        /// The rendezvous session (rank 0's random number, told only to admitted ranks).
        session: u64,
        /// The accepting rank.
        acceptor: usize,
    },
}

impl Purpose {
    fn bytes(&self) -> Vec<u8> {
        match *self {
            Purpose::Rendezvous => b"rendezvous".to_vec(),
            Purpose::Mesh { session, acceptor } => {
                let mut b = b"mesh".to_vec();
                b.extend_from_slice(&session.to_le_bytes());
                b.extend_from_slice(&(acceptor as u64).to_le_bytes());
                b
            }
        }
    }
}

/// One handshake message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum AuthMsg {
    /// Initiator -> responder: the handshake version and the initiator's nonce.
    Challenge {
        /// The initiator's handshake version.
        version: u8,
        /// The initiator's nonce.
        nonce: [u8; NONCE_BYTES],
    },
    /// Responder -> initiator: the responder's nonce and its proof.
    Response {
        /// The responder's nonce.
        nonce: [u8; NONCE_BYTES],
        /// The responder's proof.
        mac: [u8; MAC_BYTES],
    },
    /// Initiator -> responder: the initiator's proof.
    Proof {
        /// The initiator's proof.
        mac: [u8; MAC_BYTES],
    },
    /// Initiator -> responder: the responder's proof is wrong (the secrets differ).
    Mismatch,
    /// Responder -> initiator: the initiator's proof verified.
    Accepted,
    /// Responder -> initiator: the initiator's proof is wrong (the secrets differ).
    Refused,
}

const CHALLENGE: u8 = 1;
const RESPONSE: u8 = 2;
const PROOF: u8 = 3;
const MISMATCH: u8 = 4;
const ACCEPTED: u8 = 5;
const REFUSED: u8 = 6;

/// Why a handshake failed on this side.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum AuthError {
    /// A message that is not a handshake message of this version's layout.
    #[error("malformed authentication message: {0}")]
    Malformed(String),
    /// The peer's proof does not verify: it does not hold this job's secret.
    #[error("does not share this job's secret")]
    BadProof,
    /// The peer found this side's proof wrong: the secrets differ.
    #[error("does not share this job's secret (it found this rank's proof wrong)")]
    PeerRefused,
    /// The peer speaks another handshake version.
    #[error("speaks authentication version {0}, this rank speaks {AUTH_VERSION}")]
    Version(u8),
    /// A valid message out of turn.
    #[error("sent {got} during the authentication handshake, expected {expected}")]
    Unexpected {
        /// What this side waited for.
        expected: &'static str,
        /// What arrived.
        got: &'static str,
    },
    /// The peer sent back this side's own nonce.
    #[error("echoed this rank's nonce (a reflected handshake)")]
    Reflected,
}

impl AuthMsg {
    /// The message's name, for errors.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            AuthMsg::Challenge { .. } => "a challenge",
            AuthMsg::Response { .. } => "a response",
            AuthMsg::Proof { .. } => "a proof",
            AuthMsg::Mismatch => "a mismatch",
            AuthMsg::Accepted => "an acceptance",
            AuthMsg::Refused => "a refusal",
        }
    }

    /// The message's bytes: a kind byte, then its fixed-size fields.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(MAX_MESSAGE_BYTES);
        match self {
            AuthMsg::Challenge { version, nonce } => {
                out.extend([CHALLENGE, *version]);
                out.extend_from_slice(nonce);
            }
            AuthMsg::Response { nonce, mac } => {
                out.push(RESPONSE);
                out.extend_from_slice(nonce);
                out.extend_from_slice(mac);
            }
            AuthMsg::Proof { mac } => {
                out.push(PROOF);
                out.extend_from_slice(mac);
            }
            AuthMsg::Mismatch => out.push(MISMATCH),
            AuthMsg::Accepted => out.push(ACCEPTED),
            AuthMsg::Refused => out.push(REFUSED),
        }
        out
    }

    /// Parses a message; a truncated, oversized or unknown one is [`AuthError::Malformed`].
    pub(crate) fn decode(b: &[u8]) -> Result<AuthMsg, AuthError> {
        let (&kind, body) = b
            .split_first()
            .ok_or_else(|| AuthError::Malformed("empty message".into()))?;
        let want = match kind {
            CHALLENGE => 1 + NONCE_BYTES,
            RESPONSE => NONCE_BYTES + MAC_BYTES,
            PROOF => MAC_BYTES,
            MISMATCH | ACCEPTED | REFUSED => 0,
            other => return Err(AuthError::Malformed(format!("unknown kind {other}"))),
        };
        if body.len() != want {
            let what = if body.len() < want {
                "truncated"
            } else {
                "oversized"
            };
            return Err(AuthError::Malformed(format!(
                "{what}: kind {kind} has {} bytes after its kind, expected {want}",
                body.len()
            )));
        }
        let arr = |s: &[u8]| {
            let mut a = [0u8; 32];
            a.copy_from_slice(s);
            a
        };
        Ok(match kind {
            CHALLENGE => AuthMsg::Challenge {
                version: body[0],
                nonce: arr(&body[1..]),
            },
            RESPONSE => AuthMsg::Response {
                nonce: arr(&body[..NONCE_BYTES]),
                mac: arr(&body[NONCE_BYTES..]),
            },
            PROOF => AuthMsg::Proof { mac: arr(body) },
            MISMATCH => AuthMsg::Mismatch,
            ACCEPTED => AuthMsg::Accepted,
            _ => AuthMsg::Refused,
        })
    }
}

/// The keyed MAC of one side's proof, ready to finalize or verify.
fn proof_mac(secret: &Secret, role: &[u8], purpose: Purpose, ni: &[u8], nr: &[u8]) -> HmacSha256 {
    // HMAC takes keys of any length; `new_from_slice` cannot fail for it.
    let mut mac = match HmacSha256::new_from_slice(secret.bytes()) {
        Ok(m) => m,
        Err(_) => unreachable!("HMAC accepts keys of every length"),
    };
    let purpose = purpose.bytes();
    for part in [DOMAIN, &[AUTH_VERSION], role, &purpose, ni, nr] {
        mac.update(&(part.len() as u32).to_le_bytes());
        mac.update(part);
    }
    mac
}

fn fresh_nonce() -> [u8; NONCE_BYTES] {
    let mut n = [0u8; NONCE_BYTES];
    rand::rng().fill_bytes(&mut n);
    n
}

/// The connecting side of a handshake.
pub(crate) struct Initiator<'a> {
    secret: &'a Secret,
    purpose: Purpose,
    nonce: [u8; NONCE_BYTES],
}

impl<'a> Initiator<'a> {
    /// Starts a handshake: the initiator and the challenge to send.
    pub(crate) fn start(secret: &'a Secret, purpose: Purpose) -> (Self, AuthMsg) {
        let nonce = fresh_nonce();
        let msg = AuthMsg::Challenge {
            version: AUTH_VERSION,
            nonce,
        };
        (
            Initiator {
                secret,
                purpose,
                nonce,
            },
            msg,
        )
    }

    /// Checks the responder's answer; returns this side's proof to send.
    pub(crate) fn on_response(&self, msg: &AuthMsg) -> Result<AuthMsg, AuthError> {
        let AuthMsg::Response { nonce, mac } = msg else {
            return Err(AuthError::Unexpected {
                expected: "a response",
                got: msg.name(),
            });
        };
        if *nonce == self.nonce {
            return Err(AuthError::Reflected);
        }
        proof_mac(self.secret, RESPONDER, self.purpose, &self.nonce, nonce)
            .verify_slice(mac)
            .map_err(|_| AuthError::BadProof)?;
        let mine = proof_mac(self.secret, INITIATOR, self.purpose, &self.nonce, nonce);
        Ok(AuthMsg::Proof {
            mac: mine.finalize().into_bytes().into(),
        })
    }
}

/// The accepting side of a handshake.
pub(crate) struct Responder<'a> {
    secret: &'a Secret,
    purpose: Purpose,
    theirs: [u8; NONCE_BYTES],
    ours: [u8; NONCE_BYTES],
}

impl<'a> Responder<'a> {
    /// Answers a challenge: the responder and the response to send.
    pub(crate) fn on_challenge(
        secret: &'a Secret,
        purpose: Purpose,
        msg: &AuthMsg,
    ) -> Result<(Self, AuthMsg), AuthError> {
        let AuthMsg::Challenge { version, nonce } = msg else {
            return Err(AuthError::Unexpected {
                expected: "a challenge",
                got: msg.name(),
            });
        };
        if *version != AUTH_VERSION {
            return Err(AuthError::Version(*version));
        }
        let ours = fresh_nonce();
        let mac = proof_mac(secret, RESPONDER, purpose, nonce, &ours);
        let response = AuthMsg::Response {
            nonce: ours,
            mac: mac.finalize().into_bytes().into(),
        };
        let r = Responder {
            secret,
            purpose,
            theirs: *nonce,
            ours,
        };
        Ok((r, response))
    }

    /// Checks the initiator's proof.
    pub(crate) fn on_proof(&self, msg: &AuthMsg) -> Result<(), AuthError> {
        match msg {
            AuthMsg::Proof { mac } => proof_mac(
                self.secret,
                INITIATOR,
                self.purpose,
                &self.theirs,
                &self.ours,
            )
            .verify_slice(mac)
            .map_err(|_| AuthError::BadProof),
            AuthMsg::Mismatch => Err(AuthError::PeerRefused),
            other => Err(AuthError::Unexpected {
                expected: "a proof",
                got: other.name(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The secret named `s` (padded to a length a secret needs).
    fn secret(s: &str) -> Secret {
        Secret::new(format!("{s}-0123456789abcdef").into_bytes()).expect("secret")
    }

    /// A whole handshake over encoded bytes: the initiator's and the responder's verdicts.
    fn handshake(a: &Secret, b: &Secret, pa: Purpose, pb: Purpose) -> (bool, bool) {
        let (init, challenge) = Initiator::start(a, pa);
        let challenge = AuthMsg::decode(&challenge.encode()).expect("challenge");
        let (resp, response) = Responder::on_challenge(b, pb, &challenge).expect("response");
        let response = AuthMsg::decode(&response.encode()).expect("decode");
        match init.on_response(&response) {
            Ok(proof) => {
                let proof = AuthMsg::decode(&proof.encode()).expect("proof");
                (true, resp.on_proof(&proof).is_ok())
            }
            Err(e) => {
                assert_eq!(e, AuthError::BadProof);
                assert_eq!(
                    resp.on_proof(&AuthMsg::Mismatch),
                    Err(AuthError::PeerRefused)
                );
                (false, false)
            }
        }
    }

    #[test]
    fn the_same_secret_authenticates_both_sides() {
        let s = secret("correct horse battery staple");
        assert_eq!(
            handshake(&s, &s, Purpose::Rendezvous, Purpose::Rendezvous),
            (true, true)
        );
        let m = Purpose::Mesh {
            session: 7,
            acceptor: 2,
        };
        assert_eq!(handshake(&s, &s, m, m), (true, true));
    }

    #[test]
    fn a_wrong_secret_fails_on_both_sides() {
        let (a, b) = (secret("one secret"), secret("another secret"));
        let r = Purpose::Rendezvous;
        assert_eq!(handshake(&a, &b, r, r), (false, false));
        // A prefix of the secret is another secret.
        assert_eq!(handshake(&secret("one"), &a, r, r), (false, false));
    }

    #[test]
    fn a_proof_for_another_purpose_fails() {
        let s = secret("s");
        let m = |session, acceptor| Purpose::Mesh { session, acceptor };
        assert!(!handshake(&s, &s, Purpose::Rendezvous, m(1, 1)).0);
        assert!(!handshake(&s, &s, m(1, 1), m(2, 1)).0);
        assert!(!handshake(&s, &s, m(1, 1), m(1, 2)).0);
    }

    #[test]
    fn a_replayed_proof_fails() {
        let s = secret("s");
        let p = Purpose::Rendezvous;
        // An eavesdropper records a whole successful handshake ...
        let (init, challenge) = Initiator::start(&s, p);
        let (_, response) = Responder::on_challenge(&s, p, &challenge).expect("response");
        let recorded = init.on_response(&response).expect("proof");
        // ... and replays the challenge and the proof to the responder: a fresh nonce of the
        // responder makes the old proof worthless.
        let (resp, _) = Responder::on_challenge(&s, p, &challenge).expect("response");
        assert_eq!(resp.on_proof(&recorded), Err(AuthError::BadProof));
        // Replaying a recorded response to a fresh initiator fails the same way.
        let (init2, _) = Initiator::start(&s, p);
        assert_eq!(init2.on_response(&response), Err(AuthError::BadProof));
    }

    #[test]
    fn a_reflected_proof_fails() {
        let s = secret("s");
        let p = Purpose::Rendezvous;
        // A stranger without the secret opens a connection and receives the responder's
        // proof, then sends that proof back as its own: the role labels differ.
        let (_, challenge) = Initiator::start(&s, p);
        let (resp, response) = Responder::on_challenge(&s, p, &challenge).expect("response");
        let AuthMsg::Response { mac, .. } = response else {
            panic!("not a response")
        };
        assert_eq!(
            resp.on_proof(&AuthMsg::Proof { mac }),
            Err(AuthError::BadProof)
        );
        // A responder that echoes the initiator's nonce (to mirror its own proof) is refused.
        let (init, challenge) = Initiator::start(&s, p);
        let AuthMsg::Challenge { nonce, .. } = challenge else {
            panic!("not a challenge")
        };
        let echo = AuthMsg::Response {
            nonce,
            mac: [0; MAC_BYTES],
        };
        assert_eq!(init.on_response(&echo), Err(AuthError::Reflected));
    }

    #[test]
    fn truncated_oversized_and_unknown_messages_are_malformed() {
        let s = secret("s");
        let (init, challenge) = Initiator::start(&s, Purpose::Rendezvous);
        let (_, response) =
            Responder::on_challenge(&s, Purpose::Rendezvous, &challenge).expect("response");
        let proof = init.on_response(&response).expect("proof").encode();
        for cut in 0..proof.len() {
            assert!(matches!(
                AuthMsg::decode(&proof[..cut]),
                Err(AuthError::Malformed(_))
            ));
        }
        let mut long = proof.clone();
        long.push(0);
        let e = AuthMsg::decode(&long).expect_err("oversized");
        assert!(e.to_string().contains("oversized"), "{e}");
        assert!(matches!(
            AuthMsg::decode(&[99]),
            Err(AuthError::Malformed(_))
        ));
        assert!(AuthMsg::decode(&vec![PROOF; 1 << 20]).is_err());
    }

    #[test]
    fn out_of_turn_messages_and_other_versions_are_refused() {
        let s = secret("s");
        let p = Purpose::Rendezvous;
        let (init, challenge) = Initiator::start(&s, p);
        assert!(matches!(
            init.on_response(&challenge),
            Err(AuthError::Unexpected { .. })
        ));
        assert!(matches!(
            Responder::on_challenge(&s, p, &AuthMsg::Accepted),
            Err(AuthError::Unexpected { .. })
        ));
        let AuthMsg::Challenge { nonce, .. } = challenge else {
            panic!("not a challenge")
        };
        let future = AuthMsg::Challenge { version: 9, nonce };
        assert!(matches!(
            Responder::on_challenge(&s, p, &future),
            Err(AuthError::Version(9))
        ));
    }

    #[test]
    fn nonces_are_fresh() {
        let s = secret("s");
        let (a, _) = Initiator::start(&s, Purpose::Rendezvous);
        let (b, _) = Initiator::start(&s, Purpose::Rendezvous);
        assert_ne!(a.nonce, b.nonce);
        assert_ne!(a.nonce, [0; NONCE_BYTES]);
    }
}
