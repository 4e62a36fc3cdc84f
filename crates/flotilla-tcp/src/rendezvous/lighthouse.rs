//! The lighthouse: an elastic job's membership service, kept outside the ranks (by the
//! launcher, as torchrun's store and torchft's lighthouse are), so that losing any rank —
//! rank 0 included — does not end the job. Each process of the job keeps one connection to
//! it for its life ([`super::beacon::Beacon`]), secured and authenticated as every
//! rendezvous connection is (TLS, the secret's challenge-response); on it the process
//! enlists for each generation and hears when the membership changes. What it decides is
//! [`super::quorum::Quorum`]'s; this file is its I/O.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::mpsc as std_mpsc;
use std::time::Duration;

use flotilla_group::{CommError, PeerName, RendezvousError};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::inflight::InFlight;
use super::quorum::{Bounds, Enlisted, Out, Quorum};
use super::{reject, secure, send_ctrl};
use crate::auth::Purpose;
use crate::frame;
use crate::secret::Secret;
use crate::stream::{ReadHalf, Stream, WriteHalf};
use crate::tls::TlsConfig;
use crate::wire::Ctrl;

/// What a lighthouse needs to know of its job.
#[derive(Debug, Clone)]
pub struct LighthouseConfig {
    /// Fewest ranks the job runs with.
    pub min: usize,
    /// Most ranks it takes.
    pub max: usize,
    /// How many processes the first generation waits for (those the launcher starts; more
    /// may join later, up to `max`).
    pub first: usize,
    /// The cluster secret every process proves (`None`: TLS alone, or `insecure`).
    pub secret: Option<Secret>,
    /// The cluster's TLS (every connection in mutual TLS).
    pub tls: Option<TlsConfig>,
    /// Neither secret nor TLS, as the user said.
    pub insecure: bool,
    /// How long the first generation waits for the job's maximum.
    pub join_timeout: Duration,
    /// How long a later generation waits for the previous members to enlist again (a
    /// member silent that long is left out): the agreement timeout.
    pub agreement: Duration,
    /// The job's deadline for any wait on a peer (members build their mesh within twice it).
    pub timeout: Duration,
    /// Ranks per replica (a pipeline's stages; 1 otherwise): a generation has whole
    /// replicas, each survivor at the stage it ran; a process that fills none stands by.
    pub unit: usize,
}

/// What the lighthouse tells its owner.
#[derive(Debug, Clone, PartialEq)]
pub enum LighthouseEvent {
    /// A generation is running: its number and its members' slots, by rank.
    Running {
        /// The generation.
        generation: u64,
        /// Its members' slots, by rank.
        slots: Vec<u64>,
    },
    /// A member's run ended: the job is ending (a process lost now is not replaced).
    Finished,
    /// The job cannot go on (fewer ranks than its minimum): every process was told.
    Failed(RendezvousError),
}

