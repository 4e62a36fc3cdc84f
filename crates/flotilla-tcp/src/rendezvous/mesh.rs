//! The mesh (step 4 of the protocol): rank r connects to every rank 1 <= j < r and accepts
//! from every j > r, each connection opened (after TLS and the authentication handshake,
//! when configured) by a `Hello { session, from, to }` / `HelloAck` handshake. Rank 0's
//! connections are the rendezvous ones.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::time::{Instant, sleep, timeout_at};

use super::inflight::InFlight;
use super::refusals::Refusals;
use super::{authn, recv_ctrl, secure, send_ctrl};
use flotilla_group::{CommError, PeerName};

use crate::auth::Purpose;
use crate::config::CommConfig;
use crate::frame;
use crate::net;
use crate::secret::Secret;
use crate::stream::Stream;
use crate::tls::TlsConfig;
use crate::wire::Ctrl;

const HANDSHAKE: &str = "mesh handshake";

/// Connects to ranks `first..rank` and accepts ranks `rank+1..n` (on `listener`, handed
/// back for the rejoins of a job that takes lost ranks back). `first`: 1 when rank 0's
/// connections are the rendezvous' own, 0 in an elastic job (the lighthouse keeps none).
pub(super) async fn build_mesh(
    cfg: &CommConfig,
    (rank, first): (usize, usize),
    session: u64,
    peers: &[String],
    listener: TcpListener,
) -> Result<(Vec<Option<Stream>>, TcpListener), CommError> {
    let deadline = Instant::now() + cfg.timeout;
    let connects = async {
        let mut out = Vec::new();
        for (j, addr) in peers.iter().enumerate().take(rank).skip(first) {
            out.push((
                j,
                connect_lower(cfg, rank, session, j, addr, deadline).await?,
            ));
        }
        Ok::<_, CommError>(out)
    };
    let accepts = accept_higher(cfg, rank, session, peers.len(), &listener, deadline);
    let (out, mut got) = tokio::try_join!(connects, accepts)?;
    for (j, s) in out {
        got[j] = Some(s);
    }
    Ok((got, listener))
}

/// Where rank `j` listens: its advertised `addr`, resolved if it is a host name.
pub(super) async fn peer_address(j: usize, addr: &str) -> Result<SocketAddr, CommError> {
    if let Ok(a) = addr.parse() {
        return Ok(a);
    }
    match addr
        .rsplit_once(':')
        .and_then(|(h, p)| Some((h, p.parse::<u16>().ok()?)))
    {
        Some((h, p)) => net::resolve(h, p).await,
        None => Err(CommError::BadFrame {
            peer: PeerName::ranked(j, addr.to_string()),
            detail: format!("bad mesh address {addr:?}"),
        }),
    }
}

/// Opens this rank's connection to the lower rank `j` (retrying until `deadline`, since `j`
/// may not listen yet) and shakes hands.
async fn connect_lower(
    cfg: &CommConfig,
    rank: usize,
    session: u64,
    j: usize,
    addr: &str,
    deadline: Instant,
) -> Result<Stream, CommError> {
    let peer = PeerName::ranked(j, addr.to_string());
    let lost = |reason: String| CommError::PeerLost {
        peer: j,
        op: HANDSHAKE.into(),
        reason,
    };
    let target = peer_address(j, addr).await?;
    let mut backoff = Duration::from_millis(10);
    let tcp = loop {
        match timeout_at(deadline, net::connect(target, cfg.socket_buffer_bytes)).await {
            Ok(Ok(s)) => break s,
            Ok(Err(e)) if Instant::now() + backoff < deadline => {
                tracing::debug!(peer = j, error = %e, "mesh connect failed; retrying");
                sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_millis(500));
            }
            Ok(Err(e)) => return Err(lost(e.to_string())),
            Err(_) => {
                return Err(CommError::Timeout {
                    peer: j,
                    op: HANDSHAKE.into(),
                    after: cfg.timeout,
                });
            }
        }
    };
    let host = secure::host_of(addr);
    let mut stream = secure::connect(cfg.tls.as_ref(), tcp, host, &peer, deadline).await?;
    if let Some(secret) = &cfg.secret {
        let purpose = Purpose::Mesh {
            session,
            acceptor: j,
        };
        authn::initiate(&mut stream, secret, purpose, &peer, deadline).await?;
    }
    let hello = Ctrl::Hello {
        session,
        from: rank,
        to: j,
    };
    send_ctrl(&mut stream, &hello)
        .await
        .map_err(|e| lost(frame::describe_io(&e)))?;
    match recv_ctrl(&mut stream, deadline, cfg, &peer, HANDSHAKE).await? {
        Ctrl::HelloAck { from } if from == j => Ok(stream),
        other => Err(CommError::BadFrame {
            peer,
            detail: format!("expected HelloAck from rank {j}, got {other:?}"),
        }),
    }
}

