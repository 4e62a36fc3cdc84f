//! Rank 0's side of the rendezvous: admit every rank (steps 2-3 of the protocol), welcome
//! them with the peer table, wait until every mesh is ready, then say `Go` (step 4).

use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::{Instant, sleep, sleep_until, timeout_at};

use super::authn;
use super::inflight::InFlight;
use super::refusals::Refusals;
use super::secure;
use super::{recv_ctrl, reject, send_ctrl};
use flotilla_group::{CommError, PeerName, RendezvousError};

use crate::auth::Purpose;
use crate::config::{CommConfig, Rejoin};
use crate::stream::{ReadHalf, Stream, WriteHalf};
use crate::wire::{Ctrl, RENDEZVOUS_PROTOCOL};

use super::Mesh;

/// A process admitted to the job.
struct Member {
    stream: Stream,
    addr: SocketAddr,
    mesh_addr: String,
    /// Its host key.
    host: String,
}

/// An accepted connection and its first message (`Err(None)`: closed or silent; no stream:
/// lost during the TLS handshake, always with an error).
type Arrival = (Option<Stream>, SocketAddr, Result<Ctrl, Option<CommError>>);

/// A failure to report locally and to every rank that joined.
type Failure = (CommError, RendezvousError);

/// Rank 0's side of the rendezvous.
pub(super) async fn master(cfg: &CommConfig, listener: TcpListener) -> Result<Mesh, CommError> {
    let n = cfg.world_size;
    tracing::info!(addr = ?listener.local_addr().ok(), world_size = n, "rank 0 waiting for ranks to join");
    let mut admission = Admission::new(cfg);
    if let Some((e, re)) = admission.run(&listener).await {
        admission.fail(&re).await;
        linger(listener, re, cfg.join_timeout.min(Duration::from_secs(5)));
        return Err(e);
    }
    let (members, peers, hosts) = admission.assign_ranks();
    let (mut readers, mut writers) = split_streams(members);
    let session: u64 = rand::random();
    welcome(cfg, &mut writers, session, &peers, &hosts).await?;
    // Kept open for ranks that rejoin the running job, when the job lets them.
    let rejoins = (cfg.rejoin == Rejoin::Accept).then_some(super::Rejoins {
        listener,
        session,
        peers: peers.clone(),
    });
    await_ready(cfg, &mut readers, &mut writers).await?;
    let streams = go(cfg, readers, writers).await?;
    tracing::info!(world_size = n, "rendezvous complete");
    Ok(Mesh {
        rank: 0,
        streams,
        rejoins,
        session,
        hosts,
    })
}

/// Step 2: the processes that joined so far, and those still being read.
struct Admission<'a> {
    cfg: &'a CommConfig,
    slots: Vec<Option<Member>>,
    anon: Vec<Member>,
    /// Accepted connections whose join request is still being read (a bounded number).
    in_flight: InFlight<Arrival>,
    /// Connections refused so far, with the reason (named in a join timeout; the last few).
    refused: Refusals,
}

impl<'a> Admission<'a> {
    fn new(cfg: &'a CommConfig) -> Self {
        Self {
            cfg,
            slots: (0..cfg.world_size).map(|_| None).collect(),
            anon: Vec::new(),
            in_flight: InFlight::new(cfg.world_size),
            refused: Refusals::default(),
        }
    }

    fn joined(&self) -> usize {
        self.slots.iter().flatten().count() + self.anon.len()
    }

