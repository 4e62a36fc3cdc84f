//! Rendezvous: rank 0 admits every rank, checks it, distributes the peer address table, and
//! the ranks build a full mesh of connections.
//!
//! Protocol (control channel, JSON payloads, see [`crate::wire::Ctrl`]):
//!
//! 1. Every rank other than 0 binds a mesh listener, connects to `master_addr:master_port`
//!    (retrying with backoff until `join_timeout`, since rank 0 may start later) and sends
//!    `Join { rank, world_size, config_hash, token, mesh_addr }`.
//! 2. Rank 0 checks each join as it arrives (protocol version, world size, rank range,
//!    token, config hash, duplicate rank). The first violation fails the rendezvous: the
//!    offender and every joined rank receive `Reject(error)` naming the offender, and rank 0
//!    returns the same error. If not all ranks joined by `join_timeout`, everybody gets a
//!    `JoinTimeout` naming the missing ranks.
//! 3. Rank 0 assigns ranks to processes that did not ask for one (lowest free first) and
//!    sends `Welcome { rank, session, peers }`. The connection to rank 0 stays open and
//!    becomes the data connection between rank 0 and that rank.
//! 4. Rank r (r >= 1) connects to every rank 1 <= j < r and accepts from every j > r, with a
//!    `Hello { session, from, to }` / `HelloAck` handshake, then reports `Ready` (or
//!    `MeshFailed`) to rank 0. When everyone is ready rank 0 sends `Go`.
//!
//! Every wait has a deadline (`join_timeout` for joining, `timeout` for everything else).

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::{Instant, sleep, sleep_until, timeout_at};

use crate::config::CommConfig;
use crate::error::{CommError, PeerName, RendezvousError};
use crate::frame::{self, Op, ReadError, channel};
use crate::net;
use crate::wire::{Ctrl, RENDEZVOUS_PROTOCOL};

/// Result of a successful rendezvous: this process's rank and one stream per peer rank.
pub(crate) struct Mesh {
    pub rank: usize,
    pub streams: Vec<Option<TcpStream>>,
}

/// Runs the rendezvous for `cfg`. `listener` optionally replaces rank 0's own bind.
pub(crate) async fn rendezvous(
    cfg: &CommConfig,
    listener: Option<std::net::TcpListener>,
) -> Result<Mesh, CommError> {
    match (cfg.rank, listener) {
        (Some(0), Some(l)) => {
            l.set_nonblocking(true)
                .map_err(|e| CommError::io("cannot use the given listener", e))?;
            let l = TcpListener::from_std(l)
                .map_err(|e| CommError::io("cannot use the given listener", e))?;
            master(cfg, l).await
        }
        (Some(0), None) => {
            let host = cfg.bind_host.as_deref().unwrap_or(&cfg.master_addr);
            let addr = net::resolve(host, cfg.master_port).await?;
            let l = net::bind_listener(addr, cfg.socket_buffer_bytes)?;
            master(cfg, l).await
        }
        (_, Some(_)) => Err(CommError::Config(
            "only rank 0 can take a pre-bound rendezvous listener".into(),
        )),
        (_, None) => client(cfg).await,
    }
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

/// Best-effort delivery of a rejection (bounded by one second).
async fn reject<W: tokio::io::AsyncWrite + Unpin>(w: &mut W, e: &RendezvousError) {
    let _ = tokio::time::timeout(
        Duration::from_secs(1),
        send_ctrl(w, &Ctrl::Reject(e.clone())),
    )
    .await;
}

fn tokens_equal(a: Option<&str>, b: Option<&str>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => {
            // Length-independent-time comparison of the bytes.
            let (a, b) = (a.as_bytes(), b.as_bytes());
            let mut diff = a.len() ^ b.len();
            for i in 0..a.len().max(b.len()) {
                diff |= (*a.get(i).unwrap_or(&0) ^ *b.get(i).unwrap_or(&0)) as usize;
            }
            diff == 0
        }
        _ => false,
    }
}

