//! The authentication handshake of [`crate::auth`] on a connection: the connecting side
//! ([`initiate`]) and the accepting side ([`accept_first`]), each bounded by
//! [`AUTH_DEADLINE`]. Until a peer has authenticated, its frames are read with the small
//! [`PREAUTH_MAX_FRAME_BYTES`] limit, so a stranger can make this process allocate no more,
//! and within the authentication deadline (its first frame too), so a silent stranger holds
//! a connection no longer.

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::time::{Instant, timeout_at};

use super::{reject, send_ctrl};
use flotilla_group::{CommError, PeerName, RendezvousError};

use crate::auth::{AuthError, AuthMsg, Initiator, Purpose, Responder};
use crate::frame::{self, ReadError, channel};
use crate::secret::Secret;
use crate::wire::Ctrl;

/// The largest frame read from a peer that has not authenticated (or, without a secret, the
/// first frame of a connection: a join request or a mesh hello).
pub(crate) const PREAUTH_MAX_FRAME_BYTES: usize = 64 << 10;

/// The longest an authentication handshake may take (less when the caller's deadline is
/// nearer): a silent peer stalls nothing for longer.
pub(crate) const AUTH_DEADLINE: Duration = Duration::from_secs(10);

fn failed(peer: &PeerName, reason: impl Into<String>) -> CommError {
    RendezvousError::AuthFailed {
        peer: peer.clone(),
        reason: reason.into(),
    }
    .into()
}

/// Reads the first control message of a connection (at most [`PREAUTH_MAX_FRAME_BYTES`]).
/// `Err(None)`: the peer closed the connection or stayed silent until `deadline`.
pub(super) async fn read_first<R: AsyncRead + Unpin>(
    r: &mut R,
    peer: &PeerName,
    deadline: Instant,
) -> Result<Ctrl, Option<CommError>> {
    let read = frame::read_frame(r, PREAUTH_MAX_FRAME_BYTES, peer);
    let (header, payload) = match timeout_at(deadline, read).await {
        Err(_) | Ok(Err(ReadError::Io(_))) => return Err(None),
        Ok(Err(ReadError::Comm(e))) => return Err(Some(e)),
        Ok(Ok(frame)) => frame,
    };
    let bad = |detail: String| {
        Some(CommError::BadFrame {
            peer: peer.clone(),
            detail,
        })
    };
    if header.channel != channel::CONTROL {
        return Err(bad(format!(
            "data frame on channel {} before the handshake",
            header.channel
        )));
    }
    Ctrl::decode(&payload).map_err(bad)
}

/// When a connection accepted now must have authenticated (without a secret: sent its first
/// message): [`AUTH_DEADLINE`] from now, or `deadline` when nearer.
pub(super) fn auth_deadline(deadline: Instant) -> Instant {
    deadline.min(Instant::now() + AUTH_DEADLINE)
}

/// The accepting side: reads the first message of a connection and, with a `secret`, runs
/// the handshake first (a peer that skips it is told and refused), then returns the first
/// message after it. The first frame and the handshake must come by `auth_by` (see
/// [`auth_deadline`]), the message after the handshake by `deadline`. `Err(None)`: closed
/// or silent before sending anything.
pub(super) async fn accept_first<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    secret: Option<&Secret>,
    purpose: Purpose,
    peer: &PeerName,
    (auth_by, deadline): (Instant, Instant),
) -> Result<Ctrl, Option<CommError>> {
    let first = read_first(stream, peer, auth_by).await?;
    let Some(secret) = secret else {
        return Ok(first);
    };
    respond(stream, secret, purpose, first, peer, auth_by)
        .await
        .map_err(Some)?;
    read_first(stream, peer, deadline).await
}

