//! The [`TcpGroup`]: the TCP (and in-memory) implementation of [`ProcessGroup`]. Owns the
//! runtime and the peer connections, orders each group's collectives and turns failures into
//! typed, peer-naming errors. The `f32` all-reduce and broadcast of a group whose members
//! share a host go through its shared-memory segment ([`crate::shm`]) in the same order; the
//! all-reduce of a group spanning hosts may be hierarchical ([`crate::hier`]).
//!
//! # Ordering invariant
//!
//! Within a group, every member must issue the same collectives in the same order (blocking
//! and asynchronous ones alike) with matching sizes and roots. Each collective takes a
//! sequence number of its group when it is *issued*; a group's collectives execute strictly
//! in that order on each rank, and every frame carries the group key, sequence number,
//! operation kind and a per-collective frame counter. Groups have separate queues on the
//! shared connections, so they never wait on each other. A frame
//! that does not match what the receiver expects is a [`CommError::Protocol`] error, never
//! silent corruption. Issue a group's collectives from one thread (the async all-reduce's
//! cycle has a group of its own); issuing from several threads at once makes the order racy.
//!
//! # Failure model
//!
//! Every wait on a peer is bounded by [`CommConfig::timeout`]. When a collective fails, the
//! rank tells all peers (`Abort` on the control channel) so they fail promptly with an error
//! naming the culprit instead of timing out, and every group of the process becomes unusable
//! for collectives ([`CommError::Poisoned`]): after a failure ranks no longer agree on what
//! was exchanged. Point-to-point messages are not poisoned: a server outlives a lost worker.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use flotilla_group::{
    CommError, CommStats, Members, Pending, PendingAllReduce, ProcessGroup, ReduceOp, Tag, Taken,
    subgroup::SplitPlan,
};
use tokio::runtime::{Handle, Runtime};
use tracing::Instrument;

use crate::collectives;
use crate::config::{CommConfig, Rejoin, Transport};
use crate::conn::{Conn, ConnOpts, Endpoint};
use crate::flat::{self, Algorithm};
use crate::frame::{Op, channel};
use crate::hier;
use crate::host;
use crate::op::OpCtx;
use crate::rendezvous;
use crate::rendezvous::beacon::Beacon;
use crate::ring;
use crate::world::{GroupState, Site, World, derive_key};

/// A generation of an elastic job, as [`TcpGroup::connect_elastic`] joined it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Generation {
    /// Its number (1: the job's first).
    pub number: u64,
    /// Its members' slots (the launcher's names of the processes), by rank.
    pub slots: Vec<u64>,
    /// The steps its rank 0's training state holds: where the generation resumes (every
    /// member takes rank 0's state).
    pub step: u64,
}

/// Owns the runtime; dropped with the last group handle of the process.
struct RtOwner {
    rt: Option<Runtime>,
    world: Arc<World>,
}

impl Drop for RtOwner {
    fn drop(&mut self) {
        let Some(rt) = self.rt.take() else { return };
        if Handle::try_current().is_ok() {
            // Dropped inside another runtime, where blocking is not allowed.
            rt.shutdown_background();
            return;
        }
        // Send FIN on every connection so peers see an orderly close rather than a reset.
        let peers: Vec<Arc<Conn>> = self.world.conns();
        rt.block_on(async {
            let _ = tokio::time::timeout(Duration::from_secs(1), async {
                for p in peers {
                    p.shutdown().await;
                }
            })
            .await;
        });
    }
}

/// A connected member of a process group: the TCP (or in-memory) implementation of
/// [`ProcessGroup`]. `Send + Sync`; see [`flotilla_group::group`] for the ordering invariant.
///
/// The blocking methods must not be called from inside an async runtime (they block the
/// calling thread on the communicator's own runtime).
pub struct TcpGroup {
    g: Arc<GroupState>,
    rt: Arc<RtOwner>,
}

impl std::fmt::Debug for TcpGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpGroup")
            .field("rank", &self.g.me())
            .field("size", &self.g.members.len())
            .field("group", &format_args!("{:016x}", self.g.key))
            .finish()
    }
}

fn build_runtime(threads: usize) -> Result<Runtime, CommError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.max(1))
        .thread_name("flotilla-tcp")
        .enable_all()
        .build()
        .map_err(|e| CommError::io("cannot start the communication runtime", e))
}