struct Member {
    stream: TcpStream,
    addr: SocketAddr,
    mesh_addr: String,
}

type Arrival = (TcpStream, SocketAddr, Result<Ctrl, Option<CommError>>);

/// Rank 0's side of the rendezvous.
async fn master(cfg: &CommConfig, listener: TcpListener) -> Result<Mesh, CommError> {
    let n = cfg.world_size;
    let join_deadline = Instant::now() + cfg.join_timeout;
    tracing::info!(addr = ?listener.local_addr().ok(), world_size = n, "rank 0 waiting for ranks to join");
    let mut slots: Vec<Option<Member>> = (0..n).map(|_| None).collect();
    let mut anon: Vec<Member> = Vec::new();
    let (tx, mut rx) = mpsc::unbounded_channel::<Arrival>();
    // Accepted connections whose join request is still being read.
    let mut in_flight = 0usize;

    let failure: Option<(CommError, RendezvousError)> = loop {
        if slots.iter().flatten().count() + anon.len() >= n - 1 {
            break None;
        }
        tokio::select! {
            acc = listener.accept() => match acc {
                Ok((stream, addr)) => {
                    in_flight += 1;
                    let _ = stream.set_nodelay(true);
                    let (tx, max, t) = (tx.clone(), cfg.max_frame_bytes, cfg.timeout);
                    tokio::spawn(async move {
                        let mut stream = stream;
                        let peer = PeerName::unranked(addr.to_string());
                        let res = match tokio::time::timeout(t, frame::read_frame(&mut stream, max, &peer)).await {
                            Err(_) | Ok(Err(ReadError::Io(_))) => Err(None),
                            Ok(Err(ReadError::Comm(e))) => Err(Some(e)),
                            Ok(Ok((_, payload))) => Ctrl::decode(&payload)
                                .map_err(|detail| Some(CommError::BadFrame { peer: peer.clone(), detail })),
                        };
                        let _ = tx.send((stream, addr, res));
                    });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    sleep(Duration::from_millis(20)).await;
                }
            },
            Some((mut stream, addr, res)) = rx.recv() => { in_flight -= 1; match res {
                Err(None) => tracing::debug!(%addr, "connection closed or silent before joining; ignored"),
                Err(Some(e)) => {
                    let re = RendezvousError::MasterFailed { reason: e.to_string() };
                    break Some((e, re));
                }
                Ok(Ctrl::Join { protocol, rank, world_size, config_hash, token, mesh_addr }) => {
                    let peer = PeerName { rank, addr: addr.to_string() };
                    let check = if protocol != RENDEZVOUS_PROTOCOL {
                        Err(RendezvousError::ProtocolVersion { peer, expected: RENDEZVOUS_PROTOCOL, got: protocol })
                    } else if world_size != n {
                        Err(RendezvousError::WorldSizeMismatch { peer, expected: n, got: world_size })
                    } else if rank.is_some_and(|r| r >= n || r == 0) {
                        Err(if rank == Some(0) {
                            RendezvousError::DuplicateRank { peer, holder: "rank 0 (the master)".into() }
                        } else {
                            RendezvousError::RankOutOfRange { peer, world_size: n }
                        })
                    } else if !tokens_equal(token.as_deref(), cfg.token.as_deref()) {
                        Err(RendezvousError::TokenMismatch { peer })
                    } else if config_hash != cfg.config_hash {
                        Err(RendezvousError::ConfigHashMismatch { peer, expected: cfg.config_hash, got: config_hash })
                    } else if let Some(holder) = rank.and_then(|r| slots[r].as_ref()) {
                        Err(RendezvousError::DuplicateRank { peer, holder: holder.addr.to_string() })
                    } else {
                        Ok(())
                    };
                    if let Err(re) = check {
                        tracing::error!(error = %re, "rejecting join");
                        reject(&mut stream, &re).await;
                        break Some((re.clone().into(), re));
                    }
                    tracing::debug!(?rank, %addr, "rank joined");
                    let m = Member { stream, addr, mesh_addr };
                    match rank {
                        Some(r) => slots[r] = Some(m),
                        None => anon.push(m),
                    }
                }
                Ok(other) => {
                    let e = CommError::BadFrame {
                        peer: PeerName::unranked(addr.to_string()),
                        detail: format!("expected a join request, got {other:?}"),
                    };
                    let re = RendezvousError::MasterFailed { reason: e.to_string() };
                    break Some((e, re));
                }
            }},
            _ = sleep_until(join_deadline) => {
                let missing: Vec<String> = slots.iter().enumerate().skip(1)
                    .filter(|(_, s)| s.is_none()).map(|(i, _)| i.to_string()).collect();
                // Unranked joiners will take the lowest free slots; the rest are missing.
                let missing = missing[anon.len().min(missing.len())..].join(", ");
                let re = RendezvousError::JoinTimeout {
                    after: cfg.join_timeout,
                    missing,
                    present: 1 + slots.iter().flatten().count() + anon.len(),
                    world_size: n,
                };
                break Some((re.clone().into(), re));
            }
        }
    };
    if let Some((e, re)) = failure {
        abort_members(&mut slots, &mut anon, &re).await;
        // Processes accepted but not yet admitted learn the failure too.
        let drain_deadline = Instant::now() + Duration::from_secs(1);
        while in_flight > 0 {
            let Ok(Some((mut stream, _, _))) = timeout_at(drain_deadline, rx.recv()).await else {
                break;
            };
            in_flight -= 1;
            reject(&mut stream, &re).await;
        }
        linger(listener, re, cfg.join_timeout.min(Duration::from_secs(5)));
        return Err(e);
    }
    drop(listener);

    // Assign ranks to processes that did not ask for one.
    let mut anon = anon.into_iter();
    for slot in slots.iter_mut().skip(1) {
        if slot.is_none() {
            *slot = anon.next();
        }
    }
    let session: u64 = rand::random();
    let peers: Vec<String> = slots
        .iter()
        .map(|s| s.as_ref().map(|m| m.mesh_addr.clone()).unwrap_or_default())
        .collect();
    let mut readers: Vec<Option<OwnedReadHalf>> = Vec::with_capacity(n);
    let mut writers: Vec<Option<OwnedWriteHalf>> = Vec::with_capacity(n);
    for slot in slots {
        let (r, w) = match slot {
            Some(m) => {
                let (r, w) = m.stream.into_split();
                (Some(r), Some(w))
            }
            None => (None, None),
        };
        readers.push(r);
        writers.push(w);
    }

    // Welcome everybody, then wait until all report their mesh as ready.
    let step_deadline = Instant::now() + cfg.timeout;
    for (rank, w) in writers.iter_mut().enumerate() {
        let Some(w) = w else { continue };
        let msg = Ctrl::Welcome {
            rank,
            session,
            peers: peers.clone(),
        };
        let sent = timeout_at(step_deadline, send_ctrl(w, &msg)).await;
        if !matches!(sent, Ok(Ok(()))) {
            let e = CommError::PeerLost {
                peer: rank,
                op: "rendezvous (welcome)".into(),
                reason: "could not send the peer table".into(),
            };
            abort_writers(
                &mut writers,
                &RendezvousError::MasterFailed {
                    reason: e.to_string(),
                },
            )
            .await;
            return Err(e);
        }
    }
    // The mesh phase itself waits up to `timeout` on each rank; allow for that plus slack.
    let ready_deadline = Instant::now() + cfg.timeout * 2 + Duration::from_secs(1);
    let (rtx, mut rrx) = mpsc::unbounded_channel();
    for (rank, r) in readers.iter_mut().enumerate() {
        let Some(mut half) = r.take() else { continue };
        let (rtx, cfg) = (rtx.clone(), cfg.clone());
        tokio::spawn(async move {
            let peer = PeerName::ranked(
                rank,
                half.peer_addr().map(|a| a.to_string()).unwrap_or_default(),
            );
            let res = recv_ctrl(
                &mut half,
                ready_deadline,
                &cfg,
                &peer,
                "rendezvous (mesh ready)",
            )
            .await;
            let _ = rtx.send((rank, half, peer, res));
        });
    }
    drop(rtx);
    for _ in 1..n {
        let Some((rank, half, peer, res)) = rrx.recv().await else {
            break;
        };
        readers[rank] = Some(half);
        let err: Option<CommError> = match res {
            Ok(Ctrl::Ready) => None,
            Ok(Ctrl::MeshFailed { reason }) => {
                Some(RendezvousError::MeshFailed { peer, reason }.into())
            }
            Ok(other) => Some(CommError::BadFrame {
                peer,
                detail: format!("expected Ready, got {other:?}"),
            }),
            Err(e) => Some(e),
        };
        if let Some(e) = err {
            let re = match &e {
                CommError::Rendezvous(re) => re.clone(),
                other => RendezvousError::MasterFailed {
                    reason: other.to_string(),
                },
            };
            abort_writers(&mut writers, &re).await;
            return Err(e);
        }
    }
    let go_deadline = Instant::now() + cfg.timeout;
    let mut streams: Vec<Option<TcpStream>> = Vec::with_capacity(n);
    for (rank, (r, w)) in readers.into_iter().zip(writers).enumerate() {
        match (r, w) {
            (Some(r), Some(mut w)) => {
                if !matches!(
                    timeout_at(go_deadline, send_ctrl(&mut w, &Ctrl::Go)).await,
                    Ok(Ok(()))
                ) {
                    return Err(CommError::PeerLost {
                        peer: rank,
                        op: "rendezvous (go)".into(),
                        reason: "could not send".into(),
                    });
                }
                let s = r
                    .reunite(w)
                    .map_err(|_| CommError::Config("internal: mismatched stream halves".into()))?;
                streams.push(Some(s));
            }
            _ => streams.push(None),
        }
    }
    tracing::info!(world_size = n, "rendezvous complete");
    Ok(Mesh { rank: 0, streams })
}

