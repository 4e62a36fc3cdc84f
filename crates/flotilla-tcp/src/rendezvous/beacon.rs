//! A process's side of an elastic job's membership: its one connection to the lighthouse
//! ([`super::lighthouse`]) for its whole life, on which it enlists for each generation and
//! hears (on a task of its own) when the membership changes.

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use flotilla_group::{CommError, PeerName, RendezvousError};
use tokio::runtime::Runtime;
use tokio::sync::mpsc;
use tokio::time::{Instant, timeout_at};

use super::client::connect_master;
use super::{authn, secure, send_ctrl};
use crate::auth::Purpose;
use crate::config::CommConfig;
use crate::frame;
use crate::stream::{ReadHalf, WriteHalf};
use crate::wire::{Ctrl, Formed, RENDEZVOUS_PROTOCOL};

/// `u64::MAX` in [`Beacon`]'s announced generation: the lighthouse is lost.
const LOST: u64 = u64::MAX;

/// This process's link to its elastic job's lighthouse (see the module's documentation).
pub struct Beacon {
    rt: Runtime,
    writer: WriteHalf,
    inbox: mpsc::UnboundedReceiver<Result<Ctrl, CommError>>,
    /// The newest generation the lighthouse announced ([`LOST`]: the connection ended).
    announced: Arc<AtomicU64>,
    /// The generation this process was last formed into (0: none).
    generation: u64,
    slot: u64,
    /// The address of this host's interface that reaches the lighthouse.
    local_ip: IpAddr,
    lighthouse: PeerName,
}

impl Beacon {
    /// Reaches the lighthouse at `cfg.master_addr:master_port` (retrying until
    /// `cfg.join_timeout`), with TLS and the secret's handshake as `cfg` says, as process
    /// `slot` of the job.
    pub fn connect(cfg: &CommConfig, slot: u64) -> Result<Beacon, CommError> {
        super::unauthenticated_allowed(cfg)?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("flotilla-beacon")
            .enable_all()
            .build()
            .map_err(|e| CommError::io("cannot start the beacon's runtime", e))?;
        let lighthouse = PeerName::unranked(format!(
            "the lighthouse at {}:{}",
            cfg.master_addr, cfg.master_port
        ));
        let (stream, local_ip) = rt.block_on(async {
            let (tcp, _) = connect_master(cfg).await?;
            let host = secure::host_of(&cfg.master_addr);
            let deadline = Instant::now() + cfg.timeout;
            let mut s = secure::connect(cfg.tls.as_ref(), tcp, host, &lighthouse, deadline).await?;
            if let Some(secret) = &cfg.secret {
                let p = Purpose::Rendezvous;
                authn::initiate(&mut s, secret, p, &lighthouse, deadline).await?;
            }
            let ip = s
                .local_addr()
                .map_err(|e| CommError::io("cannot read the local address", e))?
                .ip();
            Ok::<_, CommError>((s, ip))
        })?;
        let (reader, writer) = stream.into_split();
        let announced = Arc::new(AtomicU64::new(0));
        let (tx, inbox) = mpsc::unbounded_channel();
        let max = cfg.max_frame_bytes;
        rt.spawn(listen(
            reader,
            tx,
            announced.clone(),
            lighthouse.clone(),
            max,
        ));
        Ok(Beacon {
            rt,
            writer,
            inbox,
            announced,
            generation: 0,
            slot,
            local_ip,
            lighthouse,
        })
    }

    /// Whether the membership changes (a rank lost or waiting to join) or the lighthouse is
    /// lost: the process leaves its generation at the next step boundary (all members at
    /// the same one: see the training loop's vote) and enlists again.
    pub fn changing(&self) -> bool {
        self.announced.load(Ordering::SeqCst) > self.generation
    }

    /// The generation this process was last formed into (0: none yet).
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// This process's slot (the launcher's name for it).
    pub fn slot(&self) -> u64 {
        self.slot
    }

    /// The address of the interface that reaches the lighthouse (where to listen for the
    /// mesh, unless configured).
    pub(crate) fn local_ip(&self) -> IpAddr {
        self.local_ip
    }

    /// Enlists for the next generation (`step`: what this process's state holds, `None`
    /// for none) and waits for the lighthouse to form it, until `within`.
    pub(crate) fn enlist(
        &mut self,
        cfg: &CommConfig,
        (mesh_addr, host): (String, String),
        step: Option<u64>,
        within: Duration,
    ) -> Result<Formed, CommError> {
        let msg = Ctrl::Enlist {
            protocol: RENDEZVOUS_PROTOCOL,
            slot: self.slot,
            config_hash: cfg.config_hash,
            mesh_addr,
            host,
            generation: self.generation,
            step,
        };
        self.send(&msg, "enlisting")?;
        // A process left standing by hears so again and again while it waits: each time,
        // the wait starts over (the lighthouse is alive and holds its place).
        let mut standing = false;
        let formed = loop {
            let got = self.answer(
                within,
                "waiting for the generation to form",
                |msg| match msg {
                    Ctrl::Standby { generation } => Some(Err(generation)),
                    Ctrl::Formed(f) => Some(Ok(f)),
                    _ => None,
                },
            )?;
            match got {
                Ok(formed) => break formed,
                // Said once per wait (the lighthouse repeats it every 2 s).
                Err(generation) if !standing => {
                    standing = true;
                    tracing::info!(
                        generation,
                        "standing by: generation {generation} has no whole replica with a place \
                         for this process; it joins the next one that has"
                    );
                }
                Err(_) => {}
            }
        };
        let n = formed.peers.len();
        if formed.rank >= n || formed.hosts.len() != n || formed.slots.len() != n {
            let rank = formed.rank;
            return Err(self.bad(format!("invalid generation: rank {rank} of {n}")));
        }
        self.generation = formed.generation;
        Ok(formed)
    }