impl TcpGroup {
    /// Joins the process group described by `cfg` (rendezvous + peer mesh), blocking until
    /// every rank is connected or a deadline expires.
    pub fn connect(cfg: CommConfig) -> Result<TcpGroup, CommError> {
        Self::connect_inner(cfg, None)
    }

    /// Like [`TcpGroup::connect`] for rank 0, using an already bound rendezvous listener
    /// instead of binding `master_addr:master_port` (useful to pick a free port with port 0).
    pub fn connect_with_listener(
        cfg: CommConfig,
        listener: std::net::TcpListener,
    ) -> Result<TcpGroup, CommError> {
        Self::connect_inner(cfg, Some(listener))
    }

    fn connect_inner(
        cfg: CommConfig,
        listener: Option<std::net::TcpListener>,
    ) -> Result<TcpGroup, CommError> {
        cfg.validate()?;
        if Handle::try_current().is_ok() {
            return Err(CommError::InvalidArgument(
                "TcpGroup::connect cannot be called from inside an async runtime".into(),
            ));
        }
        let rt = build_runtime(cfg.runtime_threads)?;
        let (rank, streams, rejoins, site) = if cfg.world_size == 1 {
            let site = Site {
                session: rand::random(),
                hosts: vec![host::host_key(cfg.shm_dir.as_deref())],
            };
            (0, vec![None], None, site)
        } else {
            let mesh = rt.block_on(rendezvous::rendezvous(&cfg, listener))?;
            let site = Site {
                session: mesh.session,
                hosts: mesh.hosts,
            };
            (mesh.rank, mesh.streams, mesh.rejoins, site)
        };
        Self::over_streams(rt, cfg, (rank, streams), rejoins, site)
    }

    /// Joins the next generation of an elastic job through this process's `beacon` (its
    /// link to the job's lighthouse, [`Beacon::connect`]): enlists with `step`, the steps
    /// its training state holds (`None`: none yet; it takes a member's), and connects to
    /// every member of the generation the lighthouse forms. `cfg`'s rank and world size are
    /// the generation's (the lighthouse assigns them). Blocks until the generation runs, or
    /// the lighthouse refuses this process (a stale generation, fewer ranks than the
    /// minimum, a full job): a refusal is the error.
    pub fn connect_elastic(
        mut cfg: CommConfig,
        beacon: &mut Beacon,
        step: Option<u64>,
    ) -> Result<(TcpGroup, Generation), CommError> {
        if Handle::try_current().is_ok() {
            return Err(CommError::InvalidArgument(
                "TcpGroup::connect_elastic cannot be called from inside an async runtime".into(),
            ));
        }
        let rt = build_runtime(cfg.runtime_threads)?;
        let (mesh, formed) = rendezvous::elastic::form(&rt, &cfg, beacon, step)?;
        (cfg.world_size, cfg.rank) = (formed.peers.len(), Some(mesh.rank));
        cfg.validate()?;
        let site = Site {
            session: mesh.session,
            hosts: mesh.hosts,
        };
        let generation = Generation {
            number: formed.generation,
            slots: formed.slots,
            step: formed.step,
        };
        let comm = Self::over_streams(rt, cfg, (mesh.rank, mesh.streams), None, site)?;
        Ok((comm, generation))
    }

    /// The group of rank `rank` over the rendezvous' `streams` (one per peer rank).
    fn over_streams(
        rt: Runtime,
        cfg: CommConfig,
        (rank, streams): (usize, Vec<Option<crate::stream::Stream>>),
        rejoins: Option<rendezvous::Rejoins>,
        site: Site,
    ) -> Result<TcpGroup, CommError> {
        let everyone: Vec<usize> = (0..cfg.world_size).collect();
        if cfg.transport == Transport::Shm
            && cfg.rejoin != Rejoin::Join
            && !host::all_local(&site.hosts, &everyone)
        {
            return Err(CommError::Config(
                "transport shm needs every rank on this host (by the rendezvous' host keys); \
                 use auto or tcp"
                    .into(),
            ));
        }
        let ep = Arc::new(Endpoint::new(cfg.max_queued_bytes));
        let opts = ConnOpts {
            max_frame_bytes: cfg.max_frame_bytes,
            compression: cfg.compression,
            pooled_frame_bytes: cfg.chunk_bytes,
        };
        // A replacement of a lost rank reaches rank 0 alone, point to point.
        let rejoined = cfg.rejoin == Rejoin::Join;
        let peers = {
            let _guard = rt.enter();
            streams
                .into_iter()
                .enumerate()
                .map(|(r, s)| {
                    s.map(|s| {
                        let remote = !host::all_local(&site.hosts, &[rank, r]);
                        let c = Conn::tcp(s, r, opts, ep.clone()).between_hosts(remote);
                        Arc::new(if rejoined {
                            c.for_point_to_point_only()
                        } else {
                            c
                        })
                    })
                })
                .collect()
        };
        let comm = Self::assemble(rt, rank, cfg, peers, ep, site);
        if let (Some(r), Some(rt)) = (rejoins, comm.rt.rt.as_ref()) {
            let world = Arc::downgrade(&comm.g.world);
            rt.spawn(rendezvous::rejoin::serve(r, world, opts));
        }
        tracing::info!(rank, world_size = comm.size(), "communicator connected");
        Ok(comm)
    }