/// After a failed rendezvous, keeps rejecting late joiners with the failure for `grace` on
/// a detached thread, so they report the real cause instead of "master unreachable".
fn linger(listener: TcpListener, re: RendezvousError, grace: Duration) {
    let Ok(std_listener) = listener.into_std() else {
        return;
    };
    let spawned = std::thread::Builder::new()
        .name("flotilla-rdzv-linger".into())
        .spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async move {
                let Ok(listener) = TcpListener::from_std(std_listener) else {
                    return;
                };
                let _ = tokio::time::timeout(grace, async {
                    while let Ok((mut s, _)) = listener.accept().await {
                        let re = re.clone();
                        tokio::spawn(async move {
                            // Read the join request first so the rejection is not lost to a reset.
                            let _ = tokio::time::timeout(
                                Duration::from_secs(1),
                                frame::read_frame(&mut s, 1 << 20, &PeerName::unranked("")),
                            )
                            .await;
                            reject(&mut s, &re).await;
                        });
                    }
                })
                .await;
            });
        });
    if let Err(e) = spawned {
        tracing::debug!(error = %e, "could not start the rendezvous linger thread");
    }
}

async fn abort_members(slots: &mut [Option<Member>], anon: &mut [Member], re: &RendezvousError) {
    for m in slots.iter_mut().flatten().chain(anon.iter_mut()) {
        reject(&mut m.stream, re).await;
    }
}

