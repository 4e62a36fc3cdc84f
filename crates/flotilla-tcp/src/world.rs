//! What the groups of one process share (connections, mailbox, failure state), and each
//! group's own state: members and the sequence space that orders its collectives.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock, Weak};
use std::time::{Duration, Instant};

use flotilla_group::{CommError, Members};
use tokio::runtime::Handle;
use tokio::sync::watch;

use crate::config::CommConfig;
use crate::conn::{Conn, Endpoint};
use crate::frame::{Op, channel};
use crate::host;
use crate::segment::Segment;
use crate::wire::Ctrl;

/// What every group of one process shares: connections, mailbox, failure state.
pub(crate) struct World {
    pub(crate) rank: usize,
    pub(crate) cfg: CommConfig,
    /// The connection to each rank (`None`: itself, or never connected). A slot changes
    /// only when a lost rank rejoins ([`World::revive`]).
    peers: Vec<RwLock<Option<Arc<Conn>>>>,
    /// How many times each rank's connection was replaced by a rejoin.
    generations: Vec<AtomicU64>,
    pub(crate) ep: Arc<Endpoint>,
    pub(crate) poisoned: Mutex<Option<CommError>>,
    pub(crate) collectives: AtomicU64,
    pub(crate) handle: Handle,
    /// The job's session nonce (names the shared-memory segments).
    pub(crate) session: u64,
    /// Each rank's host key, from the rendezvous (empty: unknown).
    hosts: Vec<String>,
    /// The shared-memory segments of this process's groups (to wake them on an abort).
    segments: Mutex<Vec<Weak<Segment>>>,
}

/// Where a world's ranks are: the job's session and each rank's host key.
pub(crate) struct Site {
    pub(crate) session: u64,
    pub(crate) hosts: Vec<String>,
}

/// One group's state: members and its own collective sequence space.
pub(crate) struct GroupState {
    pub(crate) world: Arc<World>,
    /// Key carried by every frame of this group (0: the world).
    pub(crate) key: u64,
    /// The world rank of each group rank, and this process's group rank.
    pub(crate) members: Members,
    next_ticket: AtomicU64,
    turn: watch::Sender<u64>,
    /// How many sub-groups of each kind were derived from this group (to key them).
    pub(crate) derived: Mutex<HashMap<Vec<u8>, u64>>,
    /// When each unfinished collective was issued (for the stall inspector).
    open: Mutex<BTreeMap<u64, Instant>>,
    /// The group's shared-memory segment (set up by its first `f32` collective), when its
    /// members share a host and the transport allows it; `None`: TCP. Set to `None` inside
    /// when the members could not share one (`shm/setup.rs`): TCP from then on.
    pub(crate) shm: Option<OnceLock<Option<Arc<Segment>>>>,
    /// The sub-groups of the hierarchical all-reduce (`crate::hier`), decided by the
    /// group's first all-reduce; `None` inside: flat.
    pub(crate) levels: OnceLock<Option<Levels>>,
}

/// The two sub-groups of a hierarchical all-reduce (`crate::hier`): this rank's host (over
/// its shared segment) and the same local rank of every host (over TCP).
pub(crate) struct Levels {
    /// The group's ranks on this rank's host, in group order.
    pub(crate) local: Arc<GroupState>,
    /// The rank of each host whose local rank is this rank's, hosts in order.
    pub(crate) cross: Arc<GroupState>,
}

/// Advances the collective turn when dropped (also on error or cancellation).
pub(crate) struct TurnGuard<'a> {
    g: &'a GroupState,
    ticket: u64,
}

impl Drop for TurnGuard<'_> {
    fn drop(&mut self) {
        let next = self.ticket + 1;
        self.g.turn.send_modify(|t| *t = (*t).max(next));
        if let Ok(mut open) = self.g.open.lock() {
            *open = open.split_off(&next);
        }
    }
}

