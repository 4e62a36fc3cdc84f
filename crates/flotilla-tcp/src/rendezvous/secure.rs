//! TLS on a connection, first thing after the TCP connect or accept (before the secret's
//! handshake of [`super::authn`] and before any frame): the connecting side ([`connect`]) is
//! the TLS client, the accepting side ([`accept_first`]) the TLS server; both present their
//! certificate and check the other's against the cluster CA ([`crate::tls`]).
//!
//! The accepting side peeks at the first byte: a TLS handshake record starts with `0x16`, a
//! Flotilla frame with [`frame::MAGIC`]. So a plain rank knocking at a TLS job is told in
//! plain text that TLS is required, a TLS rank knocking at a plain job gets plain bytes back
//! (its TLS stack then reports that the other side does not speak TLS), and either is
//! refused and logged like any stranger: the job goes on waiting for its real ranks. After
//! its handshake the server sends one byte, [`READY`], so the client learns that its own
//! certificate was accepted before it sends anything (in TLS 1.3 the client finishes its
//! handshake before the server has checked its certificate). Every handshake is bounded by
//! [`AUTH_DEADLINE`].

use std::io;

use rustls::pki_types::ServerName;
use rustls::{AlertDescription, CertificateError};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::{Instant, timeout_at};

use super::authn::{self, AUTH_DEADLINE};
use super::reject;
use flotilla_group::{CommError, PeerName, RendezvousError};

use crate::auth::Purpose;
use crate::frame;
use crate::secret::Secret;
use crate::stream::Stream;
use crate::tls::TlsConfig;
use crate::wire::Ctrl;

/// The first byte of a TLS handshake record (a ClientHello).
const TLS_HANDSHAKE_RECORD: u8 = 0x16;

/// The largest TLS record a plain process reads from a TLS peer before refusing it.
const MAX_TLS_RECORD: usize = 5 + (16 << 10) + 2048;

/// What the TLS server sends after its handshake: the client's certificate was accepted.
pub(super) const READY: u8 = 0x01;

/// The host part of an address `host:port`, `[v6]:port`, `host` or `v6` (the name a TLS
/// client checks the server's certificate against).
pub(super) fn host_of(addr: &str) -> &str {
    let host = match addr.rsplit_once(':') {
        Some((h, p)) if !h.is_empty() && p.parse::<u16>().is_ok() && !h.ends_with(':') => h,
        _ => addr,
    };
    host.trim_start_matches('[').trim_end_matches(']')
}

/// Says once per process whether connections are encrypted (with the files' paths).
pub(super) fn announce(tls: Option<&TlsConfig>) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    if let Some(tls) = tls {
        ONCE.call_once(|| {
            let f = tls.files();
            tracing::info!(
                "TLS on every connection (cluster CA {}, certificate {})",
                f.ca.display(),
                f.cert.display()
            );
        });
    }
}

fn failed(peer: &PeerName, reason: impl Into<String>) -> CommError {
    RendezvousError::TlsFailed {
        peer: peer.clone(),
        reason: reason.into(),
    }
    .into()
}

/// The connecting side: with `tls`, the TLS handshake as the client, checking that the
/// server's certificate is signed by the CA and valid for `host` (the name or IP address
/// connected to), then the server's [`READY`]. Without `tls`, the plain stream.
pub(super) async fn connect(
    tls: Option<&TlsConfig>,
    tcp: TcpStream,
    host: &str,
    peer: &PeerName,
    deadline: Instant,
) -> Result<Stream, CommError> {
    let Some(tls) = tls else {
        return Ok(Stream::Plain(tcp));
    };
    let deadline = deadline.min(Instant::now() + AUTH_DEADLINE);
    let name = ServerName::try_from(host.to_owned())
        .map_err(|_| failed(peer, format!("{host:?} is not a valid TLS server name")))?;
    let mut s = match timeout_at(deadline, tls.connector().connect(name, tcp)).await {
        Err(_) => return Err(failed(peer, "went silent during the TLS handshake")),
        Ok(Err(e)) => return Err(failed(peer, describe(&e, tls, Some(host)))),
        Ok(Ok(s)) => s,
    };
    let mut ready = [0u8; 1];
    match timeout_at(deadline, s.read_exact(&mut ready)).await {
        Err(_) => Err(failed(peer, "went silent after the TLS handshake")),
        Ok(Err(e)) => Err(failed(peer, describe(&e, tls, Some(host)))),
        Ok(Ok(_)) if ready[0] == READY => Ok(Stream::Tls(Box::new(s.into()))),
        Ok(Ok(_)) => Err(failed(
            peer,
            "sent an unexpected byte after the TLS handshake",
        )),
    }
}