    /// `n` communicators of one world connected by in-memory links, for running every rank
    /// as a thread of one process (unit tests of strategies and servers). Each gets its own
    /// runtime and `cfg` (with its rank); the collectives, ordering, deadlines and failure
    /// reports are those of the TCP transport. Dropping one is seen by the others as a lost
    /// connection.
    pub fn in_memory(n: usize, cfg: CommConfig) -> Result<Vec<TcpGroup>, CommError> {
        // Threads of one process share its host (and memory).
        Self::in_memory_on(vec![host::host_key(cfg.shm_dir.as_deref()); n], cfg)
    }

    /// Like [`TcpGroup::in_memory`], rank `r` reporting host key `hosts[r]` (the
    /// crate's tests of hierarchical all-reduces emulate hosts with it: ranks of one key
    /// share a segment, links between keys count as inter-host).
    pub(crate) fn in_memory_on(
        hosts: Vec<String>,
        cfg: CommConfig,
    ) -> Result<Vec<TcpGroup>, CommError> {
        let n = hosts.len();
        let mut cfg = cfg;
        cfg.world_size = n;
        cfg.rank = Some(0);
        cfg.validate()?;
        let eps: Vec<Arc<Endpoint>> = (0..n)
            .map(|_| Arc::new(Endpoint::new(cfg.max_queued_bytes)))
            .collect();
        let session = rand::random::<u64>();
        let mut peers: Vec<Vec<Option<Arc<Conn>>>> = (0..n).map(|_| vec![None; n]).collect();
        for a in 0..n {
            for b in a + 1..n {
                let (ab, ba) = Conn::memory_pair((a, &eps[a]), (b, &eps[b]), cfg.chunk_bytes);
                let remote = !host::all_local(&hosts, &[a, b]);
                peers[a][b] = Some(Arc::new(ab.between_hosts(remote)));
                peers[b][a] = Some(Arc::new(ba.between_hosts(remote)));
            }
        }
        peers
            .into_iter()
            .zip(eps)
            .enumerate()
            .map(|(rank, (p, ep))| {
                let rt = build_runtime(cfg.runtime_threads)?;
                let mut c = cfg.clone();
                c.rank = Some(rank);
                let site = Site {
                    session,
                    hosts: hosts.clone(),
                };
                Ok(Self::assemble(rt, rank, c, p, ep, site))
            })
            .collect()
    }

    fn assemble(
        rt: Runtime,
        rank: usize,
        cfg: CommConfig,
        peers: Vec<Option<Arc<Conn>>>,
        ep: Arc<Endpoint>,
        site: Site,
    ) -> TcpGroup {
        let n = peers.len();
        let world = Arc::new(World::new(rank, cfg, peers, ep, rt.handle().clone(), site));
        let g = GroupState::new(world.clone(), 0, Members::new((0..n).collect(), rank));
        TcpGroup {
            g,
            rt: Arc::new(RtOwner {
                rt: Some(rt),
                world,
            }),
        }
    }

    /// The configuration this communicator was built with (with the assigned rank).
    pub fn config(&self) -> &CommConfig {
        &self.g.world.cfg
    }

    /// What this process's groups share (for the crate's tests, which play a peer that
    /// breaks the protocol on its links).
    #[cfg(test)]
    pub(crate) fn world(&self) -> &Arc<World> {
        &self.g.world
    }

    /// How many sub-groups of this kind were derived from this group before, plus one.
    fn next_derived(&self, kind: &[u8]) -> u64 {
        let mut d = self.g.derived.lock().unwrap_or_else(|p| p.into_inner());
        let n = d.entry(kind.to_vec()).or_insert(0);
        *n += 1;
        *n
    }