impl World {
    /// The world of rank `rank` over `peers` (one slot per rank).
    pub(crate) fn new(
        rank: usize,
        cfg: CommConfig,
        peers: Vec<Option<Arc<Conn>>>,
        ep: Arc<Endpoint>,
        handle: Handle,
        site: Site,
    ) -> Self {
        World {
            rank,
            cfg,
            session: site.session,
            hosts: site.hosts,
            segments: Mutex::new(Vec::new()),
            generations: peers.iter().map(|_| AtomicU64::new(0)).collect(),
            peers: peers.into_iter().map(RwLock::new).collect(),
            ep,
            poisoned: Mutex::new(None),
            collectives: AtomicU64::new(0),
            handle,
        }
    }

    /// The connection to `peer`, for point-to-point messages.
    pub(crate) fn conn(&self, peer: usize) -> Result<Arc<Conn>, CommError> {
        let slot = self.peers.get(peer).map(|s| match s.read() {
            Ok(c) => c.clone(),
            Err(p) => p.into_inner().clone(),
        });
        match slot {
            Some(Some(c)) => Ok(c),
            _ => Err(CommError::InvalidArgument(format!(
                "rank {peer} is not a peer of rank {} (world size {})",
                self.rank,
                self.peers.len()
            ))),
        }
    }

    /// The connection to `peer` for a collective: a rejoined rank's link carries
    /// point-to-point messages only (it missed the collectives issued before it came back,
    /// so it cannot agree on their order).
    pub(crate) fn collective_conn(&self, peer: usize) -> Result<Arc<Conn>, CommError> {
        let c = self.conn(peer)?;
        if c.point_to_point_only() {
            return Err(CommError::PeerLost {
                peer,
                op: "collective".into(),
                reason: "the rank rejoined the running job: only point-to-point messages reach it"
                    .into(),
            });
        }
        Ok(c)
    }

    /// Every current connection.
    pub(crate) fn conns(&self) -> Vec<Arc<Conn>> {
        (0..self.peers.len())
            .filter_map(|r| self.conn(r).ok())
            .collect()
    }

    /// Whether the connection to `peer` exists and is lost (the rank may be replaced).
    pub(crate) fn is_lost(&self, peer: usize) -> bool {
        self.conn(peer).is_ok_and(|c| c.is_lost())
    }

    /// Puts `conn` in `peer`'s slot (a rejoined rank): point-to-point messages flow again
    /// and receivers no longer see the peer as lost.
    pub(crate) fn revive(&self, peer: usize, conn: Arc<Conn>) {
        if let Some(slot) = self.peers.get(peer) {
            let old = match slot.write() {
                Ok(mut g) => g.replace(conn),
                Err(p) => p.into_inner().replace(conn),
            };
            drop(old);
            self.generations[peer].fetch_add(1, Ordering::SeqCst);
            self.ep.mailbox.peer_back(peer);
        }
    }

    /// Whether a group of `members` (world ranks) exchanges `f32` collectives through
    /// shared memory: more than one member, all on this host, transport not `tcp`.
    pub(crate) fn uses_shm(&self, members: &[usize]) -> bool {
        members.len() > 1
            && self.cfg.transport != crate::config::Transport::Tcp
            && host::all_local(&self.hosts, members)
            && members
                .iter()
                .all(|&w| w == self.rank || self.conn(w).is_ok_and(|c| !c.point_to_point_only()))
    }

    /// The host key of world rank `w` (empty: unknown).
    pub(crate) fn host(&self, w: usize) -> &str {
        self.hosts.get(w).map_or("", String::as_str)
    }

    /// Remembers a group's segment (so that an abort wakes its waiters).
    pub(crate) fn add_segment(&self, seg: &Arc<Segment>) {
        let mut s = self.segments.lock().unwrap_or_else(|p| p.into_inner());
        s.retain(|w| w.strong_count() > 0);
        s.push(Arc::downgrade(seg));
    }

    /// Marks every segment of the process aborted, waking the waiters of every member.
    pub(crate) fn abort_segments(&self, reason: &str) {
        let s = self.segments.lock().unwrap_or_else(|p| p.into_inner());
        for seg in s.iter().filter_map(Weak::upgrade) {
            seg.abort(reason);
        }
    }

    /// How many times `peer` rejoined.
    pub(crate) fn generation(&self, peer: usize) -> u64 {
        self.generations
            .get(peer)
            .map_or(0, |g| g.load(Ordering::SeqCst))
    }
}