/// The accepting side of a connection, up to its first message: TLS as the server (with
/// `tls`; a peer without it is refused), then [`authn::accept_first`] (with `secret`).
/// Everything before the peer has authenticated (its first byte, TLS, its first frame, the
/// secret's handshake) must come within [`AUTH_DEADLINE`] of now; the message after the
/// handshake by `deadline`. Returns the stream (`None` only if the connection was lost
/// during the TLS handshake) and the first message after the handshakes, or why there is
/// none (`Err(None)`: closed or silent).
pub(super) async fn accept_first(
    tcp: TcpStream,
    tls: Option<&TlsConfig>,
    secret: Option<&Secret>,
    purpose: Purpose,
    peer: &PeerName,
    deadline: Instant,
) -> (Option<Stream>, Result<Ctrl, Option<CommError>>) {
    let auth_by = authn::auth_deadline(deadline);
    let mut stream = match accept(tls, tcp, peer, auth_by).await {
        Ok(s) => s,
        Err((s, e)) => return (s, Err(e)),
    };
    let deadlines = (auth_by, deadline);
    let first = authn::accept_first(&mut stream, secret, purpose, peer, deadlines).await;
    (Some(stream), first)
}

type Refused = (Option<Stream>, Option<CommError>);

/// The accepting side's TLS step (see the module's documentation).
async fn accept(
    tls: Option<&TlsConfig>,
    tcp: TcpStream,
    peer: &PeerName,
    deadline: Instant,
) -> Result<Stream, Refused> {
    let mut first = [0u8; 1];
    match timeout_at(deadline, tcp.peek(&mut first)).await {
        Ok(Ok(1..)) => {}
        _ => return Err((Some(Stream::Plain(tcp)), None)),
    }
    let speaks_tls = first[0] == TLS_HANDSHAKE_RECORD;
    let deadline = deadline.min(Instant::now() + AUTH_DEADLINE);
    match tls {
        None if !speaks_tls => Ok(Stream::Plain(tcp)),
        None => Err(refuse_tls(tcp, peer, deadline).await),
        Some(_) if !speaks_tls => Err(refuse_plain(tcp, peer, deadline).await),
        Some(tls) => handshake(tls, tcp, peer, deadline).await,
    }
}

/// The TLS server's handshake, then [`READY`].
async fn handshake(
    tls: &TlsConfig,
    tcp: TcpStream,
    peer: &PeerName,
    deadline: Instant,
) -> Result<Stream, Refused> {
    let accept = tls.acceptor().accept(tcp).into_fallible();
    let mut s = match timeout_at(deadline, accept).await {
        Err(_) => {
            let e = failed(peer, "went silent during the TLS handshake");
            return Err((None, Some(e)));
        }
        Ok(Err((e, tcp))) => {
            let e = failed(peer, describe(&e, tls, None));
            return Err((Some(Stream::Plain(tcp)), Some(e)));
        }
        Ok(Ok(s)) => s,
    };
    let ready = async {
        s.write_all(&[READY]).await?;
        s.flush().await
    };
    match timeout_at(deadline, ready).await {
        Ok(Ok(())) => Ok(Stream::Tls(Box::new(s.into()))),
        Ok(Err(e)) => {
            let e = failed(peer, describe(&e, tls, None));
            Err((Some(Stream::Tls(Box::new(s.into()))), Some(e)))
        }
        Err(_) => {
            let e = failed(peer, "went silent after the TLS handshake");
            Err((Some(Stream::Tls(Box::new(s.into()))), Some(e)))
        }
    }
}

