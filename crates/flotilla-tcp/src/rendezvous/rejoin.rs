//! Rejoining a running job: a process that replaces a lost rank (a restarted worker of an
//! asynchronous parameter server) takes that rank's place on its links to rank 0 and to its
//! servers.
//!
//! - A rank that accepts rejoins ([`crate::config::Rejoin::Accept`]) keeps a port open for
//!   the whole run ([`serve`]): rank 0 its rendezvous port, another rank its mesh listener.
//!   Every connection to it goes through the same checks as a join (TLS when configured,
//!   then authentication with a secret — for rendezvous at rank 0, for the mesh session elsewhere — then
//!   protocol, world size, rank, config hash) and one more: the rank's connection must be
//!   lost. A stranger, a wrong config or a rank that is still connected is refused and
//!   logged; the job never notices.
//! - The replacement ([`join`], [`crate::config::Rejoin::Join`]) connects to rank 0, sends
//!   `Rejoin { rank, .. }` and gets `Rejoined { session, peers }`; then it does the same at
//!   each of [`crate::CommConfig::rejoin_links`] (its servers), at the address of the peer
//!   table. Each connection becomes that rank's link to the replacement. The links carry
//!   point-to-point messages only: the replacement missed the collectives issued before it
//!   came, so collectives refuse them on both sides.

use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::net::TcpStream;
use tokio::time::{Instant, timeout_at};

use super::inflight::InFlight;
use super::master::check_join;
use super::mesh::peer_address;
use super::{Mesh, Rejoins, authn, client, recv_ctrl, reject, secure, send_ctrl};
use flotilla_group::{CommError, PeerName, RendezvousError};

use crate::auth::Purpose;
use crate::config::CommConfig;
use crate::conn::{Conn, ConnOpts};
use crate::frame;
use crate::net;
use crate::stream::Stream;
use crate::wire::{Ctrl, RENDEZVOUS_PROTOCOL};
use crate::world::World;

const OP: &str = "rejoin";

/// The replacement's side: rank 0 first (for the session and the peer table), then every
/// link of [`CommConfig::rejoin_links`].
pub(super) async fn join(cfg: &CommConfig) -> Result<Mesh, CommError> {
    let Some(rank) = cfg.rank.filter(|&r| r > 0) else {
        return Err(CommError::Config(
            "a process that rejoins a running job needs its rank (RANK, not 0)".into(),
        ));
    };
    let (master, _) = client::connect_master(cfg).await?;
    let deadline = Instant::now() + cfg.timeout;
    let master_host = secure::host_of(&cfg.master_addr).to_owned();
    let (master, session, peers) =
        ask(cfg, master, &master_host, 0, Purpose::Rendezvous, deadline).await?;
    let mut streams: Vec<_> = (0..cfg.world_size).map(|_| None).collect();
    streams[0] = Some(master);
    for &j in cfg.rejoin_links.iter().filter(|&&j| j != 0 && j != rank) {
        let addr = peers.get(j).ok_or_else(|| CommError::BadFrame {
            peer: PeerName::ranked(0, String::new()),
            detail: format!("the peer table has no rank {j}"),
        })?;
        let target = peer_address(j, addr).await?;
        let stream = timeout_at(deadline, net::connect(target, cfg.socket_buffer_bytes))
            .await
            .map_err(|_| CommError::Timeout {
                peer: j,
                op: OP.into(),
                after: cfg.timeout,
            })?
            .map_err(|e| CommError::PeerLost {
                peer: j,
                op: OP.into(),
                reason: e.to_string(),
            })?;
        let purpose = Purpose::Mesh {
            session,
            acceptor: j,
        };
        let host = secure::host_of(addr).to_owned();
        let (stream, _, _) = ask(cfg, stream, &host, j, purpose, deadline).await?;
        streams[j] = Some(stream);
    }
    tracing::info!(rank, links = ?cfg.rejoin_links, "rejoined the running job (point-to-point only)");
    Ok(Mesh {
        rank,
        streams,
        rejoins: None,
        session,
        hosts: Vec::new(),
    })
}

/// Secures (TLS, when configured; `host` is the name its certificate must carry) and
/// authenticates the connection `tcp` to rank `j`, and asks for the lost rank's place; `j`'s
/// answer's session and peer table (rank 0's; empty from others).
async fn ask(
    cfg: &CommConfig,
    tcp: TcpStream,
    host: &str,
    j: usize,
    purpose: Purpose,
    deadline: Instant,
) -> Result<(Stream, u64, Vec<String>), CommError> {
    let rank = cfg.rank.unwrap_or_default();
    let peer = PeerName::ranked(
        j,
        tcp.peer_addr().map(|a| a.to_string()).unwrap_or_default(),
    );
    let mut stream = secure::connect(cfg.tls.as_ref(), tcp, host, &peer, deadline).await?;
    if let Some(secret) = &cfg.secret {
        authn::initiate(&mut stream, secret, purpose, &peer, deadline).await?;
    }
    let req = Ctrl::Rejoin {
        protocol: RENDEZVOUS_PROTOCOL,
        rank,
        world_size: cfg.world_size,
        config_hash: cfg.config_hash,
    };
    send_ctrl(&mut stream, &req)
        .await
        .map_err(|e| CommError::PeerLost {
            peer: j,
            op: OP.into(),
            reason: frame::describe_io(&e),
        })?;
    match recv_ctrl(&mut stream, deadline, cfg, &peer, OP).await? {
        Ctrl::Rejoined { session, peers } => Ok((stream, session, peers)),
        Ctrl::Reject(re) => Err(re.into()),
        other => Err(CommError::BadFrame {
            peer,
            detail: format!("expected Rejoined, got {other:?}"),
        }),
    }
}