    /// Admits joins until all `n - 1` ranks are in (`None`) or the first failure.
    async fn run(&mut self, listener: &TcpListener) -> Option<Failure> {
        let join_deadline = Instant::now() + self.cfg.join_timeout;
        while self.joined() < self.cfg.world_size - 1 {
            tokio::select! {
                acc = listener.accept() => match acc {
                    Ok((stream, addr)) => self.read_join(stream, addr),
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        sleep(Duration::from_millis(20)).await;
                    }
                },
                Some((stream, addr, res)) = self.in_flight.next() => {
                    if let Some(f) = self.on_arrival(stream, addr, res).await {
                        return Some(f);
                    }
                }
                _ = sleep_until(join_deadline) => return Some(self.timed_out()),
            }
        }
        None
    }

    /// Secures (with TLS) and authenticates (with a secret) an accepted connection and reads
    /// its first message, on a task of its own (at the cap of connections being read, the
    /// oldest is dropped first: see [`InFlight`]).
    fn read_join(&mut self, stream: TcpStream, addr: SocketAddr) {
        let _ = stream.set_nodelay(true);
        let (secret, tls) = (self.cfg.secret.clone(), self.cfg.tls.clone());
        let deadline = Instant::now() + self.cfg.timeout;
        let read = async move {
            let peer = PeerName::unranked(addr.to_string());
            let p = Purpose::Rendezvous;
            let (stream, res) =
                secure::accept_first(stream, tls.as_ref(), secret.as_ref(), p, &peer, deadline)
                    .await;
            (stream, addr, res)
        };
        if let Some(dropped) = self.in_flight.start(addr, read) {
            let cap = self.in_flight.cap();
            self.refuse(format!(
                "a connection from {dropped}: dropped before it joined, the oldest of more \
                 than {cap} being read at once"
            ));
        }
    }

    /// Logs and remembers a refused connection; the rendezvous goes on waiting for the real
    /// ranks (a stranger, a port scanner or a misconfigured process never breaks a job).
    fn refuse(&mut self, why: String) {
        tracing::warn!("rendezvous: refused {why}; still waiting for the job's ranks");
        self.refused.push(why);
    }

    /// [`Admission::refuse`] of a join that failed its checks: the full reason in rank 0's
    /// log, what the peer was told ([`RendezvousError::redacted`]) in the list.
    fn refuse_join(&mut self, re: &RendezvousError) {
        tracing::warn!("rendezvous: refused a join: {re}; still waiting for the job's ranks");
        self.refused.push(format!("a join: {}", re.redacted()));
    }

    /// Admits a valid join. Anything else is refused (a join that fails its checks is told
    /// why, so that process fails with the reason) and the rendezvous goes on.
    async fn on_arrival(
        &mut self,
        stream: Option<Stream>,
        addr: SocketAddr,
        res: Result<Ctrl, Option<CommError>>,
    ) -> Option<Failure> {
        let (protocol, rank, world_size, config_hash, mesh_addr, host) = match res {
            Err(None) => {
                tracing::debug!(%addr, "connection closed or silent before joining; ignored");
                return None;
            }
            Err(Some(CommError::Rendezvous(re))) => {
                self.refuse(format!("a connection ({re})"));
                return None;
            }
            Ok(Ctrl::Auth(_)) => {
                let re = RendezvousError::AuthNotConfigured {
                    peer: PeerName::unranked(addr.to_string()),
                };
                if let Some(mut stream) = stream {
                    reject(&mut stream, &re).await;
                }
                self.refuse(format!("a connection ({re})"));
                return None;
            }
            Err(Some(e)) => {
                self.refuse(format!("a connection that is not a Flotilla rank ({e})"));
                return None;
            }
            Ok(Ctrl::Join {
                protocol,
                rank,
                world_size,
                config_hash,
                mesh_addr,
                host,
            }) => (protocol, rank, world_size, config_hash, mesh_addr, host),
            Ok(other) => {
                let kind = format!("{other:?}");
                let kind = kind.split([' ', '{', '(']).next().unwrap_or_default();
                self.refuse(format!(
                    "a connection from {addr} that sent `{kind}` instead of a join request"
                ));
                return None;
            }
        };
        // An answer always comes with its stream (only a TLS failure loses it).
        let mut stream = stream?;
        let peer = PeerName {
            rank,
            addr: addr.to_string(),
        };
        let check = self.check(peer, protocol, rank, world_size, config_hash);
        if let Err(re) = check {
            reject(&mut stream, &re).await;
            self.refuse_join(&re);
            return None;
        }
        tracing::debug!(?rank, %addr, "rank joined");
        let m = Member {
            stream,
            addr,
            mesh_addr,
            host,
        };
        match rank {
            Some(r) => self.slots[r] = Some(m),
            None => self.anon.push(m),
        }
        None
    }

    /// Whether an (authenticated) join may be admitted: protocol, world size, rank, config,
    /// duplicates.
    fn check(
        &self,
        peer: PeerName,
        protocol: u32,
        rank: Option<usize>,
        world_size: usize,
        config_hash: u64,
    ) -> Result<(), RendezvousError> {
        check_join(
            self.cfg,
            peer.clone(),
            protocol,
            rank,
            world_size,
            config_hash,
        )?;
        match rank.and_then(|r| self.slots[r].as_ref()) {
            Some(holder) => Err(RendezvousError::DuplicateRank {
                peer,
                holder: holder.addr.to_string(),
            }),
            None => Ok(()),
        }
    }

    /// The join deadline passed: which ranks are missing.
    fn timed_out(&self) -> Failure {
        let missing: Vec<String> = (1..self.cfg.world_size)
            .filter(|&i| self.slots[i].is_none())
            .map(|i| i.to_string())
            .collect();
        // Unranked joiners will take the lowest free slots; the rest are missing.
        let missing = missing[self.anon.len().min(missing.len())..].join(", ");
        let (refused, refused_earlier) = self.refused.parts();
        let re = RendezvousError::JoinTimeout {
            after: self.cfg.join_timeout,
            missing,
            present: 1 + self.joined(),
            world_size: self.cfg.world_size,
            refused,
            refused_earlier,
        };
        (re.clone().into(), re)
    }

    /// Tells every admitted process, and those accepted but not yet admitted whose join
    /// arrives within a second (after authentication, with a secret), of `re`.
    async fn fail(&mut self, re: &RendezvousError) {
        for m in self.slots.iter_mut().flatten().chain(self.anon.iter_mut()) {
            reject(&mut m.stream, re).await;
        }
        let drain_deadline = Instant::now() + Duration::from_secs(1);
        while self.in_flight.len() > 0 {
            let Ok(Some(arrival)) = timeout_at(drain_deadline, self.in_flight.next()).await else {
                break;
            };
            // Anything else is no rank of this job and learns nothing of it.
            if let (Some(mut stream), _, Ok(Ctrl::Join { .. })) = arrival {
                reject(&mut stream, re).await;
            }
        }
    }

    /// Step 3: processes that did not ask for a rank take the lowest free ones. Returns the
    /// members by rank, the peer table (each rank's mesh address) and each rank's host key
    /// (rank 0's own first).
    fn assign_ranks(self) -> (Vec<Option<Member>>, Vec<String>, Vec<String>) {
        let (mut slots, mut anon) = (self.slots, self.anon.into_iter());
        for slot in slots.iter_mut().skip(1) {
            if slot.is_none() {
                *slot = anon.next();
            }
        }
        let table = slots
            .iter()
            .map(|s| s.as_ref().map(|m| m.mesh_addr.clone()).unwrap_or_default())
            .collect();
        let mut hosts: Vec<String> = slots
            .iter()
            .map(|s| s.as_ref().map(|m| m.host.clone()).unwrap_or_default())
            .collect();
        hosts[0] = crate::host::host_key(self.cfg.shm_dir.as_deref());
        (slots, table, hosts)
    }
}

