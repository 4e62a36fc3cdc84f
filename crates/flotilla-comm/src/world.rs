//! What the groups of one process share (connections, mailbox, failure state), and each
//! group's own state: members and the sequence space that orders its collectives.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::runtime::Handle;
use tokio::sync::watch;

use crate::config::CommConfig;
use crate::conn::{Conn, Endpoint};
use crate::error::CommError;
use crate::frame::{Op, channel};
use crate::wire::Ctrl;

/// What every group of one process shares: connections, mailbox, failure state.
pub(crate) struct World {
    pub(crate) rank: usize,
    pub(crate) cfg: CommConfig,
    pub(crate) peers: Vec<Option<Arc<Conn>>>,
    pub(crate) ep: Arc<Endpoint>,
    pub(crate) poisoned: Mutex<Option<CommError>>,
    pub(crate) collectives: AtomicU64,
    pub(crate) handle: Handle,
}

/// One group's state: members and its own collective sequence space.
pub(crate) struct GroupState {
    pub(crate) world: Arc<World>,
    /// Key carried by every frame of this group (0: the world).
    pub(crate) key: u64,
    /// World rank of each group rank.
    pub(crate) members: Vec<usize>,
    /// This process's group rank.
    pub(crate) me: usize,
    next_ticket: AtomicU64,
    turn: watch::Sender<u64>,
    /// How many sub-groups of each kind were derived from this group (to key them).
    pub(crate) derived: Mutex<HashMap<Vec<u8>, u64>>,
    /// When each unfinished collective was issued (for the stall inspector).
    open: Mutex<BTreeMap<u64, Instant>>,
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
    pub(crate) fn conn(&self, peer: usize) -> Result<Arc<Conn>, CommError> {
        match self.peers.get(peer) {
            Some(Some(c)) => Ok(c.clone()),
            _ => Err(CommError::InvalidArgument(format!(
                "rank {peer} is not a peer of rank {} (world size {})",
                self.rank,
                self.peers.len()
            ))),
        }
    }
}

impl GroupState {
    /// The state of a group of `members` (world ranks) with key `key`.
    pub(crate) fn new(world: Arc<World>, key: u64, members: Vec<usize>, me: usize) -> Arc<Self> {
        Arc::new(Self {
            world,
            key,
            members,
            me,
            next_ticket: AtomicU64::new(0),
            turn: watch::channel(0).0,
            derived: Mutex::new(HashMap::new()),
            open: Mutex::new(BTreeMap::new()),
        })
    }

    /// Takes the next sequence number of this group.
    pub(crate) fn ticket(&self) -> u64 {
        self.world.collectives.fetch_add(1, Ordering::Relaxed);
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        let ticket = self.next_ticket.fetch_add(1, Ordering::SeqCst);
        open.insert(ticket, Instant::now());
        ticket
    }

    /// Collectives issued so far and the oldest unfinished one (sequence number, age).
    pub(crate) fn activity(&self) -> crate::group::Activity {
        let open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        crate::group::Activity {
            issued: self.next_ticket.load(Ordering::SeqCst),
            oldest_open: open.iter().next().map(|(&seq, t)| (seq, t.elapsed())),
        }
    }

    /// The world rank of group rank `rank`, or an error for a rank out of range.
    pub(crate) fn world_rank_checked(&self, rank: usize) -> Result<usize, CommError> {
        self.members.get(rank).copied().ok_or_else(|| {
            CommError::InvalidArgument(format!(
                "rank {rank} is out of range for a group of {}",
                self.members.len()
            ))
        })
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
            let sends = w.peers.iter().flatten().map(|p| {
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