impl GroupState {
    /// The state of a group of `members` (world ranks) with key `key`.
    pub(crate) fn new(world: Arc<World>, key: u64, members: Members) -> Arc<Self> {
        let shm = world.uses_shm(members.world_ranks()).then(OnceLock::new);
        // Peers' frames of the group are taken from now on, however many.
        world.ep.add_group(key);
        Arc::new(Self {
            shm,
            world,
            key,
            members,
            next_ticket: AtomicU64::new(0),
            turn: watch::channel(0).0,
            derived: Mutex::new(HashMap::new()),
            open: Mutex::new(BTreeMap::new()),
            levels: OnceLock::new(),
        })
    }

    /// Whether the group's `f32` collectives go through its segment: its members share one
    /// (or will, once set up), and its setup did not fall back to TCP.
    pub(crate) fn uses_segment(&self) -> bool {
        self.shm
            .as_ref()
            .is_some_and(|s| !matches!(s.get(), Some(None)))
    }

    /// Takes the next sequence number of this group.
    pub(crate) fn ticket(&self) -> u64 {
        self.world.collectives.fetch_add(1, Ordering::Relaxed);
        self.nested_ticket()
    }

    /// Takes the next sequence number of this group for a step of another group's
    /// collective (not counted as a collective of its own).
    pub(crate) fn nested_ticket(&self) -> u64 {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        let ticket = self.next_ticket.fetch_add(1, Ordering::SeqCst);
        open.insert(ticket, Instant::now());
        ticket
    }

    /// Collectives issued so far and the oldest unfinished one (sequence number, age).
    pub(crate) fn activity(&self) -> flotilla_group::Activity {
        let open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        flotilla_group::Activity {
            issued: self.next_ticket.load(Ordering::SeqCst),
            oldest_open: open.iter().next().map(|(&seq, t)| (seq, t.elapsed())),
        }
    }

    /// The world rank of group rank `rank`, or an error for a rank out of range.
    pub(crate) fn world_rank_checked(&self, rank: usize) -> Result<usize, CommError> {
        self.members.world_rank_checked(rank, "peer")
    }

    /// This process's group rank.
    pub(crate) fn me(&self) -> usize {
        self.members.me()
    }

    /// Waits until it is `ticket`'s turn; fails fast if the communicator is poisoned.
    pub(crate) async fn begin(&self, ticket: u64) -> Result<TurnGuard<'_>, CommError> {
        let mut rx = self.turn.subscribe();
        // The sender lives as long as `self`, so this cannot fail.
        let _ = rx.wait_for(|t| *t >= ticket).await;
        let guard = TurnGuard { g: self, ticket };
        if let Some(e) = self.world.poisoned.lock().ok().and_then(|p| p.clone()) {
            return Err(CommError::Poisoned(Box::new(e)));
        }
        Ok(guard)
    }

    /// Records a failure (poisoning every group of the process and telling all peers) and
    /// passes the result through.
    pub(crate) async fn finish<T>(&self, r: Result<T, CommError>) -> Result<T, CommError> {
        let Err(e) = r else { return r };
        let w = &self.world;
        tracing::error!(rank = w.rank, error = %e, "collective failed");
        if let Ok(mut p) = w.poisoned.lock()
            && p.is_none()
        {
            *p = Some(e.clone());
        }
        if !matches!(e, CommError::Aborted { .. } | CommError::Poisoned(_)) {
            let msg = Ctrl::Abort {
                reason: e.to_string(),
            }
            .encode();
            let sends = w.conns().into_iter().map(|p| {
                let (p, msg) = (p.clone(), msg.clone());
                tokio::spawn(
                    async move { p.send(channel::CONTROL, Op::Control, (0, 0, 0), &msg).await },
                )
            });
            let handles: Vec<_> = sends.collect();
            let _ = tokio::time::timeout(Duration::from_secs(1), async {
                for h in handles {
                    let _ = h.await;
                }
            })
            .await;
        }
        Err(e)
    }
}

/// FNV-1a over the parent's key and `id`: the key of a derived group. Every member derives
/// the same key from the same parent and creation history; 0 stays the world's.
pub(crate) fn derive_key(parent: u64, id: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in parent.to_le_bytes().iter().chain(id) {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    if h == 0 { 1 } else { h }
}