/// The accepting side of the handshake, `first` being the peer's first message.
async fn respond<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    secret: &Secret,
    purpose: Purpose,
    first: Ctrl,
    peer: &PeerName,
    deadline: Instant,
) -> Result<(), CommError> {
    let deadline = deadline.min(Instant::now() + AUTH_DEADLINE);
    let Ctrl::Auth(bytes) = first else {
        let re = RendezvousError::AuthRequired { peer: peer.clone() };
        reject(stream, &re).await;
        return Err(re.into());
    };
    let challenge = AuthMsg::decode(&bytes).map_err(|e| failed(peer, e.to_string()))?;
    let (responder, response) = Responder::on_challenge(secret, purpose, &challenge)
        .map_err(|e| failed(peer, e.to_string()))?;
    send(stream, &response, peer).await?;
    let proof = recv(stream, peer, deadline).await?;
    match responder.on_proof(&proof) {
        Ok(()) => send(stream, &AuthMsg::Accepted, peer).await,
        Err(e) => {
            if e == AuthError::BadProof {
                let _ = send(stream, &AuthMsg::Refused, peer).await;
            }
            Err(failed(peer, e.to_string()))
        }
    }
}

/// The connecting side of the handshake: proves this side holds `secret` to `peer` and
/// checks that `peer` holds it, before `deadline` (and within [`AUTH_DEADLINE`]).
pub(super) async fn initiate<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    secret: &Secret,
    purpose: Purpose,
    peer: &PeerName,
    deadline: Instant,
) -> Result<(), CommError> {
    let deadline = deadline.min(Instant::now() + AUTH_DEADLINE);
    let (initiator, challenge) = Initiator::start(secret, purpose);
    send(stream, &challenge, peer).await?;
    let response = recv(stream, peer, deadline).await?;
    let proof = match initiator.on_response(&response) {
        Ok(proof) => proof,
        Err(e) => {
            if e == AuthError::BadProof {
                let _ = send(stream, &AuthMsg::Mismatch, peer).await;
            }
            return Err(failed(peer, e.to_string()));
        }
    };
    send(stream, &proof, peer).await?;
    match recv(stream, peer, deadline).await? {
        AuthMsg::Accepted => Ok(()),
        AuthMsg::Refused => Err(failed(
            peer,
            "refused this rank's proof: the two do not share this job's secret",
        )),
        other => Err(failed(
            peer,
            AuthError::Unexpected {
                expected: "an acceptance",
                got: other.name(),
            }
            .to_string(),
        )),
    }
}

async fn send<W: AsyncWrite + Unpin>(
    w: &mut W,
    msg: &AuthMsg,
    peer: &PeerName,
) -> Result<(), CommError> {
    send_ctrl(w, &Ctrl::Auth(msg.encode())).await.map_err(|e| {
        failed(
            peer,
            format!(
                "closed the connection during the authentication handshake ({})",
                frame::describe_io(&e)
            ),
        )
    })
}