    /// Says this process's mesh is up and waits for every member's (`Go`): `Ok(false)` if
    /// the generation is abandoned meanwhile (a member lost: enlist again).
    pub(crate) fn ready(&mut self, within: Duration) -> Result<bool, CommError> {
        self.send(&Ctrl::Ready, "mesh ready")?;
        let current = self.generation;
        self.answer(within, "waiting for every member's mesh", |msg| match msg {
            Ctrl::Go => Some(true),
            Ctrl::Regroup { generation } if generation > current => Some(false),
            _ => None,
        })
    }

    /// The first of the lighthouse's messages within `within` that `pick` takes; a
    /// rejection is the error, anything else is passed over.
    fn answer<T>(
        &mut self,
        within: Duration,
        during: &str,
        mut pick: impl FnMut(Ctrl) -> Option<T>,
    ) -> Result<T, CommError> {
        let deadline = Instant::now() + within;
        loop {
            match self.next(deadline, during)? {
                Ctrl::Reject(re) => return Err(re.into()),
                msg => {
                    if let Some(t) = pick(msg) {
                        return Ok(t);
                    }
                }
            }
        }
    }

    /// Tells the lighthouse this process's run ended (its last collectives done): the job
    /// is ending, and members that leave now are not lost (best effort: a lighthouse gone
    /// already has nothing to decide).
    pub fn finished(&mut self) {
        let _ = self.send(&Ctrl::Finished, "finishing");
    }

    /// Tells the lighthouse this process could not build its mesh.
    pub(crate) fn mesh_failed(&mut self, reason: String) {
        let _ = self.send(&Ctrl::MeshFailed { reason }, "mesh failed");
    }

    fn send(&mut self, msg: &Ctrl, during: &str) -> Result<(), CommError> {
        let w = &mut self.writer;
        let sent = self.rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(5), send_ctrl(w, msg)).await
        });
        match sent {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(self.lost(during, frame::describe_io(&e))),
            Err(_) => Err(self.lost(during, "it did not take the message within 5 s".into())),
        }
    }

    /// The lighthouse's next message (other than a change's announcement) before `deadline`.
    fn next(&mut self, deadline: Instant, during: &str) -> Result<Ctrl, CommError> {
        let inbox = &mut self.inbox;
        match self
            .rt
            .block_on(async { timeout_at(deadline, inbox.recv()).await })
        {
            Ok(Some(Ok(msg))) => Ok(msg),
            Ok(Some(Err(e))) => Err(e),
            Ok(None) => Err(self.lost(during, "its connection ended".into())),
            Err(_) => Err(CommError::Rendezvous(RendezvousError::MasterFailed {
                reason: format!("{} went silent while {during}", self.lighthouse),
            })),
        }
    }

    fn lost(&self, during: &str, reason: String) -> CommError {
        CommError::Rendezvous(RendezvousError::MasterFailed {
            reason: format!("lost {} while {during}: {reason}", self.lighthouse),
        })
    }

    fn bad(&self, detail: String) -> CommError {
        CommError::BadFrame {
            peer: self.lighthouse.clone(),
            detail,
        }
    }
}

/// Reads the lighthouse's messages: an announced change is noted at once (for
/// [`Beacon::changing`]); every message goes to the inbox; the end of the connection marks
/// the lighthouse lost.
async fn listen(
    mut reader: ReadHalf,
    tx: mpsc::UnboundedSender<Result<Ctrl, CommError>>,
    announced: Arc<AtomicU64>,
    lighthouse: PeerName,
    max: usize,
) {
    loop {
        let msg = match frame::read_frame(&mut reader, max, &lighthouse).await {
            Ok((_, payload)) => Ctrl::decode(&payload).map_err(|detail| CommError::BadFrame {
                peer: lighthouse.clone(),
                detail,
            }),
            Err(e) => Err(e.into_comm(&lighthouse, "listening to the lighthouse")),
        };
        match msg {
            Ok(msg) => {
                if let Ctrl::Regroup { generation } = &msg {
                    announced.fetch_max(*generation, Ordering::SeqCst);
                }
                let _ = tx.send(Ok(msg));
            }
            Err(e) => {
                announced.store(LOST, Ordering::SeqCst);
                let _ = tx.send(Err(e));
                return;
            }
        }
    }
}