    /// A group of `members` (world ranks) keyed by this group's key and `id`.
    fn make_group(&self, id: &[u8], members: Vec<usize>) -> Arc<dyn ProcessGroup> {
        let me = members
            .iter()
            .position(|&w| w == self.g.world.rank)
            .unwrap_or(usize::MAX);
        let g = GroupState::new(
            self.g.world.clone(),
            derive_key(self.g.key, id),
            Members::new(members, me),
        );
        Arc::new(TcpGroup {
            g,
            rt: self.rt.clone(),
        })
    }
}

impl ProcessGroup for TcpGroup {
    fn rank(&self) -> usize {
        self.g.me()
    }

    fn size(&self) -> usize {
        self.g.members.len()
    }

    fn world_rank(&self, rank: usize) -> usize {
        self.g.members.world_rank(rank)
    }

    fn group_rank(&self, world_rank: usize) -> Option<usize> {
        self.g.members.group_rank(world_rank)
    }

    fn timeout(&self) -> Duration {
        self.g.world.cfg.timeout
    }

    fn activity(&self) -> flotilla_group::Activity {
        self.g.activity()
    }

    fn abort(&self, reason: &str) {
        let w = &self.g.world;
        let error = CommError::Aborted {
            by: w.rank,
            reason: reason.to_string(),
        };
        if let Ok(mut p) = w.poisoned.lock()
            && p.is_none()
        {
            *p = Some(error);
        }
        w.ep.abort.send_if_modified(|slot| {
            let first = slot.is_none();
            if first {
                *slot = Some((w.rank, reason.to_string()));
            }
            first
        });
        w.abort_segments(reason);
    }

    fn stats(&self) -> CommStats {
        let s = &self.g.world.ep.stats;
        CommStats {
            bytes_sent: s.bytes_sent.load(Ordering::Relaxed),
            bytes_received: s.bytes_received.load(Ordering::Relaxed),
            frames_sent: s.frames_sent.load(Ordering::Relaxed),
            frames_received: s.frames_received.load(Ordering::Relaxed),
            frames_compressed: s.frames_compressed.load(Ordering::Relaxed),
            collectives: self.g.world.collectives.load(Ordering::Relaxed),
            shm_bytes: s.shm_bytes.load(Ordering::Relaxed),
            bytes_sent_inter_host: s.bytes_sent_inter_host.load(Ordering::Relaxed),
        }
    }

    fn barrier(&self) -> Result<(), CommError> {
        let ticket = self.issue()?;
        let g = self.g.clone();
        if g.shm.is_some() {
            return self.run_here(async {
                let _turn = g.begin(ticket).await?;
                let r = flat::shm_barrier(&g, ticket).await;
                g.finish(r).await
            });
        }
        self.run_owned(async move {
            let _turn = g.begin(ticket).await?;
            let r = collectives::barrier(&OpCtx::new(&g, ticket, Op::Barrier)).await;
            g.finish(r).await
        })
    }

    fn broadcast_f32(&self, buf: &mut [f32], root: usize) -> Result<(), CommError> {
        let g = &self.g;
        let ticket = self.issue()?;
        if g.shm.is_some() {
            let root = g.world_rank_checked(root).map(|_| root)?;
            return self.run_here(async move {
                let _turn = g.begin(ticket).await?;
                let r = flat::shm_broadcast(g, ticket, buf, root).await;
                g.finish(r).await
            });
        }
        let bytes = std::mem::size_of_val(buf);
        self.run_borrowed(bytes, async move {
            let _turn = g.begin(ticket).await?;
            let r =
                collectives::broadcast_f32(&OpCtx::new(g, ticket, Op::Broadcast), buf, root).await;
            g.finish(r).await
        })
    }

    fn broadcast_bytes(
        &self,
        buf: &mut Vec<u8>,
        root: usize,
        max_len: usize,
    ) -> Result<(), CommError> {
        let ticket = self.issue()?;
        // The buffer moves to the runtime and back (no copy).
        let (g, mut bytes) = (self.g.clone(), std::mem::take(buf));
        let (bytes, r) = self.run_owned(async move {
            let r = async {
                let _turn = g.begin(ticket).await?;
                let ctx = OpCtx::new(&g, ticket, Op::Broadcast);
                let r = collectives::broadcast_bytes(&ctx, &mut bytes, root, max_len).await;
                g.finish(r).await
            }
            .await;
            Ok((bytes, r))
        })?;
        *buf = bytes;
        r
    }

    fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        let ticket = self.issue()?;
        let (g, mine) = (self.g.clone(), mine.to_vec());
        self.run_owned(async move {
            let _turn = g.begin(ticket).await?;
            let ctx = OpCtx::new(&g, ticket, Op::AllGather);
            let r = collectives::all_gather_bytes(&ctx, &mine).await;
            g.finish(r).await
        })
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), CommError> {
        let ticket = self.issue()?;
        if self.g.shm.is_some() {
            // The copies and waits of the shared segment run on this (blocked anyway) thread.
            return self.run_here(all_reduce_ordered(&self.g, ticket, buf, None));
        }
        let bytes = std::mem::size_of_val(buf);
        self.run_borrowed(bytes, all_reduce_ordered(&self.g, ticket, buf, None))
    }

    fn all_reduce_start(&self, buf: Vec<f32>) -> PendingAllReduce {
        self.start_all_reduce(buf, None)
    }

    fn all_reduce_bucket(&self, buf: Vec<f32>, bucket: usize) -> PendingAllReduce {
        self.start_all_reduce(buf, Some(bucket))
    }

    fn reduce_scatter_sum_f32(&self, buf: &mut [f32]) -> Result<(), CommError> {
        let ticket = self.issue()?;
        let bytes = std::mem::size_of_val(buf);
        self.run_borrowed(bytes, reduce_scatter_ordered(&self.g, ticket, buf, None))
    }

    fn reduce_scatter_bucket(&self, buf: Vec<f32>, bucket: usize) -> PendingAllReduce {
        let ticket = self.g.ticket();
        let g = self.g.clone();
        let (tx, pending) = Pending::channel(ticket);
        self.g.world.handle.spawn(async move {
            let mut buf = buf;
            let r = reduce_scatter_ordered(&g, ticket, &mut buf, Some(bucket)).await;
            tx.send(r.map(|()| buf));
        });
        pending
    }

    fn all_gather_f32(&self, buf: &mut [f32]) -> Result<(), CommError> {
        let ticket = self.issue()?;
        let bytes = std::mem::size_of_val(buf);
        self.run_borrowed(bytes, all_gather_ordered(&self.g, ticket, buf, None))
    }

    fn all_gather_bucket(&self, buf: Vec<f32>, bucket: usize) -> PendingAllReduce {
        let ticket = self.g.ticket();
        let g = self.g.clone();
        let (tx, pending) = Pending::channel(ticket);
        self.g.world.handle.spawn(async move {
            let mut buf = buf;
            let r = all_gather_ordered(&g, ticket, &mut buf, Some(bucket)).await;
            tx.send(r.map(|()| buf));
        });
        pending
    }

    fn all_reduce_i64(&self, buf: &mut [i64], op: ReduceOp) -> Result<(), CommError> {
        self.all_reduce_small(buf, move |a, b| op.apply_i64(a, b))
    }

    fn all_reduce_u64(&self, buf: &mut [u64], op: ReduceOp) -> Result<(), CommError> {
        self.all_reduce_small(buf, move |a, b| op.apply_u64(a, b))
    }

    fn send(&self, peer: usize, tag: Tag, msg: &[u8]) -> Result<(), CommError> {
        let world = self.g.world_rank_checked(peer)?;
        let key = self.g.key;
        if world == self.g.world.rank {
            let mailbox = &self.g.world.ep.mailbox;
            return mailbox.deliver(key, world, tag, msg.to_vec());
        }
        let conn = self.g.world.conn(world)?;
        let t = self.g.world.cfg.timeout;
        // On this thread: the message is written from the caller's buffer, not a copy.
        self.run_here(async move {
            match tokio::time::timeout(t, conn.send(channel::P2P, Op::P2p, (key, 0, tag), msg))
                .await
            {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(conn.send_error(&format!("send (tag {tag})"), &e)),
                Err(_) => Err(CommError::Timeout {
                    peer: world,
                    op: format!("send (tag {tag})"),
                    after: t,
                }),
            }
        })
    }

    fn rejoins(&self, rank: usize) -> u64 {
        self.g
            .world_rank_checked(rank)
            .map_or(0, |w| self.g.world.generation(w))
    }

    fn take_from_mailbox(&self, peers: &[usize], tag: Tag, deadline: Instant) -> Option<Taken> {
        // The process's mailbox holds every group's messages, by group key and world rank.
        let world: Vec<usize> = peers.iter().map(|&p| self.world_rank(p)).collect();
        self.g
            .world
            .ep
            .mailbox
            .take(self.g.key, &world, tag, deadline)
    }

    fn subgroup_from(&self, plan: &SplitPlan) -> Result<Option<Arc<dyn ProcessGroup>>, CommError> {
        // A split is collective on this group, so every member counts every split (in a
        // new group or not) and the n-th split has the same number everywhere.
        let n = self.next_derived(b"split");
        let Some(color) = plan.color else {
            return Ok(None);
        };
        let members = plan.members.iter().map(|&r| self.world_rank(r)).collect();
        let mut id = b"split".to_vec();
        id.extend_from_slice(&n.to_le_bytes());
        id.extend_from_slice(&color.to_le_bytes());
        Ok(Some(self.make_group(&id, members)))
    }

    fn group(&self, ranks: &[usize]) -> Result<Arc<dyn ProcessGroup>, CommError> {
        let members = self.g.members.subgroup(ranks)?;
        let mut id = b"group".to_vec();
        for w in &members {
            id.extend_from_slice(&(*w as u64).to_le_bytes());
        }
        // The n-th group of these members, counted by each member alike.
        let n = self.next_derived(&id);
        id.extend_from_slice(&n.to_le_bytes());
        Ok(self.make_group(&id, members))
    }
}

