//! [`MpiGroup`]: the [`ProcessGroup`] of Flotilla over MPI.

use std::sync::Arc;
use std::time::{Duration, Instant};

use flotilla_group::{
    Activity, CommError, CommStats, PeerName, PendingAllReduce, ProcessGroup, ReduceOp,
    RendezvousError, Tag, Taken, subgroup::SplitPlan,
};

use crate::ops::{Op, Out};
use crate::raw::MpiComm;
use crate::runtime::{Runtime, runtime};
use crate::state::GroupState;
use crate::{wire, worker};

/// How to start the world group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MpiConfig {
    /// Deadline of each whole collective (see [`MpiGroup`]).
    pub timeout: Duration,
    /// A hash every rank must agree on (the run's config); `None`: not checked.
    pub config_hash: Option<u64>,
}

impl Default for MpiConfig {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(60),
            config_hash: None,
        }
    }
}

/// A group of MPI processes: the MPI implementation of [`ProcessGroup`].
///
/// Collectives are MPI's (`MPI_Barrier`, `MPI_Bcast`, `MPI_Allgather(v)`, `MPI_Allreduce`
/// with `MPI_SUM` on `f32`, which Open MPI computes alike on every rank of a communicator;
/// integer reductions with MPI's `MAX`, `MIN`, `BAND`, `BOR` and a wrapping unsigned sum).
/// Each runs on the group's worker thread in the order issued, so
/// [`ProcessGroup::all_reduce_start`] takes its place in that order when called. Sub-groups
/// are new communicators (`MPI_Comm_split`, `MPI_Comm_create_group`). Point-to-point
/// messages travel under one MPI tag with the Flotilla tag in a trailer and wait in a
/// mailbox per (sender, tag); `recv_any` honours its deadline.
///
/// Differences from the TCP backend, by MPI's nature:
/// - the timeout bounds a whole collective, not each wait on a peer, and a late collective
///   names every other member (MPI does not tell which rank is late);
/// - a blocking MPI call cannot be cancelled: on a timeout or [`ProcessGroup::abort`] the
///   *caller* gets the error at once and every later collective fails, but the worker stays
///   inside MPI; [`crate::finalize`] then ends the job with `MPI_Abort`;
/// - a lost process is not seen as such: `mpirun` ends the job when one exits abnormally;
/// - `group` communicates among its members (`MPI_Comm_create_group`) in the parent's
///   collective order, so members create a sub-group at the same point of the parent's
///   collective sequence (as every caller in Flotilla does);
/// - [`ProcessGroup::stats`] counts payload bytes (collective buffers sent and received by
///   this rank, point-to-point messages with their 4-byte tag) and MPI calls as frames;
/// - `wire_format: bf16` does not apply: sums are always exact `f32`.
///
/// ```no_run
/// use flotilla_group::ProcessGroup;
/// use flotilla_mpi::{MpiConfig, MpiGroup};
/// let world = MpiGroup::world(MpiConfig::default())?;
/// let mut grads = vec![1.0f32; 1024];
/// world.all_reduce_sum(&mut grads)?;
/// drop(world);
/// flotilla_mpi::finalize(true);
/// # Ok::<(), flotilla_group::CommError>(())
/// ```
pub struct MpiGroup {
    g: Arc<GroupState>,
}

impl std::fmt::Debug for MpiGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiGroup")
            .field("rank", &self.g.members.me())
            .field("size", &self.g.members.len())
            .finish()
    }
}

impl Drop for MpiGroup {
    fn drop(&mut self) {
        self.g.detach();
    }
}

impl MpiGroup {
    /// The group of every process of the MPI job (a duplicate of `MPI_COMM_WORLD`),
    /// starting MPI on first use. Collective: every process calls it. With a
    /// `config_hash`, the ranks compare theirs and fail alike on a mismatch, naming the rank.
    pub fn world(cfg: MpiConfig) -> Result<MpiGroup, CommError> {
        let rt = runtime()?;
        let comm = MpiComm::world_dup();
        let (me, n) = (comm.rank(), comm.size());
        let group = Self::start(rt, comm, (0..n).collect(), me, cfg.timeout)?;
        if let Some(hash) = cfg.config_hash {
            group.check_hash(hash)?;
        }
        tracing::info!(rank = me, world_size = n, "MPI world group up");
        Ok(group)
    }