type Readers = Vec<Option<ReadHalf>>;
type Writers = Vec<Option<WriteHalf>>;

/// Each member's stream as read and write halves, by rank.
fn split_streams(slots: Vec<Option<Member>>) -> (Readers, Writers) {
    slots
        .into_iter()
        .map(|slot| match slot {
            Some(m) => {
                let (r, w) = m.stream.into_split();
                (Some(r), Some(w))
            }
            None => (None, None),
        })
        .unzip()
}

/// Sends every rank its `Welcome` with the session, the peer table and the host keys.
async fn welcome(
    cfg: &CommConfig,
    writers: &mut Writers,
    session: u64,
    peers: &[String],
    hosts: &[String],
) -> Result<(), CommError> {
    let deadline = Instant::now() + cfg.timeout;
    for rank in 0..writers.len() {
        let Some(w) = writers[rank].as_mut() else {
            continue;
        };
        let msg = Ctrl::Welcome {
            rank,
            session,
            peers: peers.to_vec(),
            hosts: hosts.to_vec(),
        };
        let sent = timeout_at(deadline, send_ctrl(w, &msg)).await;
        if !matches!(sent, Ok(Ok(()))) {
            let e = CommError::PeerLost {
                peer: rank,
                op: "rendezvous (welcome)".into(),
                reason: "could not send the peer table".into(),
            };
            let re = RendezvousError::MasterFailed {
                reason: e.to_string(),
            };
            abort_writers(writers, &re).await;
            return Err(e);
        }
    }
    Ok(())
}