impl TcpGroup {
    /// Starts an all-reduce on the runtime (of `bucket`, when the caller has buckets).
    fn start_all_reduce(&self, buf: Vec<f32>, bucket: Option<usize>) -> PendingAllReduce {
        let ticket = self.g.ticket();
        let g = self.g.clone();
        let (tx, pending) = Pending::channel(ticket);
        self.g.world.handle.spawn(async move {
            let mut buf = buf;
            let r = all_reduce_ordered(&g, ticket, &mut buf, bucket).await;
            tx.send(r.map(|()| buf));
        });
        pending
    }

    /// Takes the sequence number of a blocking collective. Fails (without consuming a
    /// sequence number, which would stall every later collective) when blocking is not
    /// possible on this thread.
    fn issue(&self) -> Result<u64, CommError> {
        outside_runtime()?;
        Ok(self.g.ticket())
    }

    /// An integer all-reduce (small buffers: counters, flags, bit sets), its values moved
    /// to the runtime and back.
    fn all_reduce_small<T: bytemuck::Pod + Send>(
        &self,
        buf: &mut [T],
        combine: impl Fn(T, T) -> T + Send + 'static,
    ) -> Result<(), CommError> {
        let ticket = self.issue()?;
        let (g, mut mine) = (self.g.clone(), buf.to_vec());
        let mine = self.run_owned(async move {
            let _turn = g.begin(ticket).await?;
            let ctx = OpCtx::new(&g, ticket, Op::Reduce);
            let r = collectives::all_reduce_small(&ctx, &mut mine, combine).await;
            g.finish(r).await.map(|()| mine)
        })?;
        buf.copy_from_slice(&mine);
        Ok(())
    }

