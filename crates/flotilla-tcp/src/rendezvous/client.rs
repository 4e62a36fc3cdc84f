//! A non-zero rank's side of the rendezvous: reach rank 0, join, take the welcome, build the
//! mesh, report ready and wait for `Go`.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::time::{Instant, sleep, timeout_at};

use super::authn;
use super::mesh::build_mesh;
use super::secure;
use super::{Mesh, recv_ctrl, send_ctrl};
use flotilla_group::{CommError, PeerName};

use crate::auth::Purpose;
use crate::config::CommConfig;
use crate::frame;
use crate::net;
use crate::stream::Stream;
use crate::wire::{Ctrl, RENDEZVOUS_PROTOCOL};

/// What rank 0's welcome says.
struct Welcome {
    rank: usize,
    session: u64,
    peers: Vec<String>,
    hosts: Vec<String>,
}

/// A non-zero rank's side of the rendezvous.
pub(super) async fn client(cfg: &CommConfig) -> Result<Mesh, CommError> {
    let (master, connected_at) = connect_master(cfg).await?;
    let master_peer = PeerName::ranked(
        0,
        master
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| format!("{}:{}", cfg.master_addr, cfg.master_port)),
    );
    let host = secure::host_of(&cfg.master_addr);
    let deadline = Instant::now() + cfg.timeout;
    let mut master =
        secure::connect(cfg.tls.as_ref(), master, host, &master_peer, deadline).await?;
    if let Some(secret) = &cfg.secret {
        let deadline = Instant::now() + cfg.timeout;
        authn::initiate(
            &mut master,
            secret,
            Purpose::Rendezvous,
            &master_peer,
            deadline,
        )
        .await?;
        tracing::debug!("authenticated with rank 0");
    }
    let (listener, mesh_addr) = mesh_listener(cfg, &master).await?;
    let join = Ctrl::Join {
        protocol: RENDEZVOUS_PROTOCOL,
        rank: cfg.rank,
        world_size: cfg.world_size,
        config_hash: cfg.config_hash,
        mesh_addr,
        host: crate::host::host_key(cfg.shm_dir.as_deref()),
    };
    send_ctrl(&mut master, &join)
        .await
        .map_err(|e| CommError::PeerLost {
            peer: 0,
            op: "rendezvous (join)".into(),
            reason: frame::describe_io(&e),
        })?;
    // Rank 0 reports a join timeout at its own deadline, which is never later than ours
    // measured from the moment we reached it; the grace period lets that report arrive.
    let grace = cfg.timeout.min(Duration::from_secs(5));
    let welcome_deadline = connected_at + cfg.join_timeout + grace;
    let w = await_welcome(cfg, &mut master, &master_peer, welcome_deadline, grace).await?;
    tracing::debug!(rank = w.rank, "joined; building the peer mesh");
    let (mut streams, listener) = match build_mesh(cfg, (w.rank, 1), w.session, &w.peers, listener)
        .await
    {
        Ok(s) => s,
        Err(e) => {
            let failed = Ctrl::MeshFailed {
                reason: e.to_string(),
            };
            let _ =
                tokio::time::timeout(Duration::from_secs(1), send_ctrl(&mut master, &failed)).await;
            return Err(e);
        }
    };
    ready_and_go(cfg, &mut master, &master_peer, grace).await?;
    streams[0] = Some(master);
    // Kept open for lost children that rejoin, when the job lets them.
    let rejoins = (cfg.rejoin == crate::config::Rejoin::Accept).then_some(super::Rejoins {
        listener,
        session: w.session,
        peers: w.peers,
    });
    Ok(Mesh {
        rank: w.rank,
        streams,
        rejoins,
        session: w.session,
        hosts: w.hosts,
    })
}

