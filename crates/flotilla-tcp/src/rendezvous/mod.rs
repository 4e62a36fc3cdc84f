//! Rendezvous: rank 0 admits every rank, checks it, distributes the peer address table, and
//! the ranks build a full mesh of connections.
//!
//! Protocol (control channel, JSON payloads, see [`crate::wire::Ctrl`]):
//!
//! 0. With TLS, every connection (the join connection and every mesh connection) is wrapped
//!    in mutual TLS right after the TCP connect or accept ([`secure`]): the accepting side is
//!    the TLS server, both present a certificate of the cluster CA; a peer without TLS, or
//!    with another CA's certificate, is refused and logged like any stranger. Then, with a
//!    cluster secret, every connection (the join connection and every mesh
//!    connection) opens with the mutual challenge-response of [`crate::auth`] (`Auth`
//!    frames, [`authn`]); a peer that fails it or skips it is refused before anything else it
//!    sends is read, and frames from an unauthenticated peer are read with a small limit.
//! 1. Every rank other than 0 binds a mesh listener, connects to `master_addr:master_port`
//!    (retrying with backoff until `join_timeout`, since rank 0 may start later),
//!    authenticates, and sends `Join { rank, world_size, config_hash, mesh_addr, host }`
//!    (`host`: its host key, [`crate::host::host_key`]).
//! 2. Rank 0 checks each join as it arrives (authentication, protocol version, world size,
//!    rank range, config hash, duplicate rank). A join that fails is told why
//!    (`Reject(error)` naming it), logged and remembered; rank 0 keeps waiting. If not all
//!    ranks joined by `join_timeout`, everybody gets a `JoinTimeout` naming the missing
//!    ranks and what was refused meanwhile.
//! 3. Rank 0 assigns ranks to processes that did not ask for one (lowest free first) and
//!    sends `Welcome { rank, session, peers, hosts }` (every rank's mesh address and host
//!    key: the groups whose members share a host exchange through shared memory). The connection to rank 0 stays open and
//!    becomes the data connection between rank 0 and that rank.
//! 4. Rank r (r >= 1) connects to every rank 1 <= j < r and accepts from every j > r, with a
//!    `Hello { session, from, to }` / `HelloAck` handshake (after authentication), then reports `Ready` (or
//!    `MeshFailed`) to rank 0. When everyone is ready rank 0 sends `Go`.
//!
//! Rank 0 listens on `master_port`, on a socket its launcher bound for it
//! ([`crate::inherited`]), or, with `master_port` 0, on a port the system picks, which it then
//! says ([`announce`]).
//!
//! Every wait has a deadline (`join_timeout` for joining, `timeout` for everything else).

pub(crate) mod announce;
mod authn;
pub(crate) mod beacon;
mod client;
pub(crate) mod elastic;
mod inflight;
pub(crate) mod lighthouse;
mod master;
mod mesh;
mod quorum;
mod refusals;
pub(crate) mod rejoin;
mod replicas;
mod secure;

use std::sync::Once;
use std::time::Duration;

use flotilla_group::{CommError, PeerName, RendezvousError};
use tokio::net::TcpListener;
use tokio::time::{Instant, timeout_at};

use crate::config::CommConfig;
use crate::frame::{self, Op, channel};
use crate::net;
use crate::stream::Stream;
use crate::wire::Ctrl;

/// Result of a successful rendezvous: this process's rank and one stream per peer rank
/// (and what lets lost ranks back in, when the job accepts rejoins).
pub(crate) struct Mesh {
    pub rank: usize,
    pub streams: Vec<Option<Stream>>,
    pub rejoins: Option<Rejoins>,
    /// The job's session nonce (rank 0's random number, the same on every rank).
    pub session: u64,
    /// Each rank's host key (empty for a rejoined rank: it never shares memory).
    pub hosts: Vec<String>,
}

/// What a rank that takes lost ranks back keeps from the rendezvous: its listener (rank 0's
/// rendezvous port, another rank's mesh listener), the session and the peer table.
pub(crate) struct Rejoins {
    pub listener: TcpListener,
    pub session: u64,
    pub peers: Vec<String>,
}