/// A running lighthouse (on a thread of its own); stopped when dropped.
pub struct Lighthouse {
    port: u16,
    events: std_mpsc::Receiver<LighthouseEvent>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Lighthouse {
    /// Starts serving on `listener` (bound by the caller: loopback unless the user said).
    pub fn start(
        cfg: LighthouseConfig,
        listener: std::net::TcpListener,
    ) -> Result<Lighthouse, CommError> {
        if cfg.secret.is_none() && cfg.tls.is_none() && !cfg.insecure {
            return Err(CommError::Config(format!(
                "the lighthouse will not admit processes without a cluster secret or TLS: {}",
                crate::HOW_TO_MAKE_A_SECRET
            )));
        }
        if cfg.min == 0 || cfg.min > cfg.max {
            return Err(CommError::Config(format!(
                "an elastic job needs 1 <= min <= max ranks, not {}:{}",
                cfg.min, cfg.max
            )));
        }
        if cfg.unit == 0 || !cfg.min.is_multiple_of(cfg.unit) || !cfg.max.is_multiple_of(cfg.unit) {
            return Err(CommError::Config(format!(
                "an elastic job of replicas of {} ranks needs min and max multiples of it, not \
                 {}:{}",
                cfg.unit, cfg.min, cfg.max
            )));
        }
        let port = listener
            .local_addr()
            .map_err(|e| CommError::io("reading the lighthouse's port", e))?
            .port();
        listener
            .set_nonblocking(true)
            .map_err(|e| CommError::io("cannot use the lighthouse's listener", e))?;
        let (events_tx, events) = std_mpsc::channel();
        let (stop_tx, stop_rx) = oneshot::channel();
        let thread = std::thread::Builder::new()
            .name("flotilla-lighthouse".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build();
                let Ok(rt) = rt else {
                    tracing::error!("the lighthouse could not start its runtime");
                    return;
                };
                rt.block_on(async move {
                    match TcpListener::from_std(listener) {
                        Ok(l) => Server::new(cfg, events_tx).serve(l, stop_rx).await,
                        Err(e) => tracing::error!(error = %e, "the lighthouse cannot listen"),
                    }
                });
            })
            .map_err(|e| CommError::io("cannot start the lighthouse's thread", e))?;
        Ok(Lighthouse {
            port,
            events,
            stop: Some(stop_tx),
            thread: Some(thread),
        })
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The next event, if one happened.
    pub fn try_event(&self) -> Option<LighthouseEvent> {
        self.events.try_recv().ok()
    }
}

impl Drop for Lighthouse {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What a connection's reader reports.
enum Inbound {
    Said(u64, Ctrl),
    Closed(u64),
}

/// An accepted connection and its first message (see [`secure::accept_first`]).
type Arrival = (Option<Stream>, SocketAddr, Result<Ctrl, Option<CommError>>);

struct Server {
    cfg: LighthouseConfig,
    quorum: Quorum,
    writers: HashMap<u64, WriteHalf>,
    inbound: (
        mpsc::UnboundedSender<Inbound>,
        mpsc::UnboundedReceiver<Inbound>,
    ),
    events: std_mpsc::Sender<LighthouseEvent>,
}

impl Server {
    fn new(cfg: LighthouseConfig, events: std_mpsc::Sender<LighthouseEvent>) -> Self {
        let bounds = Bounds {
            min: cfg.min,
            max: cfg.max,
            first: cfg.first.clamp(cfg.min, cfg.max),
            join_timeout: cfg.join_timeout,
            agreement: cfg.agreement,
            mesh: cfg.timeout * 2 + Duration::from_secs(1),
            unit: cfg.unit,
        };
        Self {
            quorum: Quorum::new(bounds, Instant::now()),
            cfg,
            writers: HashMap::new(),
            inbound: mpsc::unbounded_channel(),
            events,
        }
    }

    async fn serve(mut self, listener: TcpListener, mut stop: oneshot::Receiver<()>) {
        tracing::info!(addr = ?listener.local_addr().ok(), "lighthouse waiting for the job's processes");
        let mut reading: InFlight<Arrival> = InFlight::new(self.cfg.max);
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        loop {
            let out = tokio::select! {
                _ = &mut stop => return,
                acc = listener.accept() => {
                    match acc {
                        Ok((s, addr)) => self.read_first(&mut reading, s, addr),
                        Err(e) => tracing::warn!(error = %e, "lighthouse: accept failed"),
                    }
                    Vec::new()
                }
                Some((stream, addr, first)) = reading.next() => self.arrived(stream, addr, first).await,
                Some(said) = self.inbound.1.recv() => self.on_inbound(said),
                _ = tick.tick() => self.quorum.tick(Instant::now()),
            };
            self.apply(out).await;
        }
    }

    /// Secures, authenticates and reads the first message of a connection on a task.
    fn read_first(&self, reading: &mut InFlight<Arrival>, tcp: TcpStream, addr: SocketAddr) {
        let _ = tcp.set_nodelay(true);
        let (secret, tls) = (self.cfg.secret.clone(), self.cfg.tls.clone());
        let deadline = Instant::now() + self.cfg.timeout;
        let read = async move {
            let peer = PeerName::unranked(addr.to_string());
            let (s, t) = (tls.as_ref(), secret.as_ref());
            let purpose = Purpose::Rendezvous;
            let (stream, first) = secure::accept_first(tcp, s, t, purpose, &peer, deadline).await;
            (stream, addr, first)
        };
        if let Some(dropped) = reading.start(addr, read) {
            tracing::warn!(%dropped, "lighthouse: dropped a connection unread (too many at once)");
        }
    }