/// Waits until every rank reports its mesh `Ready`; the first other answer fails them all.
async fn await_ready(
    cfg: &CommConfig,
    readers: &mut Readers,
    writers: &mut Writers,
) -> Result<(), CommError> {
    // The mesh phase itself waits up to `timeout` on each rank; allow for that plus slack.
    let deadline = Instant::now() + cfg.timeout * 2 + Duration::from_secs(1);
    let (tx, mut rx) = mpsc::unbounded_channel();
    for (rank, r) in readers.iter_mut().enumerate() {
        let Some(mut half) = r.take() else { continue };
        let (tx, cfg) = (tx.clone(), cfg.clone());
        tokio::spawn(async move {
            let addr = half.peer_addr().map(|a| a.to_string()).unwrap_or_default();
            let peer = PeerName::ranked(rank, addr);
            let op = "rendezvous (mesh ready)";
            let res = recv_ctrl(&mut half, deadline, &cfg, &peer, op).await;
            let _ = tx.send((rank, half, peer, res));
        });
    }
    drop(tx);
    for _ in 1..cfg.world_size {
        let Some((rank, half, peer, res)) = rx.recv().await else {
            break;
        };
        readers[rank] = Some(half);
        let err: CommError = match res {
            Ok(Ctrl::Ready) => continue,
            Ok(Ctrl::MeshFailed { reason }) => RendezvousError::MeshFailed { peer, reason }.into(),
            Ok(other) => CommError::BadFrame {
                peer,
                detail: format!("expected Ready, got {other:?}"),
            },
            Err(e) => e,
        };
        let re = match &err {
            CommError::Rendezvous(re) => re.clone(),
            other => RendezvousError::MasterFailed {
                reason: other.to_string(),
            },
        };
        abort_writers(writers, &re).await;
        return Err(err);
    }
    Ok(())
}

/// Whether a join (or a rejoin) fits this job: protocol, world size, rank, config.
pub(super) fn check_join(
    cfg: &CommConfig,
    peer: PeerName,
    protocol: u32,
    rank: Option<usize>,
    world_size: usize,
    config_hash: u64,
) -> Result<(), RendezvousError> {
    let n = cfg.world_size;
    if protocol != RENDEZVOUS_PROTOCOL {
        Err(RendezvousError::ProtocolVersion {
            peer,
            expected: RENDEZVOUS_PROTOCOL,
            got: protocol,
        })
    } else if world_size != n {
        Err(RendezvousError::WorldSizeMismatch {
            peer,
            expected: n,
            got: world_size,
        })
    } else if rank == Some(0) {
        Err(RendezvousError::DuplicateRank {
            peer,
            holder: "rank 0 (the master)".into(),
        })
    } else if rank.is_some_and(|r| r >= n) {
        Err(RendezvousError::RankOutOfRange {
            peer,
            world_size: n,
        })
    } else if config_hash != cfg.config_hash {
        Err(RendezvousError::ConfigHashMismatch {
            peer,
            expected: Some(cfg.config_hash),
            got: config_hash,
        })
    } else {
        Ok(())
    }
}