/// The accepting side, for the whole run: admits replacements of lost ranks on the kept
/// listener into `world` (ends when the world is gone). Connections are read concurrently,
/// a bounded number at a time ([`InFlight`]: past it the oldest is dropped).
pub(crate) async fn serve(rejoins: Rejoins, world: Weak<World>, opts: ConnOpts) {
    let Some(n) = world.upgrade().map(|w| w.cfg.world_size) else {
        return;
    };
    let mut reading = InFlight::new(n);
    loop {
        let (tcp, addr) = tokio::select! {
            acc = rejoins.listener.accept() => match acc {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "rejoin: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            Some(()) = reading.next() => continue,
        };
        let Some(w) = world.upgrade() else { return };
        let (cfg, me) = (w.cfg.clone(), w.rank);
        drop(w);
        let place = Place {
            world: world.clone(),
            session: rejoins.session,
            peers: if me == 0 {
                rejoins.peers.clone()
            } else {
                Vec::new()
            },
            me,
            opts,
        };
        if let Some(dropped) = reading.start(addr, admit_one(cfg, tcp, addr, place)) {
            tracing::warn!(%dropped, "rejoin: dropped a connection still unread: too many at once");
        }
    }
}

/// What a rejoin's connection is admitted into.
struct Place {
    world: Weak<World>,
    session: u64,
    /// The peer table handed out (rank 0's; empty from others).
    peers: Vec<String>,
    /// This rank.
    me: usize,
    opts: ConnOpts,
}

/// Secures and authenticates one connection, checks its `Rejoin` and lets it in.
async fn admit_one(cfg: CommConfig, tcp: TcpStream, addr: std::net::SocketAddr, place: Place) {
    let _ = tcp.set_nodelay(true);
    let peer = PeerName::unranked(addr.to_string());
    let deadline = Instant::now() + cfg.timeout;
    let purpose = if place.me == 0 {
        Purpose::Rendezvous
    } else {
        Purpose::Mesh {
            session: place.session,
            acceptor: place.me,
        }
    };
    let (tls, secret) = (cfg.tls.as_ref(), cfg.secret.as_ref());
    let (stream, first) = secure::accept_first(tcp, tls, secret, purpose, &peer, deadline).await;
    let Some(mut stream) = stream else {
        if let Err(Some(e)) = first {
            tracing::warn!(%peer, error = %e, "rejoin: refused a connection");
        }
        return;
    };
    let rank = match admit(&cfg, &place.world, &peer, first) {
        Ok(rank) => rank,
        Err(Some(re)) => {
            reject(&mut stream, &re).await;
            tracing::warn!("rejoin: refused {re}; the job goes on");
            return;
        }
        Err(None) => return,
    };
    let welcome = Ctrl::Rejoined {
        session: place.session,
        peers: place.peers,
    };
    if send_ctrl(&mut stream, &welcome).await.is_err() {
        return;
    }
    let Some(w) = place.world.upgrade() else {
        return;
    };
    let conn = Conn::tcp(stream, rank, place.opts, w.ep.clone()).for_point_to_point_only();
    w.revive(rank, Arc::new(conn));
    tracing::warn!(rank, %addr, "rank rejoined the running job");
}

/// Which rank a connection may replace: `Err(Some)` to refuse it with the reason,
/// `Err(None)` to drop it silently (closed, silent, not a Flotilla process).
fn admit(
    cfg: &CommConfig,
    world: &Weak<World>,
    peer: &PeerName,
    first: Result<Ctrl, Option<CommError>>,
) -> Result<usize, Option<RendezvousError>> {
    let (protocol, rank, world_size, config_hash) = match first {
        Ok(Ctrl::Rejoin {
            protocol,
            rank,
            world_size,
            config_hash,
        }) => (protocol, rank, world_size, config_hash),
        Err(Some(CommError::Rendezvous(re))) => return Err(Some(re)),
        Ok(other) => {
            tracing::warn!(%peer, "rejoin: refused a connection that sent {other:?}");
            return Err(None);
        }
        Err(e) => {
            if let Some(e) = e {
                tracing::warn!(%peer, error = %e, "rejoin: refused a connection");
            }
            return Err(None);
        }
    };
    let named = PeerName {
        rank: Some(rank),
        addr: peer.addr.clone(),
    };
    check_join(
        cfg,
        named.clone(),
        protocol,
        Some(rank),
        world_size,
        config_hash,
    )
    .map_err(Some)?;
    let lost = world.upgrade().is_some_and(|w| w.is_lost(rank));
    if !lost {
        return Err(Some(RendezvousError::DuplicateRank {
            peer: named,
            holder: format!("rank {rank}, which is still connected"),
        }));
    }
    Ok(rank)
}