    /// A process's first message: an enlistment keeps its connection; anything else is
    /// refused and logged (a stranger never disturbs the job).
    async fn arrived(
        &mut self,
        stream: Option<Stream>,
        addr: SocketAddr,
        first: Result<Ctrl, Option<CommError>>,
    ) -> Vec<Out> {
        let (Some(stream), Ok(Ctrl::Enlist { slot, .. })) = (stream, &first) else {
            match first {
                Err(None) => {
                    tracing::debug!(%addr, "lighthouse: a connection closed before enlisting")
                }
                Err(Some(e)) => tracing::warn!(%addr, "lighthouse: refused a connection: {e}"),
                Ok(other) => {
                    tracing::warn!(%addr, msg = ?other, "lighthouse: refused a connection that did not enlist")
                }
            }
            return Vec::new();
        };
        let slot = *slot;
        let (reader, mut writer) = stream.into_split();
        if self.writers.contains_key(&slot) {
            let re = RendezvousError::DuplicateRank {
                peer: PeerName::unranked(format!("slot {slot} ({addr})")),
                holder: format!("another connection of slot {slot}"),
            };
            reject(&mut writer, &re).await;
            return Vec::new();
        }
        self.writers.insert(slot, writer);
        let max = crate::config::CommConfig::default().max_frame_bytes;
        tokio::spawn(listen(slot, reader, addr, max, self.inbound.0.clone()));
        match first {
            Ok(msg) => self.enlist(slot, addr.to_string(), msg),
            Err(_) => Vec::new(),
        }
    }

    fn enlist(&mut self, slot: u64, addr: String, msg: Ctrl) -> Vec<Out> {
        let Ctrl::Enlist {
            protocol,
            config_hash,
            mesh_addr,
            host,
            generation,
            step,
            ..
        } = msg
        else {
            return Vec::new();
        };
        let e = Enlisted {
            slot,
            addr,
            mesh_addr,
            host,
            generation,
            step,
            protocol,
            config_hash,
        };
        self.quorum.enlist(e, Instant::now())
    }

    fn on_inbound(&mut self, said: Inbound) -> Vec<Out> {
        let now = Instant::now();
        match said {
            Inbound::Closed(slot) => {
                self.writers.remove(&slot);
                self.quorum.closed(slot, now)
            }
            Inbound::Said(slot, Ctrl::Ready) => self.quorum.ready(slot, now),
            Inbound::Said(slot, Ctrl::Finished) => self.quorum.finished(slot),
            Inbound::Said(slot, Ctrl::MeshFailed { reason }) => {
                tracing::warn!(slot, "lighthouse: a mesh failed: {reason}");
                self.quorum.mesh_failed(slot, now)
            }
            Inbound::Said(slot, msg @ Ctrl::Enlist { .. }) => {
                let addr = format!("slot {slot}");
                self.enlist(slot, addr, msg)
            }
            Inbound::Said(slot, other) => {
                tracing::debug!(slot, msg = ?other, "lighthouse: ignored a message");
                Vec::new()
            }
        }
    }

    async fn apply(&mut self, out: Vec<Out>) {
        for o in out {
            match o {
                Out::Send(slot, msg) => {
                    let Some(w) = self.writers.get_mut(&slot) else {
                        continue;
                    };
                    let sent = tokio::time::timeout(Duration::from_secs(1), send_ctrl(w, &msg));
                    if !matches!(sent.await, Ok(Ok(()))) {
                        tracing::warn!(slot, "lighthouse: could not tell a process");
                    }
                }
                Out::Close(slot) => {
                    self.writers.remove(&slot);
                }
                Out::Running(generation, slots) => {
                    let _ = self
                        .events
                        .send(LighthouseEvent::Running { generation, slots });
                }
                Out::Finished => {
                    let _ = self.events.send(LighthouseEvent::Finished);
                }
                Out::Failed(re) => {
                    tracing::error!("lighthouse: {re}");
                    let _ = self.events.send(LighthouseEvent::Failed(re));
                }
            }
        }
    }
}

/// Reads what a process says until its connection ends.
async fn listen(
    slot: u64,
    mut reader: ReadHalf,
    addr: SocketAddr,
    max: usize,
    tx: mpsc::UnboundedSender<Inbound>,
) {
    let peer = PeerName::unranked(format!("slot {slot} ({addr})"));
    loop {
        let said = match frame::read_frame(&mut reader, max, &peer).await {
            Ok((h, payload)) if h.channel == frame::channel::CONTROL => Ctrl::decode(&payload),
            Ok(_) => Err("a data frame".into()),
            Err(_) => break,
        };
        match said {
            Ok(msg) => {
                let _ = tx.send(Inbound::Said(slot, msg));
            }
            Err(e) => {
                tracing::warn!(%peer, "lighthouse: closed a connection that sent {e}");
                break;
            }
        }
    }
    let _ = tx.send(Inbound::Closed(slot));
}