/// A plain peer at a TLS job: reads its first frame (so the answer is not lost to a reset)
/// and tells it, in plain text, that TLS is required.
async fn refuse_plain(mut tcp: TcpStream, peer: &PeerName, deadline: Instant) -> Refused {
    let _ = authn::read_first(&mut tcp, peer, deadline).await;
    let re = RendezvousError::TlsRequired { peer: peer.clone() };
    reject(&mut tcp, &re).await;
    (Some(Stream::Plain(tcp)), Some(re.into()))
}

/// A TLS peer at a plain job: reads its first TLS record and answers with a plain frame,
/// which its TLS stack reports as a peer that does not speak TLS.
async fn refuse_tls(mut tcp: TcpStream, peer: &PeerName, deadline: Instant) -> Refused {
    let read_record = async {
        let mut header = [0u8; 5];
        tcp.read_exact(&mut header).await?;
        let len = usize::from(u16::from_be_bytes([header[3], header[4]]));
        if 5 + len <= MAX_TLS_RECORD {
            let mut body = vec![0u8; len];
            tcp.read_exact(&mut body).await?;
        }
        Ok::<_, io::Error>(())
    };
    let _ = timeout_at(deadline, read_record).await;
    let re = RendezvousError::TlsNotConfigured { peer: peer.clone() };
    reject(&mut tcp, &re).await;
    (Some(Stream::Plain(tcp)), Some(re.into()))
}