/// Sends `Go` to every rank and reunites each connection for data.
async fn go(
    cfg: &CommConfig,
    readers: Readers,
    writers: Writers,
) -> Result<Vec<Option<Stream>>, CommError> {
    let deadline = Instant::now() + cfg.timeout;
    let mut streams: Vec<Option<Stream>> = Vec::with_capacity(readers.len());
    for (rank, (r, w)) in readers.into_iter().zip(writers).enumerate() {
        let (Some(r), Some(mut w)) = (r, w) else {
            streams.push(None);
            continue;
        };
        if !matches!(
            timeout_at(deadline, send_ctrl(&mut w, &Ctrl::Go)).await,
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
    Ok(streams)
}

async fn abort_writers(writers: &mut Writers, re: &RendezvousError) {
    for w in writers.iter_mut().flatten() {
        reject(w, re).await;
    }
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
                                crate::frame::read_frame(
                                    &mut s,
                                    authn::PREAUTH_MAX_FRAME_BYTES,
                                    &PeerName::unranked(""),
                                ),
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

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::super::client;
    use super::super::inflight::SPARE;
    use super::super::refusals::KEPT;
    use super::*;
    use crate::secret::Secret;

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime")
    }

    /// Rank `rank` of a world of 2 whose rank 0 listens at `addr`.
    fn cfg(rank: usize, addr: SocketAddr, join: Duration) -> CommConfig {
        CommConfig::new(Some(rank), 2)
            .with_master("127.0.0.1", addr.port())
            .with_join_timeout(join)
            .with_secret(Some(
                Secret::new(b"test-secret-0123456789".to_vec()).expect("secret"),
            ))
    }

    /// Whether rank 0 closes `s` within `within` (a read sees the end or a reset).
    async fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
        let mut b = [0u8; 64];
        matches!(
            tokio::time::timeout(within, s.read(&mut b)).await,
            Ok(Ok(0) | Err(_))
        )
    }

    /// Ten more silent strangers than rank 0 reads at once: the ten oldest are closed at
    /// once (not at the authentication deadline), the others stay; then the rank joins
    /// with the cap full of strangers.
    #[test]
    fn strangers_past_the_cap_push_out_the_oldest_and_the_rank_still_joins() {
        rt().block_on(async {
            let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
            let addr = l.local_addr().expect("addr");
            let c0 = cfg(0, addr, Duration::from_secs(20));
            let rank0 = tokio::spawn(async move { master(&c0, l).await });
            let cap = 2 + SPARE;
            let mut strangers = Vec::new();
            for _ in 0..cap + 10 {
                strangers.push(TcpStream::connect(addr).await.expect("connect"));
            }
            for (i, s) in strangers[..10].iter_mut().enumerate() {
                let closed = closed_within(s, Duration::from_secs(3)).await;
                assert!(closed, "stranger {i} of {} still held", cap + 10);
            }
            let newer = closed_within(&mut strangers[10], Duration::from_millis(200)).await;
            assert!(!newer, "a stranger within the cap was dropped");
            let c1 = cfg(1, addr, Duration::from_secs(20));
            let mesh1 = client::client(&c1).await.expect("rank 1 joins");
            let mesh0 = rank0.await.expect("task").expect("rank 0");
            assert_eq!((mesh0.rank, mesh1.rank), (0, 1));
        });
    }

    /// 1500 strangers sending garbage, each refused: rank 0's join timeout names the last
    /// few and counts the others, instead of holding every reason.
    #[test]
    fn thousands_of_refused_strangers_keep_the_list_bounded() {
        const N: usize = 1500;
        let e = rt().block_on(async {
            let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
            let addr = l.local_addr().expect("addr");
            let c0 = cfg(0, addr, Duration::from_secs(6));
            let rank0 = tokio::spawn(async move { master(&c0, l).await });
            for i in 0..N {
                let mut s = TcpStream::connect(addr).await.expect("connect");
                s.write_all(&[0xAB; 64]).await.expect("garbage");
                let closed = closed_within(&mut s, Duration::from_secs(5)).await;
                assert!(closed, "stranger {i} not refused");
            }
            match rank0.await.expect("task") {
                Ok(_) => panic!("rank 0 formed a world without rank 1"),
                Err(e) => e,
            }
        });
        let CommError::Rendezvous(RendezvousError::JoinTimeout {
            refused,
            refused_earlier,
            ..
        }) = &e
        else {
            panic!("{e}");
        };
        assert!(refused.len() <= KEPT, "{} reasons kept", refused.len());
        assert_eq!(refused.len() + refused_earlier, N, "{e}");
        assert!(e.to_string().contains("earlier, then"), "{e}");
    }
}
