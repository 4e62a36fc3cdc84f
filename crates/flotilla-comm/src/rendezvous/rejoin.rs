//! Rejoining a running job: a process that replaces a lost rank (a restarted worker of an
//! asynchronous parameter server) takes that rank's place on its link to rank 0.
//!
//! - Rank 0 of a job that accepts rejoins ([`crate::config::Rejoin::Accept`]) keeps its
//!   rendezvous port open for the whole run ([`serve`]). Every connection to it goes through
//!   the same checks as a join (authentication with a secret first, then protocol, world
//!   size, rank, config hash) and one more: the rank's connection must be lost. A stranger,
//!   a wrong config or a rank that is still connected is refused and logged; the job never
//!   notices.
//! - The replacement ([`join`], [`crate::config::Rejoin::Join`]) connects to rank 0 only,
//!   sends `Rejoin { rank, .. }` and gets `Rejoined`; the connection becomes rank 0's link to
//!   that rank. It carries point-to-point messages only: the replacement missed the
//!   collectives issued before it came, so collectives refuse the link on both sides.

use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::time::Instant;

use super::master::check_join;
use super::{Mesh, authn, client, recv_ctrl, reject, send_ctrl};
use crate::auth::Purpose;
use crate::config::CommConfig;
use crate::conn::{Conn, ConnOpts};
use crate::error::{CommError, PeerName, RendezvousError};
use crate::frame;
use crate::wire::{Ctrl, RENDEZVOUS_PROTOCOL};
use crate::world::World;

const OP: &str = "rejoin";

/// The replacement's side: connect to rank 0, authenticate, ask for the rank's place.
pub(super) async fn join(cfg: &CommConfig) -> Result<Mesh, CommError> {
    let Some(rank) = cfg.rank.filter(|&r| r > 0) else {
        return Err(CommError::Config(
            "a process that rejoins a running job needs its rank (RANK, not 0)".into(),
        ));
    };
    let (mut master, _) = client::connect_master(cfg).await?;
    let peer = PeerName::ranked(
        0,
        master
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| format!("{}:{}", cfg.master_addr, cfg.master_port)),
    );
    let deadline = Instant::now() + cfg.timeout;
    if let Some(secret) = &cfg.secret {
        authn::initiate(&mut master, secret, Purpose::Rendezvous, &peer, deadline).await?;
    }
    let ask = Ctrl::Rejoin {
        protocol: RENDEZVOUS_PROTOCOL,
        rank,
        world_size: cfg.world_size,
        config_hash: cfg.config_hash,
    };
    send_ctrl(&mut master, &ask)
        .await
        .map_err(|e| CommError::PeerLost {
            peer: 0,
            op: OP.into(),
            reason: frame::describe_io(&e),
        })?;
    match recv_ctrl(&mut master, deadline, cfg, &peer, OP).await? {
        Ctrl::Rejoined => {}
        Ctrl::Reject(re) => return Err(re.into()),
        other => {
            return Err(CommError::BadFrame {
                peer,
                detail: format!("expected Rejoined, got {other:?}"),
            });
        }
    }
    tracing::info!(
        rank,
        "rejoined the running job (point-to-point with rank 0 only)"
    );
    let mut streams: Vec<_> = (0..cfg.world_size).map(|_| None).collect();
    streams[0] = Some(master);
    Ok(Mesh {
        rank,
        streams,
        listener: None,
    })
}

/// Rank 0's side, for the whole run: admits replacements of lost ranks on `listener` into
/// `world` (ends when the world is gone).
pub(crate) async fn serve(listener: TcpListener, world: Weak<World>, opts: ConnOpts) {
    loop {
        let (mut stream, addr) = match listener.accept().await {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "rejoin: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Some(w) = world.upgrade() else { return };
        let cfg = w.cfg.clone();
        drop(w);
        let world = world.clone();
        tokio::spawn(async move {
            let _ = stream.set_nodelay(true);
            let peer = PeerName::unranked(addr.to_string());
            let deadline = Instant::now() + cfg.timeout;
            let secret = cfg.secret.as_ref();
            let first =
                authn::accept_first(&mut stream, secret, Purpose::Rendezvous, &peer, deadline)
                    .await;
            let rank = match admit(&cfg, &world, &peer, first) {
                Ok(rank) => rank,
                Err(Some(re)) => {
                    reject(&mut stream, &re).await;
                    tracing::warn!("rejoin: refused {re}; the job goes on");
                    return;
                }
                Err(None) => return,
            };
            if send_ctrl(&mut stream, &Ctrl::Rejoined).await.is_err() {
                return;
            }
            let Some(w) = world.upgrade() else { return };
            let conn = Conn::tcp(stream, rank, opts, w.ep.clone()).for_point_to_point_only();
            w.revive(rank, Arc::new(conn));
            tracing::warn!(rank, %addr, "rank rejoined the running job");
        });
    }
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