    /// A group over `comm` with its worker running.
    fn start(
        rt: &'static Runtime,
        comm: MpiComm,
        members: Vec<usize>,
        me: usize,
        timeout: Duration,
    ) -> Result<MpiGroup, CommError> {
        if comm.size() != members.len() || comm.rank() != me {
            return Err(CommError::InvalidArgument(format!(
                "MPI communicator has rank {} of {}, expected {me} of {}",
                comm.rank(),
                comm.size(),
                members.len()
            )));
        }
        let members = flotilla_group::Members::new(members, me);
        let g = Arc::new(GroupState::new(rt, comm, members, timeout));
        let (tx, rx) = std::sync::mpsc::channel();
        g.attach(tx);
        worker::spawn(g.clone(), rx)?;
        let served: std::sync::Weak<dyn crate::runtime::Served> = Arc::downgrade(&g) as _;
        rt.register(served);
        Ok(MpiGroup { g })
    }

    /// Every rank's hash must equal rank 0's.
    fn check_hash(&self, hash: u64) -> Result<(), CommError> {
        let all = self.all_gather_u64(hash)?;
        let expected = all.first().copied().unwrap_or(hash);
        match all.iter().position(|&h| h != expected) {
            None => Ok(()),
            Some(r) => Err(RendezvousError::ConfigHashMismatch {
                peer: PeerName::ranked(self.world_rank(r), "mpi"),
                expected: Some(expected),
                got: all[r],
            }
            .into()),
        }
    }

    /// Runs `op` in its turn and waits for it.
    fn run<T: Send + 'static>(
        &self,
        op: Op,
        map: fn(Out) -> Result<T, CommError>,
    ) -> Result<T, CommError> {
        self.g.submit(op, map).wait()
    }

    /// A sub-group over `comm` of `members` (ranks of this group).
    fn derive(&self, comm: MpiComm, members: &[usize]) -> Result<Arc<dyn ProcessGroup>, CommError> {
        let world: Vec<usize> = members.iter().map(|&r| self.world_rank(r)).collect();
        let me = comm.rank();
        Ok(Arc::new(Self::start(
            self.g.rt,
            comm,
            world,
            me,
            self.g.timeout,
        )?))
    }

    fn checked(&self, rank: usize, what: &str) -> Result<usize, CommError> {
        self.g.members.world_rank_checked(rank, what)
    }
}

fn same_len<T: Copy>(dst: &mut [T], src: Vec<T>, what: &str) -> Result<(), CommError> {
    if dst.len() != src.len() {
        return Err(CommError::InvalidArgument(format!(
            "{what}: {} elements came back for a buffer of {}",
            src.len(),
            dst.len()
        )));
    }
    dst.copy_from_slice(&src);
    Ok(())
}

impl ProcessGroup for MpiGroup {
    fn rank(&self) -> usize {
        self.g.members.me()
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
        self.g.timeout
    }

    fn stats(&self) -> CommStats {
        self.g.rt.stats()
    }

    fn barrier(&self) -> Result<(), CommError> {
        self.run(Op::Barrier, Out::unit)
    }

    fn broadcast_f32(&self, buf: &mut [f32], root: usize) -> Result<(), CommError> {
        self.checked(root, "broadcast_f32")?;
        let v = self.run(Op::BroadcastF32(buf.to_vec(), root), Out::f32s)?;
        same_len(buf, v, "broadcast_f32")
    }

    fn broadcast_bytes(
        &self,
        buf: &mut Vec<u8>,
        root: usize,
        max_len: usize,
    ) -> Result<(), CommError> {
        self.checked(root, "broadcast_bytes")?;
        let op = Op::BroadcastBytes(std::mem::take(buf), root, max_len);
        *buf = self.run(op, Out::bytes)?;
        Ok(())
    }

    fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        self.run(Op::AllGather(mine.to_vec()), Out::gathered)
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), CommError> {
        let v = self.run(Op::AllReduceF32(buf.to_vec()), Out::f32s)?;
        same_len(buf, v, "all_reduce_sum")
    }

    fn all_reduce_start(&self, buf: Vec<f32>) -> PendingAllReduce {
        self.g.submit(Op::AllReduceF32(buf), Out::f32s)
    }

    fn reduce_scatter_sum_f32(&self, buf: &mut [f32]) -> Result<(), CommError> {
        let v = self.run(Op::ReduceScatterF32(buf.to_vec()), Out::f32s)?;
        same_len(buf, v, "reduce_scatter_sum_f32")
    }

    fn reduce_scatter_bucket(&self, buf: Vec<f32>, bucket: usize) -> PendingAllReduce {
        let _ = bucket;
        self.g.submit(Op::ReduceScatterF32(buf), Out::f32s)
    }

    fn all_gather_f32(&self, buf: &mut [f32]) -> Result<(), CommError> {
        let v = self.run(Op::AllGatherF32(buf.to_vec()), Out::f32s)?;
        same_len(buf, v, "all_gather_f32")
    }

    fn all_gather_bucket(&self, buf: Vec<f32>, bucket: usize) -> PendingAllReduce {
        let _ = bucket;
        self.g.submit(Op::AllGatherF32(buf), Out::f32s)
    }

    fn all_reduce_i64(&self, buf: &mut [i64], op: ReduceOp) -> Result<(), CommError> {
        let v = self.run(Op::AllReduceI64(buf.to_vec(), op), Out::i64s)?;
        same_len(buf, v, "all_reduce_i64")
    }

    fn all_reduce_u64(&self, buf: &mut [u64], op: ReduceOp) -> Result<(), CommError> {
        let v = self.run(Op::AllReduceU64(buf.to_vec(), op), Out::u64s)?;
        same_len(buf, v, "all_reduce_u64")
    }

    fn send(&self, peer: usize, tag: Tag, msg: &[u8]) -> Result<(), CommError> {
        self.checked(peer, "send")?;
        if peer == self.g.members.me() {
            return self.g.mailbox.deliver(0, peer, tag, msg.to_vec());
        }
        let wire = wire::encode(tag, msg);
        self.g.comm.send(peer, &wire)?;
        self.g.rt.stats.add_sent(wire.len() as u64);
        Ok(())
    }

    fn take_from_mailbox(&self, peers: &[usize], tag: Tag, deadline: Instant) -> Option<Taken> {
        // The group's own mailbox, by group rank.
        self.g.mailbox.take(0, peers, tag, deadline)
    }

    fn subgroup_from(&self, plan: &SplitPlan) -> Result<Option<Arc<dyn ProcessGroup>>, CommError> {
        // MPI_Comm_split is collective: members joining no group take part too.
        let (c, k) = match plan.mpi {
            Some((c, k)) => (Some(c), k),
            None => (None, 0),
        };
        match self.run(Op::Split(c, k), Out::comm)? {
            Some(comm) => self.derive(comm, &plan.members).map(Some),
            None => Ok(None),
        }
    }

    fn group(&self, ranks: &[usize]) -> Result<Arc<dyn ProcessGroup>, CommError> {
        self.g.members.subgroup(ranks)?;
        // The n-th group of these members gets its own MPI tag (as the TCP backend's key).
        let n = {
            let mut d = self.g.derived.lock().unwrap_or_else(|p| p.into_inner());
            let n = d.entry(ranks.to_vec()).or_insert(0);
            *n += 1;
            *n
        };
        let tag = 100 + (n % 16_000) as i32;
        let comm = self
            .run(Op::CreateGroup(ranks.to_vec(), tag), Out::comm)?
            .ok_or_else(|| CommError::InvalidArgument("group: no communicator".into()))?;
        self.derive(comm, ranks)
    }

    fn activity(&self) -> Activity {
        self.g.activity()
    }

    fn abort(&self, reason: &str) {
        let e = CommError::Aborted {
            by: self.g.rt.world_rank,
            reason: reason.to_string(),
        };
        self.g.rt.poison(&e);
        // Callers waiting in a collective get the error now, not at the next deadline scan.
        for g in self.g.rt.groups() {
            g.watch_deadlines();
        }
    }
}