/// A TLS failure in words: what the peer did and what to check.
fn describe(e: &io::Error, tls: &TlsConfig, host: Option<&str>) -> String {
    let files = tls.files();
    let Some(tls_error) = e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) else {
        return match e.kind() {
            io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe => {
                "closed the connection during the TLS handshake (does it use TLS?)".into()
            }
            _ => frame::describe_io(e),
        };
    };
    use rustls::Error as E;
    match tls_error {
        E::InvalidCertificate(CertificateError::UnknownIssuer | CertificateError::BadSignature) => {
            format!(
                "its certificate is not signed by this job's CA {} ({tls_error})",
                files.ca.display()
            )
        }
        E::InvalidCertificate(
            CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
        ) => format!(
            "its certificate is not valid for {} ({tls_error}): make the host's certificate for the name or address the ranks connect to (`flotilla certs --hosts`)",
            host.unwrap_or("the address connected to")
        ),
        E::InvalidCertificate(_) => format!("its certificate was refused ({tls_error})"),
        E::NoCertificatesPresented => "presented no certificate".into(),
        E::AlertReceived(
            AlertDescription::UnknownCA
            | AlertDescription::BadCertificate
            | AlertDescription::CertificateRequired
            | AlertDescription::CertificateUnknown
            | AlertDescription::DecryptError
            | AlertDescription::AccessDenied,
        ) => format!(
            "it refused this process's certificate {} ({tls_error}): is it of another cluster CA?",
            files.cert.display()
        ),
        E::InvalidMessage(_) => {
            format!("it does not speak TLS, or has no TLS configured ({tls_error})")
        }
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use tokio::net::TcpListener;

    use super::*;
    use crate::config::Compression;
    use crate::conn::{Conn, ConnOpts, Endpoint};
    use crate::frame::{Op, channel};
    use crate::tls::testing::{make_certs, tempdir};

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
    }

    /// One CA's TLS configs for `127.0.0.1`, twice (two hosts of one cluster).
    fn cluster() -> (TlsConfig, TlsConfig, std::path::PathBuf) {
        let d = tempdir("secure");
        let files = make_certs(&d, &["127.0.0.1", "localhost"]);
        let a = files[0].load().expect("a");
        let b = files[1].load().expect("b");
        (a, b, d)
    }

    /// Connects `client` to a fresh listener accepting with `server`; returns both sides'
    /// results (the accepting side's first message, here a `Ready`).
    async fn pair(
        server: Option<TlsConfig>,
        client: Option<TlsConfig>,
        host: &str,
    ) -> (
        Result<Stream, CommError>,
        (Option<Stream>, Result<Ctrl, Option<CommError>>),
    ) {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = l.local_addr().expect("addr");
        let deadline = Instant::now() + Duration::from_secs(5);
        let accepting = tokio::spawn(async move {
            let (tcp, from) = l.accept().await.expect("accept");
            let peer = PeerName::unranked(from.to_string());
            let p = Purpose::Rendezvous;
            accept_first(tcp, server.as_ref(), None, p, &peer, deadline).await
        });
        let tcp = TcpStream::connect(addr).await.expect("connect");
        let peer = PeerName::ranked(0, addr.to_string());
        let connected = connect(client.as_ref(), tcp, host, &peer, deadline).await;
        let connected = match connected {
            Ok(mut s) => super::super::send_ctrl(&mut s, &Ctrl::Ready)
                .await
                .map(|_| s)
                .map_err(|e| failed(&peer, e.to_string())),
            Err(e) => Err(e),
        };
        (connected, accepting.await.expect("task"))
    }

    #[test]
    fn host_names_come_from_addresses() {
        assert_eq!(host_of("127.0.0.1:29500"), "127.0.0.1");
        assert_eq!(host_of("node-1:80"), "node-1");
        assert_eq!(host_of("node-1"), "node-1");
        assert_eq!(host_of("[::1]:5000"), "::1");
        assert_eq!(host_of("::1"), "::1");
    }

    /// Two ends of one cluster: the handshake passes both ways, and `Conn`s over the TLS
    /// streams exchange frames (small, large and compressed) in both directions.
    #[test]
    fn a_tls_pair_exchanges_frames() {
        let (a, b, dir) = cluster();
        rt().block_on(async {
            let (client, (server, first)) = pair(Some(a), Some(b), "127.0.0.1").await;
            let client = client.expect("client side");
            assert!(matches!(first, Ok(Ctrl::Ready)), "{first:?}");
            let server = server.expect("server stream");
            assert!(client.is_tls() && server.is_tls());
            let opts = ConnOpts {
                max_frame_bytes: 8 << 20,
                compression: Compression::Lz4,
                pooled_frame_bytes: 1 << 20,
            };
            let (ea, eb) = (Arc::new(Endpoint::default()), Arc::new(Endpoint::default()));
            let ca = Conn::tcp(client, 1, opts, ea);
            let cb = Conn::tcp(server, 0, opts, eb);
            let big: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
            for (seq, payload) in [
                (1u64, &b"hello"[..]),
                (2, &big[..]),
                (3, &[0u8; 70_000][..]),
            ] {
                ca.send(channel::COLLECTIVE, Op::AllReduce, (0, seq, 0), payload)
                    .await
                    .expect("send");
                let f = cb.recv(0).await.expect("frame");
                assert_eq!((f.header.seq, &*f.payload), (seq, payload));
                cb.send(channel::COLLECTIVE, Op::AllReduce, (0, seq, 0), payload)
                    .await
                    .expect("send back");
                let f = ca.recv(0).await.expect("frame back");
                assert_eq!((f.header.seq, &*f.payload), (seq, payload));
            }
        });
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A client whose certificate (and CA) are another cluster's fails naming the CA, and
    /// the server refuses it naming its address; the server name is checked too.
    #[test]
    fn a_client_of_another_ca_is_refused() {
        let (a, _, dir) = cluster();
        let other = tempdir("other-ca");
        let stranger = make_certs(&other, &["127.0.0.1"])[0].load().expect("other");
        rt().block_on(async {
            let (client, (_, first)) = pair(Some(a.clone()), Some(stranger), "127.0.0.1").await;
            let c = client.expect_err("the stranger fails").to_string();
            assert!(
                c.contains("TLS handshake with rank 0 (127.0.0.1:")
                    && c.contains("not signed by this job's CA"),
                "{c}"
            );
            let s = first.expect_err("refused").expect("a reason").to_string();
            assert!(
                s.contains("TLS handshake with unranked process at 127.0.0.1:"),
                "{s}"
            );
            // A certificate for another name than the address connected to.
            let (client, _) = pair(Some(a.clone()), Some(a), "localhost").await;
            let c = client.expect_err("wrong name").to_string();
            assert!(c.contains("not valid for localhost"), "{c}");
        });
        let _ = [dir, other].map(std::fs::remove_dir_all);
    }

    /// Plain text against TLS, either way round: refused on the accepting side, and the
    /// connecting side is told what is wrong.
    #[test]
    fn plain_and_tls_do_not_mix() {
        let (a, b, dir) = cluster();
        rt().block_on(async {
            // A plain client at a TLS listener: refused, and told in plain text.
            let (client, (_, first)) = pair(Some(a), None, "127.0.0.1").await;
            let s = first.expect_err("refused").expect("a reason");
            assert!(
                matches!(
                    s,
                    CommError::Rendezvous(RendezvousError::TlsRequired { .. })
                ),
                "{s}"
            );
            let mut plain = client.expect("plain connect does no handshake");
            let deadline = Instant::now() + Duration::from_secs(5);
            let peer = PeerName::ranked(0, "rank 0");
            let cfg = crate::config::CommConfig::default();
            let answer = super::super::recv_ctrl(&mut plain, deadline, &cfg, &peer, "t").await;
            assert!(
                matches!(
                    answer,
                    Ok(Ctrl::Reject(RendezvousError::TlsRequired { .. }))
                ),
                "{answer:?}"
            );
            // A TLS client at a plain listener: refused; the client hears no TLS.
            let (client, (_, first)) = pair(None, Some(b), "127.0.0.1").await;
            let s = first.expect_err("refused").expect("a reason");
            assert!(
                matches!(
                    s,
                    CommError::Rendezvous(RendezvousError::TlsNotConfigured { .. })
                ),
                "{s}"
            );
            let c = client.expect_err("no TLS there").to_string();
            assert!(c.contains("does not speak TLS"), "{c}");
        });
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A stranger that sends nothing, or one byte of a frame and no more, is given up at
    /// the authentication deadline, not the job's (60 s here): on a paused clock the accept
    /// ends `AUTH_DEADLINE` after it began.
    #[test]
    fn a_silent_stranger_is_dropped_at_the_auth_deadline_not_the_jobs() {
        let paused = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .expect("runtime");
        let secret = Secret::new(b"test-secret-0123456789".to_vec()).expect("secret");
        paused.block_on(async {
            for sent in [&b""[..], &[frame::MAGIC][..]] {
                let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
                let mut stranger = TcpStream::connect(l.local_addr().expect("addr"))
                    .await
                    .expect("connect");
                stranger.write_all(sent).await.expect("write");
                let (tcp, from) = l.accept().await.expect("accept");
                let peer = PeerName::unranked(from.to_string());
                let start = Instant::now();
                let job = start + Duration::from_secs(60);
                let p = Purpose::Rendezvous;
                let (_, r) = accept_first(tcp, None, Some(&secret), p, &peer, job).await;
                assert!(matches!(r, Err(None)), "{r:?}");
                let waited = start.elapsed();
                assert!(
                    waited >= AUTH_DEADLINE && waited < AUTH_DEADLINE + Duration::from_secs(1),
                    "gave a stranger that sent {sent:?} {waited:?}"
                );
            }
        });
    }

    /// A silent connection at a TLS listener is given up at the deadline.
    #[test]
    fn a_silent_peer_is_bounded() {
        let (a, _, dir) = cluster();
        rt().block_on(async {
            let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
            let _silent = TcpStream::connect(l.local_addr().expect("addr"))
                .await
                .expect("connect");
            let (tcp, _) = l.accept().await.expect("accept");
            let t = std::time::Instant::now();
            let deadline = Instant::now() + Duration::from_millis(300);
            let peer = PeerName::unranked("silent");
            let (_, r) =
                accept_first(tcp, Some(&a), None, Purpose::Rendezvous, &peer, deadline).await;
            assert!(matches!(r, Err(None)), "{r:?}");
            assert!(t.elapsed() < Duration::from_secs(3));
        });
        let _ = std::fs::remove_dir_all(dir);
    }
}