/// Accepts the connections of ranks `rank+1..n`; a connection that is not one of them (failed
/// authentication, wrong session, rank or a duplicate, garbage, or silence) is logged and
/// dropped (and named if the deadline passes). Handshakes are read concurrently, so a silent
/// stranger holding a connection open delays nobody (nor do many: see [`InFlight`]).
async fn accept_higher(
    cfg: &CommConfig,
    rank: usize,
    session: u64,
    n: usize,
    listener: &TcpListener,
    deadline: Instant,
) -> Result<Vec<Option<Stream>>, CommError> {
    let mut got: Vec<Option<Stream>> = (0..n).map(|_| None).collect();
    let mut missing = n - rank - 1;
    let mut reading = InFlight::new(missing);
    let mut refused = Refusals::default();
    let purpose = Purpose::Mesh {
        session,
        acceptor: rank,
    };
    while missing > 0 {
        tokio::select! {
            acc = timeout_at(deadline, listener.accept()) => match acc {
                Ok(Ok((stream, addr))) => {
                    let (secret, tls) = (cfg.secret.clone(), cfg.tls.clone());
                    let read = read_hello(stream, addr, tls, secret, purpose, deadline);
                    if let Some(dropped) = reading.start(addr, read) {
                        tracing::warn!(%dropped, "dropped a mesh connection still unread: too many at once");
                        refused.push(format!("a connection from {dropped}, dropped unread: more than {} at once", reading.cap()));
                    }
                }
                Ok(Err(e)) => return Err(CommError::io("mesh accept failed", e)),
                Err(_) => return Err(never_connected(cfg, rank, &got, &refused)),
            },
            Some((stream, addr, hello)) = reading.next() => match (stream, hello) {
                (Some(mut stream), Ok(Ctrl::Hello { session: s, from, to }))
                    if s == session && to == rank && from > rank && from < n && got[from].is_none() =>
                {
                    send_ctrl(&mut stream, &Ctrl::HelloAck { from: rank })
                        .await
                        .map_err(|e| CommError::PeerLost {
                            peer: from,
                            op: HANDSHAKE.into(),
                            reason: frame::describe_io(&e),
                        })?;
                    got[from] = Some(stream);
                    missing -= 1;
                }
                (_, Err(None)) => tracing::debug!(%addr, "mesh connection closed or silent; ignored"),
                (_, Err(Some(e))) => {
                    tracing::warn!(%addr, "refused a mesh connection: {e}");
                    refused.push(e.to_string());
                }
                (_, Ok(other)) => {
                    tracing::warn!(%addr, msg = ?other, "dropped a mesh connection that is not a rank of this job");
                    refused.push(format!("a connection from {addr} that is not a rank of this job"));
                }
            },
        }
    }
    Ok(got)
}

/// Secures (with `tls`) and authenticates (with a `secret`) a mesh connection and reads its
/// first message (`Err(None)`: closed or silent; no stream: lost during the TLS handshake).
async fn read_hello(
    stream: TcpStream,
    addr: SocketAddr,
    tls: Option<TlsConfig>,
    secret: Option<Secret>,
    purpose: Purpose,
    deadline: Instant,
) -> (Option<Stream>, SocketAddr, Result<Ctrl, Option<CommError>>) {
    let _ = stream.set_nodelay(true);
    let peer = PeerName::unranked(addr.to_string());
    let (s, t) = (tls.as_ref(), secret.as_ref());
    let (stream, hello) = secure::accept_first(stream, s, t, purpose, &peer, deadline).await;
    (stream, addr, hello)
}