    /// Runs `op`, which owns everything it touches, on the runtime's worker threads (next
    /// to the connection readers, so its frames never wake another thread) and blocks the
    /// calling thread until it has finished: the collectives of small or owned buffers.
    fn run_owned<T: Send + 'static>(
        &self,
        op: impl Future<Output = Result<T, CommError>> + Send + 'static,
    ) -> Result<T, CommError> {
        outside_runtime()?;
        let handle = &self.g.world.handle;
        match handle.block_on(handle.spawn(op)) {
            Ok(r) => r,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(_) => Err(CommError::Shutdown),
        }
    }

    /// Runs `op`, which borrows the caller's buffers, on the calling thread (blocked anyway)
    /// until it has finished; the connection readers stay on the runtime's workers. For
    /// what needs few or no frames from a peer: a point-to-point send (written from the
    /// caller's buffer), the shared segment's copies and waits, and borrowed buffers of a few
    /// chunks ([`Self::run_borrowed`]).
    fn run_here<T>(&self, op: impl Future<Output = Result<T, CommError>>) -> Result<T, CommError> {
        outside_runtime()?;
        self.g.world.handle.block_on(op)
    }

    /// Runs `op`, a collective over TCP of the caller's `bytes`-long borrowed buffer: on the
    /// calling thread ([`Self::run_here`]) up to [`SCOPED_MIN_CHUNKS`] chunks, on a worker
    /// ([`Self::run_scoped`]) above.
    fn run_borrowed<T: Send + 'static>(
        &self,
        bytes: usize,
        op: impl Future<Output = Result<T, CommError>> + Send,
    ) -> Result<T, CommError> {
        if bytes <= SCOPED_MIN_CHUNKS * self.g.world.cfg.chunk_bytes {
            self.run_here(op)
        } else {
            self.run_scoped(op)
        }
    }

    /// Runs `op`, which borrows the caller's buffers (the `&mut [f32]` being reduced), on the
    /// runtime's workers next to the connection readers, and blocks the calling thread until
    /// it has finished.
    ///
    /// Why not on the calling thread ([`Self::run_here`]): each received chunk would then
    /// wake it from the reader's thread, two busy threads a rank; 2 ranks over TCP on
    /// 127.0.0.1, 16 MiB, median of 6 alternating rounds of 60: 15.6 ms there against
    /// 12.8 ms on a worker (BENCHMARKS.md, section 29); below a few chunks the two hops to
    /// and from the worker cost more than the wake-ups ([`SCOPED_MIN_CHUNKS`]). Why not a
    /// copy of the buffer moved to a worker, as [`Self::run_owned`] does: copying 16 MiB in
    /// and out costs 6 ms on this machine. Why our own: `async-scoped`'s `scope_and_block`
    /// does the same (an unsafe lifetime extension behind a blocking scope) but blocks with
    /// `block_in_place`, which needs the caller inside the runtime's context, where a
    /// blocking `TcpGroup` method refuses to run.
    fn run_scoped<'a, T: Send + 'static>(
        &self,
        op: impl Future<Output = Result<T, CommError>> + Send + 'a,
    ) -> Result<T, CommError> {
        outside_runtime()?;
        let handle = &self.g.world.handle;
        let boxed: ScopedFuture<'a, T> = Box::pin(op);
        // SAFETY: the future may outlive 'a on paper only. This function does not return
        // before the task has finished (`block_on` of its handle below), nor unwind before
        // (the `ScopedTask` guard aborts it and waits for `is_finished`); tokio drops a
        // task's future before it marks the task finished, on completion, panic or abort.
        // The runtime cannot shut down meanwhile: `self` holds it. So no borrow `op`
        // captured is used after 'a ends.
        let boxed =
            unsafe { std::mem::transmute::<ScopedFuture<'a, T>, ScopedFuture<'static, T>>(boxed) };
        let mut task = ScopedTask(Some(handle.spawn(boxed)));
        let joined = match task.0.as_mut() {
            Some(h) => handle.block_on(h),
            None => return Err(CommError::Shutdown),
        };
        // The handle resolved: the task and its future are gone.
        task.0 = None;
        match joined {
            Ok(r) => r,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(_) => Err(CommError::Shutdown),
        }
    }
}

/// Chunks ([`CommConfig::chunk_bytes`]) of a borrowed buffer up to which a blocking TCP
/// collective runs on the calling thread rather than on a worker ([`TcpGroup::run_borrowed`]).
/// 2 ranks on 127.0.0.1 (medians of 5 alternating rounds of 200): 1 MiB took 530 us on the
/// calling thread and 642 us on a worker, 4 MiB 3.42 ms and 3.01 ms.
const SCOPED_MIN_CHUNKS: usize = 4;

/// A collective's future that borrows the caller's buffers for `'a`.
type ScopedFuture<'a, T> =
    std::pin::Pin<Box<dyn Future<Output = Result<T, CommError>> + Send + 'a>>;

/// A task running a [`ScopedFuture`] whose borrows live in the stack frame of
/// [`TcpGroup::run_scoped`]. Dropped before it was joined (only while unwinding), it
/// aborts the task and waits until the task has finished, so the borrows end first.
struct ScopedTask<T>(Option<tokio::task::JoinHandle<T>>);