/// Runs the rendezvous for `cfg`. `listener` optionally replaces rank 0's own bind.
pub(crate) async fn rendezvous(
    cfg: &CommConfig,
    listener: Option<std::net::TcpListener>,
) -> Result<Mesh, CommError> {
    unauthenticated_allowed(cfg)?;
    secure::announce(cfg.tls.as_ref());
    // Rank 0 started by a launcher that bound the port for it takes that listener.
    let listener = match (cfg.rank, listener) {
        (Some(0), None) => crate::inherited::take_listener(cfg.master_port),
        (_, given) => given,
    };
    match (cfg.rank, listener) {
        (Some(0), Some(l)) => {
            l.set_nonblocking(true)
                .map_err(|e| CommError::io("cannot use the given listener", e))?;
            let l = TcpListener::from_std(l)
                .map_err(|e| CommError::io("cannot use the given listener", e))?;
            master::master(cfg, l).await
        }
        (Some(0), None) => {
            let host = cfg.bind_host.as_deref().unwrap_or(&cfg.master_addr);
            let addr = net::resolve(host, cfg.master_port).await?;
            let l = net::bind_listener(addr, cfg.socket_buffer_bytes)?;
            if cfg.master_port == 0 {
                let port = l
                    .local_addr()
                    .map_err(|e| CommError::io("reading the rendezvous port", e))?
                    .port();
                announce::announce(port);
            }
            master::master(cfg, l).await
        }
        (_, Some(_)) => Err(CommError::Config(
            "only rank 0 can take a pre-bound rendezvous listener".into(),
        )),
        (_, None) if cfg.rejoin == crate::config::Rejoin::Join => rejoin::join(cfg).await,
        (_, None) => client::client(cfg).await,
    }
}

/// Whether this rank may listen and connect: with a secret or TLS (the certificates
/// authenticate both ends of every connection), or, with neither, only when the user said
/// `insecure` (then with a warning on every rank). Refused at once otherwise, before any
/// socket is opened, saying how to make a secret.
pub(crate) fn unauthenticated_allowed(cfg: &CommConfig) -> Result<(), CommError> {
    if cfg.secret.is_some() || cfg.tls.is_some() {
        return Ok(());
    }
    if !cfg.insecure {
        return Err(CommError::Config(format!(
            "rank {}: no cluster secret, so this rank will not listen or connect (anyone who \
             reaches the job's ports could join it and read or poison its parameters): {}",
            cfg.rank.map_or("?".to_owned(), |r| r.to_string()),
            crate::HOW_TO_MAKE_A_SECRET
        )));
    }
    static UNAUTHENTICATED: Once = Once::new();
    UNAUTHENTICATED.call_once(|| {
        tracing::warn!(
            "insecure: no cluster secret and no TLS; this job's connections are not \
             authenticated, and any process that reaches its ports can join it"
        );
    });
    Ok(())
}

async fn send_ctrl<W: tokio::io::AsyncWrite + Unpin>(w: &mut W, msg: &Ctrl) -> std::io::Result<()> {
    frame::write_frame(w, channel::CONTROL, Op::Control, 0, 0, &msg.encode()).await
}

/// Reads one control message before `deadline`.
async fn recv_ctrl<R: tokio::io::AsyncRead + Unpin>(
    r: &mut R,
    deadline: Instant,
    cfg: &CommConfig,
    peer: &PeerName,
    during: &str,
) -> Result<Ctrl, CommError> {
    let (h, payload) =
        match timeout_at(deadline, frame::read_frame(r, cfg.max_frame_bytes, peer)).await {
            Err(_) => {
                return Err(match peer.rank {
                    Some(rank) => CommError::Timeout {
                        peer: rank,
                        op: during.to_string(),
                        after: cfg.timeout,
                    },
                    None => CommError::Rendezvous(RendezvousError::MasterFailed {
                        reason: format!("{peer} went silent during {during}"),
                    }),
                });
            }
            Ok(r) => r.map_err(|e| e.into_comm(peer, during))?,
        };
    if h.channel != channel::CONTROL {
        return Err(CommError::BadFrame {
            peer: peer.clone(),
            detail: format!("data frame on channel {} during {during}", h.channel),
        });
    }
    Ctrl::decode(&payload).map_err(|detail| CommError::BadFrame {
        peer: peer.clone(),
        detail,
    })
}

/// Best-effort delivery of a rejection (bounded by one second), without what only the job
/// knows ([`RendezvousError::redacted`]: a refused peer learns nothing of the job).
async fn reject<W: tokio::io::AsyncWrite + Unpin>(w: &mut W, e: &RendezvousError) {
    let _ = tokio::time::timeout(
        Duration::from_secs(1),
        send_ctrl(w, &Ctrl::Reject(e.redacted())),
    )
    .await;
}
