//! The mesh (step 4 of the protocol): rank r connects to every rank 1 <= j < r and accepts
//! from every j > r, each connection opened by a `Hello { session, from, to }` / `HelloAck`
//! handshake. Rank 0's connections are the rendezvous ones.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::time::{Instant, sleep, timeout_at};

use super::{recv_ctrl, send_ctrl};
use crate::config::CommConfig;
use crate::error::{CommError, PeerName};
use crate::frame;
use crate::net;
use crate::wire::Ctrl;

const HANDSHAKE: &str = "mesh handshake";

/// Connects to ranks `1..rank` and accepts ranks `rank+1..n`.
pub(super) async fn build_mesh(
    cfg: &CommConfig,
    rank: usize,
    session: u64,
    peers: &[String],
    listener: TcpListener,
) -> Result<Vec<Option<TcpStream>>, CommError> {
    let deadline = Instant::now() + cfg.timeout;
    let connects = async {
        let mut out = Vec::new();
        for (j, addr) in peers.iter().enumerate().take(rank).skip(1) {
            out.push((
                j,
                connect_lower(cfg, rank, session, j, addr, deadline).await?,
            ));
        }
        Ok::<_, CommError>(out)
    };
    let accepts = accept_higher(cfg, rank, session, peers.len(), listener, deadline);
    let (out, mut got) = tokio::try_join!(connects, accepts)?;
    for (j, s) in out {
        got[j] = Some(s);
    }
    Ok(got)
}

/// Where rank `j` listens: its advertised `addr`, resolved if it is a host name.
async fn peer_address(j: usize, addr: &str) -> Result<SocketAddr, CommError> {
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
) -> Result<TcpStream, CommError> {
    let peer = PeerName::ranked(j, addr.to_string());
    let lost = |reason: String| CommError::PeerLost {
        peer: j,
        op: HANDSHAKE.into(),
        reason,
    };
    let target = peer_address(j, addr).await?;
    let mut backoff = Duration::from_millis(10);
    let mut stream = loop {
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

/// Accepts the connections of ranks `rank+1..n`; a connection that is not one of them (wrong
/// session, rank or a duplicate, garbage, or silence) is logged and dropped. Handshakes are
/// read concurrently, so a silent stranger holding a connection open delays nobody.
async fn accept_higher(
    cfg: &CommConfig,
    rank: usize,
    session: u64,
    n: usize,
    listener: TcpListener,
    deadline: Instant,
) -> Result<Vec<Option<TcpStream>>, CommError> {
    let mut got: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
    let mut missing = n - rank - 1;
    let mut reading = tokio::task::JoinSet::new();
    while missing > 0 {
        tokio::select! {
            acc = timeout_at(deadline, listener.accept()) => match acc {
                Ok(Ok((stream, addr))) => {
                    let cfg = cfg.clone();
                    reading.spawn(async move { read_hello(stream, addr, &cfg, deadline).await });
                }
                Ok(Err(e)) => return Err(CommError::io("mesh accept failed", e)),
                Err(_) => return Err(never_connected(cfg, rank, &got)),
            },
            Some(Ok((mut stream, addr, hello))) = reading.join_next() => match hello {
                Ok(Ctrl::Hello { session: s, from, to })
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
                other => tracing::warn!(%addr, msg = ?other, "dropped a mesh connection that is not a rank of this job"),
            },
        }
    }
    Ok(got)
}

/// Reads the first message of a mesh connection.
async fn read_hello(
    mut stream: TcpStream,
    addr: SocketAddr,
    cfg: &CommConfig,
    deadline: Instant,
) -> (TcpStream, SocketAddr, Result<Ctrl, CommError>) {
    let _ = stream.set_nodelay(true);
    let peer = PeerName::unranked(addr.to_string());
    let hello = recv_ctrl(&mut stream, deadline, cfg, &peer, HANDSHAKE).await;
    (stream, addr, hello)
}

/// The timeout naming the higher ranks that never connected.
fn never_connected(cfg: &CommConfig, rank: usize, got: &[Option<TcpStream>]) -> CommError {
    let absent: Vec<usize> = (rank + 1..got.len())
        .filter(|&j| got[j].is_none())
        .collect();
    let list: Vec<String> = absent.iter().map(|j| j.to_string()).collect();
    CommError::Timeout {
        peer: absent.first().copied().unwrap_or(rank),
        op: format!(
            "mesh handshake (rank(s) {} never connected to rank {rank})",
            list.join(", ")
        ),
        after: cfg.timeout,
    }
}