impl<T> Drop for ScopedTask<T> {
    fn drop(&mut self) {
        if let Some(h) = self.0.take() {
            h.abort();
            // No `block_on` here: a panic while unwinding would abort the process.
            while !h.is_finished() {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}

/// Fails inside an async runtime, where a blocking method must not block.
fn outside_runtime() -> Result<(), CommError> {
    if Handle::try_current().is_ok() {
        return Err(CommError::InvalidArgument(
            "blocking TcpGroup methods cannot be called from inside an async runtime".into(),
        ));
    }
    Ok(())
}

/// Runs all-reduce `ticket` of group `g` in its turn: hierarchical ([`crate::hier`]) on a
/// group spanning hosts with the same number (more than one) of its ranks on each, else
/// over the group's shared-memory segment when its members share a host, else recursive
/// doubling up to [`CommConfig::small_all_reduce_bytes`], Rabenseifner's up to
/// [`CommConfig::mid_all_reduce_bytes`] on a power-of-two group, the pipelined ring above.
async fn all_reduce_ordered(
    g: &GroupState,
    ticket: u64,
    buf: &mut [f32],
    bucket: Option<usize>,
) -> Result<(), CommError> {
    let _turn = g.begin(ticket).await?;
    let levels = hier::levels(g);
    let algorithm = Algorithm::of(g, buf);
    // From the group's turn to the end: the time on the wire, not the wait for the turn.
    let span = tracing::info_span!(
        target: "flotilla::comm",
        "all_reduce",
        seq = ticket,
        bucket = tracing::field::Empty,
        bytes = std::mem::size_of_val(buf) as u64,
        algorithm = if levels.is_some() { "hierarchical" } else { algorithm.name() },
        track = "comm"
    );
    if let Some(b) = bucket {
        span.record("bucket", b as u64);
    }
    let started = std::time::Instant::now();
    let r = match levels {
        Some(lv) => hier::all_reduce(lv, buf).instrument(span).await,
        None => algorithm.run(g, ticket, buf).instrument(span).await,
    };
    metrics::histogram!("flotilla_all_reduce_seconds").record(started.elapsed().as_secs_f64());
    g.finish(r).await
}

/// The timeline's span of collective `$name` number `$ticket` over `$buf`, labelled with its
/// bucket when `$bucket` has one.
macro_rules! bucket_span {
    ($name:literal, $ticket:expr, $buf:expr, $bucket:expr) => {{
        let span = tracing::info_span!(
            target: "flotilla::comm",
            $name,
            seq = $ticket,
            bucket = tracing::field::Empty,
            bytes = std::mem::size_of_val($buf) as u64,
            track = "comm"
        );
        if let Some(b) = $bucket {
            span.record("bucket", b as u64);
        }
        span
    }};
}

/// [`ProcessGroup::all_gather_f32`] in its turn `ticket` (of `bucket`, labelled so in the
/// timeline, when the caller has buckets): over the group's shared-memory segment, else the
/// ring's second half.
async fn all_gather_ordered(
    g: &GroupState,
    ticket: u64,
    buf: &mut [f32],
    bucket: Option<usize>,
) -> Result<(), CommError> {
    let _turn = g.begin(ticket).await?;
    let span = bucket_span!("all_gather", ticket, buf, bucket);
    let r = if g.shm.is_some() {
        flat::shm_all_gather(g, ticket, buf).instrument(span).await
    } else {
        let ctx = OpCtx::new(g, ticket, Op::AllGatherF32);
        ring::all_gather(&ctx, buf).instrument(span).await
    };
    g.finish(r).await
}

/// Runs reduce-scatter `ticket` of group `g` in its turn, so that each shard holds the bits
/// the group's all-reduce would leave there: on a group over shared memory the segment's
/// all-reduce itself (every value summed in rank order; the rank then uses its shard only),
/// else always the ring's first half, summed in the order of the ring all-reduce (the
/// doubling and Rabenseifner's halving, picked below [`CommConfig::mid_all_reduce_bytes`],
/// sum in others).
async fn reduce_scatter_ordered(
    g: &GroupState,
    ticket: u64,
    buf: &mut [f32],
    bucket: Option<usize>,
) -> Result<(), CommError> {
    let _turn = g.begin(ticket).await?;
    let span = bucket_span!("reduce_scatter", ticket, buf, bucket);
    let r = if g.shm.is_some() {
        flat::shm_all_reduce(g, ticket, buf).instrument(span).await
    } else {
        let ctx = OpCtx::new(g, ticket, Op::ReduceScatter);
        ring::reduce_scatter(&ctx, buf).instrument(span).await
    };
    g.finish(r).await
}