async fn abort_writers(writers: &mut [Option<OwnedWriteHalf>], re: &RendezvousError) {
    for w in writers.iter_mut().flatten() {
        reject(w, re).await;
    }
}

/// A non-zero rank's side of the rendezvous.
async fn client(cfg: &CommConfig) -> Result<Mesh, CommError> {
    let n = cfg.world_size;
    let join_deadline = Instant::now() + cfg.join_timeout;
    let master_desc = format!("{}:{}", cfg.master_addr, cfg.master_port);
    let mut backoff = Duration::from_millis(20);
    let mut master = loop {
        let attempt = async {
            let addr = net::resolve(&cfg.master_addr, cfg.master_port)
                .await
                .map_err(|e| e.to_string())?;
            net::connect(addr, cfg.socket_buffer_bytes)
                .await
                .map_err(|e| e.to_string())
        };
        let last_error = match timeout_at(join_deadline, attempt).await {
            Ok(Ok(s)) => break s,
            Ok(Err(e)) => e,
            Err(_) => "connect timed out".to_string(),
        };
        if Instant::now() + backoff >= join_deadline {
            return Err(CommError::MasterUnreachable {
                addr: master_desc,
                after: cfg.join_timeout,
                last_error,
            });
        }
        sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(1));
    };
    let connected_at = Instant::now();
    let master_peer = PeerName::ranked(
        0,
        master
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or(master_desc),
    );

    // Mesh listener on the interface that reaches rank 0 (unless configured).
    let local_ip: IpAddr = master
        .local_addr()
        .map_err(|e| CommError::io("cannot read local address", e))?
        .ip();
    let bind_ip = match &cfg.bind_host {
        Some(h) => net::resolve(h, 0).await?.ip(),
        None => local_ip,
    };
    let listener = net::bind_listener(SocketAddr::new(bind_ip, 0), cfg.socket_buffer_bytes)?;
    let port = listener
        .local_addr()
        .map_err(|e| CommError::io("cannot read listener address", e))?
        .port();
    let adv_ip = if bind_ip.is_unspecified() {
        local_ip
    } else {
        bind_ip
    };
    let mesh_addr = match &cfg.advertise_host {
        Some(h) => format!("{h}:{port}"),
        None => SocketAddr::new(adv_ip, port).to_string(),
    };

    let join = Ctrl::Join {
        protocol: RENDEZVOUS_PROTOCOL,
        rank: cfg.rank,
        world_size: n,
        config_hash: cfg.config_hash,
        token: cfg.token.clone(),
        mesh_addr,
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
    let (rank, session, peers) = match recv_ctrl(
        &mut master,
        welcome_deadline,
        cfg,
        &master_peer,
        "rendezvous (join)",
    )
    .await
    {
        Ok(Ctrl::Welcome {
            rank,
            session,
            peers,
        }) => (rank, session, peers),
        Ok(Ctrl::Reject(re)) => return Err(re.into()),
        Ok(other) => {
            return Err(CommError::BadFrame {
                peer: master_peer,
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
    if rank == 0 || rank >= n || peers.len() != n {
        return Err(CommError::BadFrame {
            peer: master_peer,
            detail: format!("invalid welcome: rank {rank}, {} peers", peers.len()),
        });
    }
    tracing::debug!(rank, "joined; building the peer mesh");

    let mut streams = match build_mesh(cfg, rank, session, &peers, listener).await {
        Ok(s) => s,
        Err(e) => {
            let _ = tokio::time::timeout(
                Duration::from_secs(1),
                send_ctrl(
                    &mut master,
                    &Ctrl::MeshFailed {
                        reason: e.to_string(),
                    },
                ),
            )
            .await;
            return Err(e);
        }
    };
    send_ctrl(&mut master, &Ctrl::Ready)
        .await
        .map_err(|e| CommError::PeerLost {
            peer: 0,
            op: "rendezvous (ready)".into(),
            reason: frame::describe_io(&e),
        })?;
    let go_deadline = Instant::now() + cfg.timeout * 2 + grace;
    match recv_ctrl(
        &mut master,
        go_deadline,
        cfg,
        &master_peer,
        "rendezvous (waiting for go)",
    )
    .await?
    {
        Ctrl::Go => {}
        Ctrl::Reject(re) => return Err(re.into()),
        other => {
            return Err(CommError::BadFrame {
                peer: master_peer,
                detail: format!("expected Go, got {other:?}"),
            });
        }
    }
    streams[0] = Some(master);
    Ok(Mesh { rank, streams })
}

/// Connects to ranks `1..rank` and accepts ranks `rank+1..n`.
async fn build_mesh(
    cfg: &CommConfig,
    rank: usize,
    session: u64,
    peers: &[String],
    listener: TcpListener,
) -> Result<Vec<Option<TcpStream>>, CommError> {
    let n = peers.len();
    let deadline = Instant::now() + cfg.timeout;
    let connects = async {
        let mut out = Vec::new();
        for (j, addr) in peers.iter().enumerate().take(rank).skip(1) {
            let peer = PeerName::ranked(j, addr.clone());
            let op = "mesh handshake";
            let lost = |reason: String| CommError::PeerLost {
                peer: j,
                op: op.into(),
                reason,
            };
            let target: SocketAddr = match addr.parse() {
                Ok(a) => a,
                Err(_) => match addr
                    .rsplit_once(':')
                    .and_then(|(h, p)| Some((h, p.parse::<u16>().ok()?)))
                {
                    Some((h, p)) => net::resolve(h, p).await?,
                    None => {
                        return Err(CommError::BadFrame {
                            peer,
                            detail: format!("bad mesh address {addr:?}"),
                        });
                    }
                },
            };
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
                            op: op.into(),
                            after: cfg.timeout,
                        });
                    }
                }
            };
            send_ctrl(
                &mut stream,
                &Ctrl::Hello {
                    session,
                    from: rank,
                    to: j,
                },
            )
            .await
            .map_err(|e| lost(frame::describe_io(&e)))?;
            match recv_ctrl(&mut stream, deadline, cfg, &peer, op).await? {
                Ctrl::HelloAck { from } if from == j => out.push((j, stream)),
                other => {
                    return Err(CommError::BadFrame {
                        peer,
                        detail: format!("expected HelloAck from rank {j}, got {other:?}"),
                    });
                }
            }
        }
        Ok::<_, CommError>(out)
    };
    let accepts = async {
        let mut got: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
        let mut missing = n - rank - 1;
        while missing > 0 {
            let (mut stream, addr) = match timeout_at(deadline, listener.accept()).await {
                Ok(Ok(x)) => x,
                Ok(Err(e)) => return Err(CommError::io("mesh accept failed", e)),
                Err(_) => {
                    let first = (rank + 1..n).find(|&j| got[j].is_none()).unwrap_or(rank);
                    let list: Vec<String> = (rank + 1..n)
                        .filter(|&j| got[j].is_none())
                        .map(|j| j.to_string())
                        .collect();
                    return Err(CommError::Timeout {
                        peer: first,
                        op: format!(
                            "mesh handshake (rank(s) {} never connected to rank {rank})",
                            list.join(", ")
                        ),
                        after: cfg.timeout,
                    });
                }
            };
            let _ = stream.set_nodelay(true);
            let peer = PeerName::unranked(addr.to_string());
            match recv_ctrl(&mut stream, deadline, cfg, &peer, "mesh handshake").await {
                Ok(Ctrl::Hello {
                    session: s,
                    from,
                    to,
                }) if s == session
                    && to == rank
                    && from > rank
                    && from < n
                    && got[from].is_none() =>
                {
                    send_ctrl(&mut stream, &Ctrl::HelloAck { from: rank })
                        .await
                        .map_err(|e| CommError::PeerLost {
                            peer: from,
                            op: "mesh handshake".into(),
                            reason: frame::describe_io(&e),
                        })?;
                    got[from] = Some(stream);
                    missing -= 1;
                }
                other => tracing::warn!(%addr, msg = ?other, "ignoring unexpected mesh connection"),
            }
        }
        Ok::<_, CommError>(got)
    };
    let (out, mut got) = tokio::try_join!(connects, accepts)?;
    for (j, s) in out {
        got[j] = Some(s);
    }
    Ok(got)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_comparison() {
        assert!(tokens_equal(None, None));
        assert!(tokens_equal(Some("abc"), Some("abc")));
        assert!(!tokens_equal(Some("abc"), Some("abd")));
        assert!(!tokens_equal(Some("abc"), Some("abcd")));
        assert!(!tokens_equal(Some("abc"), None));
    }
}