/// Connects to rank 0, retrying with backoff until the join deadline (rank 0 may start
/// later). Returns the stream and when it connected.
pub(super) async fn connect_master(cfg: &CommConfig) -> Result<(TcpStream, Instant), CommError> {
    let join_deadline = Instant::now() + cfg.join_timeout;
    let mut backoff = Duration::from_millis(20);
    loop {
        let attempt = async {
            let addr = net::resolve(&cfg.master_addr, cfg.master_port)
                .await
                .map_err(|e| e.to_string())?;
            net::connect(addr, cfg.socket_buffer_bytes)
                .await
                .map_err(|e| e.to_string())
        };
        let last_error = match timeout_at(join_deadline, attempt).await {
            Ok(Ok(s)) => return Ok((s, Instant::now())),
            Ok(Err(e)) => e,
            Err(_) => "connect timed out".to_string(),
        };
        if Instant::now() + backoff >= join_deadline {
            return Err(CommError::MasterUnreachable {
                addr: format!("{}:{}", cfg.master_addr, cfg.master_port),
                after: cfg.join_timeout,
                last_error,
            });
        }
        sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

/// The mesh listener, bound on the interface that reaches rank 0 and any free port (unless
/// configured: [`CommConfig::bind_host`], [`CommConfig::mesh_port`]), and the address to
/// advertise for it ([`CommConfig::advertise_host`], [`CommConfig::advertise_port`]).
async fn mesh_listener(
    cfg: &CommConfig,
    master: &Stream,
) -> Result<(TcpListener, String), CommError> {
    let local_ip: IpAddr = master
        .local_addr()
        .map_err(|e| CommError::io("cannot read local address", e))?
        .ip();
    mesh_listener_at(cfg, local_ip).await
}

/// [`mesh_listener`] where `local_ip` is the interface that reaches the rendezvous.
pub(super) async fn mesh_listener_at(
    cfg: &CommConfig,
    local_ip: IpAddr,
) -> Result<(TcpListener, String), CommError> {
    let bind_ip = match &cfg.bind_host {
        Some(h) => net::resolve(h, 0).await?.ip(),
        None => local_ip,
    };
    let bind = SocketAddr::new(bind_ip, cfg.mesh_port.unwrap_or(0));
    let listener = net::bind_listener(bind, cfg.socket_buffer_bytes)?;
    let bound = listener
        .local_addr()
        .map_err(|e| CommError::io("cannot read listener address", e))?
        .port();
    let port = cfg.advertise_port.unwrap_or(bound);
    let adv_ip = if bind_ip.is_unspecified() {
        local_ip
    } else {
        bind_ip
    };
    let mesh_addr = match &cfg.advertise_host {
        Some(h) => format!("{h}:{port}"),
        None => SocketAddr::new(adv_ip, port).to_string(),
    };
    Ok((listener, mesh_addr))
}

/// Rank 0's answer to the join: a checked welcome, or its rejection as the error.
async fn await_welcome(
    cfg: &CommConfig,
    master: &mut Stream,
    master_peer: &PeerName,
    deadline: Instant,
    grace: Duration,
) -> Result<Welcome, CommError> {
    let op = "rendezvous (join)";
    let (rank, session, peers, hosts) =
        match recv_ctrl(master, deadline, cfg, master_peer, op).await {
            Ok(Ctrl::Welcome {
                rank,
                session,
                peers,
                hosts,
            }) => (rank, session, peers, hosts),
            Ok(Ctrl::Reject(re)) => return Err(re.into()),
            Ok(other) => {
                return Err(CommError::BadFrame {
                    peer: master_peer.clone(),
                    detail: format!("expected Welcome, got {other:?}"),
                });
            }
            Err(CommError::Timeout { .. }) => {
                return Err(CommError::Timeout {
                    peer: 0,
                    op: "rendezvous (waiting for all ranks to join)".into(),
                    after: cfg.join_timeout + grace,
                });
            }
            Err(e) => return Err(e),
        };
    let n = cfg.world_size;
    if rank == 0 || rank >= n || peers.len() != n || hosts.len() != n {
        return Err(CommError::BadFrame {
            peer: master_peer.clone(),
            detail: format!(
                "invalid welcome: rank {rank}, {} peers, {} hosts",
                peers.len(),
                hosts.len()
            ),
        });
    }
    Ok(Welcome {
        rank,
        session,
        peers,
        hosts,
    })
}

/// Reports the mesh ready and waits for rank 0's `Go`.
async fn ready_and_go(
    cfg: &CommConfig,
    master: &mut Stream,
    master_peer: &PeerName,
    grace: Duration,
) -> Result<(), CommError> {
    send_ctrl(master, &Ctrl::Ready)
        .await
        .map_err(|e| CommError::PeerLost {
            peer: 0,
            op: "rendezvous (ready)".into(),
            reason: frame::describe_io(&e),
        })?;
    let go_deadline = Instant::now() + cfg.timeout * 2 + grace;
    let op = "rendezvous (waiting for go)";
    match recv_ctrl(master, go_deadline, cfg, master_peer, op).await? {
        Ctrl::Go => Ok(()),
        Ctrl::Reject(re) => Err(re.into()),
        other => Err(CommError::BadFrame {
            peer: master_peer.clone(),
            detail: format!("expected Go, got {other:?}"),
        }),
    }
}