/// The timeout naming the higher ranks that never connected (and what was refused).
fn never_connected(
    cfg: &CommConfig,
    rank: usize,
    got: &[Option<Stream>],
    refused: &Refusals,
) -> CommError {
    let absent: Vec<usize> = (rank + 1..got.len())
        .filter(|&j| got[j].is_none())
        .collect();
    let list: Vec<String> = absent.iter().map(|j| j.to_string()).collect();
    CommError::Timeout {
        peer: absent.first().copied().unwrap_or(rank),
        op: format!(
            "mesh handshake (rank(s) {} never connected to rank {rank}{})",
            list.join(", "),
            refused.note()
        ),
        after: cfg.timeout,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_group::RendezvousError;

    fn cfg(secret: Option<&str>) -> CommConfig {
        let secret = secret.map(|s| Secret::new(format!("{s}-0123456789abcdef")).expect("secret"));
        CommConfig::new(Some(1), 3)
            .with_timeout(Duration::from_secs(3))
            .with_secret(secret)
    }

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
    }

    /// Rank 1 of 3 accepts rank 2 on its mesh listener while strangers knock first: one
    /// with the wrong secret, one with the right secret but another session's proof, one
    /// that skips authentication. Each is refused; rank 2 (the right secret) gets in.
    #[test]
    fn mesh_strangers_without_the_secret_are_refused_and_the_rank_gets_in() {
        rt().block_on(async {
            let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
            let addr = listener.local_addr().expect("addr").to_string();
            let deadline = Instant::now() + Duration::from_secs(5);
            let acceptor_cfg = cfg(Some("job-secret"));
            let accept = tokio::spawn(async move {
                accept_higher(&acceptor_cfg, 1, 42, 3, &listener, deadline).await
            });
            let peer = PeerName::ranked(1, addr.clone());
            let target: SocketAddr = addr.parse().expect("addr");
            let knock = |secret: &str, session: u64| {
                let secret = Secret::new(format!("{secret}-0123456789abcdef"));
                let peer = peer.clone();
                async move {
                    let mut s = TcpStream::connect(target).await.expect("connect");
                    let purpose = Purpose::Mesh {
                        session,
                        acceptor: 1,
                    };
                    authn::initiate(&mut s, &secret.expect("secret"), purpose, &peer, deadline)
                        .await
                }
            };
            let e = knock("wrong-secret", 42).await.expect_err("wrong secret");
            assert!(
                e.to_string().contains("authentication failed: rank 1")
                    && e.to_string().contains("does not share this job's secret"),
                "{e}"
            );
            knock("job-secret", 7)
                .await
                .expect_err("another session's proof");
            // Skipping authentication: a bare hello is answered with a rejection.
            let mut s = TcpStream::connect(target).await.expect("connect");
            let hello = Ctrl::Hello {
                session: 42,
                from: 2,
                to: 1,
            };
            send_ctrl(&mut s, &hello).await.expect("send");
            let answer = recv_ctrl(&mut s, deadline, &cfg(None), &peer, "test").await;
            assert!(
                matches!(
                    answer,
                    Ok(Ctrl::Reject(RendezvousError::AuthRequired { .. }))
                ),
                "{answer:?}"
            );
            let rank2 = connect_lower(&cfg(Some("job-secret")), 2, 42, 1, &addr, deadline)
                .await
                .expect("rank 2 connects");
            let got = accept.await.expect("task").expect("accepted");
            assert!(got[2].is_some());
            drop(rank2);
        });
    }

    /// When the rank never comes, the deadline's error names the refused stranger.
    #[test]
    fn the_mesh_deadline_names_refused_strangers() {
        rt().block_on(async {
            let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
            let addr = listener.local_addr().expect("addr").to_string();
            let deadline = Instant::now() + Duration::from_millis(1500);
            let acceptor_cfg = cfg(Some("job-secret"));
            let accept = tokio::spawn(async move {
                accept_higher(&acceptor_cfg, 1, 42, 3, &listener, deadline).await
            });
            let stranger = connect_lower(&cfg(Some("guess")), 2, 42, 1, &addr, deadline).await;
            assert!(stranger.is_err());
            let e = accept.await.expect("task").expect_err("times out");
            let msg = e.to_string();
            assert!(
                msg.contains("refused meanwhile") && msg.contains("authentication failed"),
                "{msg}"
            );
        });
    }
}