/// The peer's next handshake message; its rejection of this rank is returned as the error.
async fn recv<R: AsyncRead + Unpin>(
    r: &mut R,
    peer: &PeerName,
    deadline: Instant,
) -> Result<AuthMsg, CommError> {
    match read_first(r, peer, deadline).await {
        Ok(Ctrl::Auth(bytes)) => AuthMsg::decode(&bytes).map_err(|e| failed(peer, e.to_string())),
        Ok(Ctrl::Reject(re)) => Err(re.into()),
        Ok(other) => {
            let kind = format!("{other:?}");
            let kind = kind.split([' ', '{', '(']).next().unwrap_or_default();
            Err(failed(
                peer,
                format!("sent `{kind}` during the authentication handshake"),
            ))
        }
        Err(Some(e)) => Err(failed(peer, format!("failed the handshake: {e}"))),
        Err(None) => Err(failed(
            peer,
            "closed the connection or went silent during the authentication handshake",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The secret named `s` (padded to a length a secret needs).
    fn secret(s: &str) -> Secret {
        Secret::new(format!("{s}-0123456789abcdef").into_bytes()).expect("secret")
    }

    /// Runs both sides over an in-memory pipe: (initiator's result, acceptor's result).
    async fn pair(
        a: Option<Secret>,
        b: Option<Secret>,
    ) -> (Result<(), CommError>, Result<Ctrl, Option<CommError>>) {
        let (mut x, mut y) = tokio::io::duplex(4096);
        let deadline = Instant::now() + Duration::from_secs(5);
        let peer = PeerName::unranked("test");
        let p = Purpose::Rendezvous;
        let connect = async {
            let r = match &a {
                Some(s) => initiate(&mut x, s, p, &peer, deadline).await,
                None => Ok(()),
            };
            if r.is_ok() {
                let _ = send_ctrl(&mut x, &Ctrl::Ready).await;
            }
            r
        };
        let accept = accept_first(&mut y, b.as_ref(), p, &peer, (deadline, deadline));
        tokio::join!(connect, accept)
    }

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
    }

    #[test]
    fn the_first_message_after_a_good_handshake_arrives() {
        let (c, a) = rt().block_on(pair(Some(secret("k")), Some(secret("k"))));
        c.expect("initiator");
        assert!(matches!(a, Ok(Ctrl::Ready)), "{a:?}");
        let (c, a) = rt().block_on(pair(None, None));
        c.expect("no secrets: no handshake");
        assert!(matches!(a, Ok(Ctrl::Ready)), "{a:?}");
    }

    #[test]
    fn wrong_or_missing_secrets_are_refused_on_both_sides() {
        let (c, a) = rt().block_on(pair(Some(secret("k")), Some(secret("other"))));
        let c = c.expect_err("initiator").to_string();
        assert!(c.contains("does not share this job's secret"), "{c}");
        let a = a.expect_err("acceptor").expect("a reason").to_string();
        assert!(
            a.contains("authentication failed") && a.contains("test"),
            "{a}"
        );
        for text in [&c, &a] {
            assert!(!text.contains("other") && !text.contains(" k "), "{text}");
        }
        // The connecting side has no secret: it is told the acceptor requires one.
        let (_, a) = rt().block_on(pair(None, Some(secret("k"))));
        let a = a.expect_err("acceptor").expect("a reason");
        assert!(
            matches!(
                a,
                CommError::Rendezvous(RendezvousError::AuthRequired { .. })
            ),
            "{a}"
        );
    }

    #[test]
    fn a_silent_peer_is_bounded_by_the_deadline() {
        let (_x, mut y) = tokio::io::duplex(4096);
        let t = std::time::Instant::now();
        let peer = PeerName::unranked("silent");
        let deadline = Instant::now() + Duration::from_millis(200);
        let s = secret("k");
        let r = rt().block_on(accept_first(
            &mut y,
            Some(&s),
            Purpose::Rendezvous,
            &peer,
            (deadline, deadline),
        ));
        assert!(matches!(r, Err(None)), "{r:?}");
        assert!(t.elapsed() < Duration::from_secs(2));
    }

    #[test]
    fn an_oversized_first_frame_is_refused_before_allocation() {
        let (mut x, mut y) = tokio::io::duplex(4096);
        let peer = PeerName::unranked("big");
        let deadline = Instant::now() + Duration::from_secs(2);
        let r = rt().block_on(async {
            let header = frame::FrameHeader {
                channel: 0,
                flags: 0,
                op: 0,
                group: 0,
                seq: 0,
                tag: 0,
                len: (PREAUTH_MAX_FRAME_BYTES + 1) as u32,
            };
            tokio::io::AsyncWriteExt::write_all(&mut x, &header.encode())
                .await
                .expect("write");
            read_first(&mut y, &peer, deadline).await
        });
        assert!(
            matches!(r, Err(Some(CommError::FrameTooLarge { max, .. })) if max == PREAUTH_MAX_FRAME_BYTES),
            "{r:?}"
        );
    }
}
