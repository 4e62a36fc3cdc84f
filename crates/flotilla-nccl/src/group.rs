//! [`NcclGroup`]: the [`ProcessGroup`] of Flotilla whose `f32` collectives run over NCCL.

use std::sync::Arc;
use std::time::{Duration, Instant};

use flotilla_group::{
    Activity, CommError, CommStats, Members, PendingAllReduce, ProcessGroup, ReduceOp, Tag, Taken,
    subgroup::SplitPlan,
};

use crate::comm::{self, NcclComm};
use crate::ops::Op;
use crate::queue::Queue;

/// How to put NCCL under a control group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NcclConfig {
    /// The CUDA device (GPU index) of this rank: its local rank's
    /// (`flotilla_engine::local_device`).
    pub device: usize,
    /// Deadline of each whole collective, and of NCCL's initialisation.
    pub timeout: Duration,
}

/// A group whose `f32` collectives run over NCCL on this rank's GPU (staged through device
/// buffers: the interface moves host slices) and whose other operations — barriers,
/// bytes, integers, point-to-point messages, sub-group agreement — go through its control
/// group (Flotilla's TCP group of the same ranks). **Untested on hardware.**
///
/// Differences from the TCP backend: sums are NCCL's (its ring or tree order: all ranks
/// bit-identical, not the TCP ring's bits); a collective's timeout bounds the whole
/// collective and names every other member (NCCL does not tell which rank is late); after a
/// timeout or an abort the communicator is aborted (`ncclCommAbort`) and every later `f32`
/// collective of the group fails; sub-groups make communicators of their own (a new unique
/// id over the control sub-group); `wire_format: bf16` does not apply.
///
/// ```no_run
/// # fn control() -> std::sync::Arc<dyn flotilla_group::ProcessGroup> { unimplemented!() }
/// use flotilla_group::ProcessGroup;
/// use flotilla_nccl::{NcclConfig, NcclGroup};
/// let tcp = control(); // e.g. flotilla_tcp::TcpGroup::connect(..)
/// let cfg = NcclConfig { device: 0, timeout: std::time::Duration::from_secs(60) };
/// let world = NcclGroup::over(tcp, cfg)?;
/// let mut grads = vec![1.0f32; 1024];
/// world.all_reduce_sum(&mut grads)?;
/// # Ok::<(), flotilla_group::CommError>(())
/// ```
pub struct NcclGroup {
    control: Arc<dyn ProcessGroup>,
    q: Arc<Queue>,
    cfg: NcclConfig,
}

impl std::fmt::Debug for NcclGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclGroup")
            .field("group", &self.q.name)
            .field("rank", &self.q.members.me())
            .field("device", &self.cfg.device)
            .finish()
    }
}

impl Drop for NcclGroup {
    fn drop(&mut self) {
        self.q.detach();
    }
}

impl NcclGroup {
    /// NCCL over the ranks of `control`: its rank 0 creates the unique id and broadcasts
    /// its 128 bytes over `control`, then every rank joins the communicator on
    /// `cfg.device`. Collective over `control`. A rank that cannot load the driver or NCCL
    /// fails with an error naming the library (its peers then fail at their deadline).
    pub fn over(control: Arc<dyn ProcessGroup>, cfg: NcclConfig) -> Result<NcclGroup, CommError> {
        let unusable = |detail: String| CommError::Config(format!("comm.backend: nccl: {detail}"));
        let mut id = match control.rank() {
            0 => comm::new_id().map_err(unusable)?,
            _ => Vec::new(),
        };
        control.broadcast_bytes(&mut id, 0, comm::ID_BYTES)?;
        let (me, n) = (control.rank(), control.size());
        let comm = NcclComm::init(cfg.device, &id, (me, n), cfg.timeout).map_err(unusable)?;
        let world: Vec<usize> = (0..n).map(|r| control.world_rank(r)).collect();
        let name = format!("of world ranks {world:?}");
        let q = Queue::start(Box::new(comm), Members::new(world, me), cfg.timeout, name)?;
        tracing::info!(rank = me, size = n, device = cfg.device, "NCCL group up");
        Ok(NcclGroup { control, q, cfg })
    }

    fn run(&self, op: Op, into: &mut [f32], what: &str) -> Result<(), CommError> {
        let v = self.q.submit(op).wait()?;
        if v.len() != into.len() {
            return Err(CommError::InvalidArgument(format!(
                "{what}: {} elements came back for a buffer of {}",
                v.len(),
                into.len()
            )));
        }
        into.copy_from_slice(&v);
        Ok(())
    }

    fn derive(&self, control: Arc<dyn ProcessGroup>) -> Result<Arc<dyn ProcessGroup>, CommError> {
        Ok(Arc::new(NcclGroup::over(control, self.cfg)?))
    }
}

impl ProcessGroup for NcclGroup {
    fn rank(&self) -> usize {
        self.q.members.me()
    }

    fn size(&self) -> usize {
        self.q.members.len()
    }

    fn world_rank(&self, rank: usize) -> usize {
        self.q.members.world_rank(rank)
    }

    fn group_rank(&self, world_rank: usize) -> Option<usize> {
        self.q.members.group_rank(world_rank)
    }

    fn timeout(&self) -> Duration {
        self.q.timeout
    }

    fn stats(&self) -> CommStats {
        self.control.stats()
    }

    fn barrier(&self) -> Result<(), CommError> {
        self.control.barrier()
    }

    fn broadcast_f32(&self, buf: &mut [f32], root: usize) -> Result<(), CommError> {
        self.q.members.world_rank_checked(root, "broadcast_f32")?;
        self.run(Op::Broadcast(buf.to_vec(), root), buf, "broadcast_f32")
    }

    fn broadcast_bytes(
        &self,
        buf: &mut Vec<u8>,
        root: usize,
        max_len: usize,
    ) -> Result<(), CommError> {
        self.control.broadcast_bytes(buf, root, max_len)
    }

    fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        self.control.all_gather_bytes(mine)
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), CommError> {
        self.run(Op::AllReduce(buf.to_vec()), buf, "all_reduce_sum")
    }

    fn all_reduce_start(&self, buf: Vec<f32>) -> PendingAllReduce {
        self.q.submit(Op::AllReduce(buf))
    }

    fn reduce_scatter_sum_f32(&self, buf: &mut [f32]) -> Result<(), CommError> {
        self.run(
            Op::ReduceScatter(buf.to_vec()),
            buf,
            "reduce_scatter_sum_f32",
        )
    }

    fn reduce_scatter_bucket(&self, buf: Vec<f32>, bucket: usize) -> PendingAllReduce {
        let _ = bucket;
        self.q.submit(Op::ReduceScatter(buf))
    }

    fn all_gather_f32(&self, buf: &mut [f32]) -> Result<(), CommError> {
        self.run(Op::AllGather(buf.to_vec()), buf, "all_gather_f32")
    }

    fn all_gather_bucket(&self, buf: Vec<f32>, bucket: usize) -> PendingAllReduce {
        let _ = bucket;
        self.q.submit(Op::AllGather(buf))
    }

    fn all_reduce_i64(&self, buf: &mut [i64], op: ReduceOp) -> Result<(), CommError> {
        self.control.all_reduce_i64(buf, op)
    }

    fn all_reduce_u64(&self, buf: &mut [u64], op: ReduceOp) -> Result<(), CommError> {
        self.control.all_reduce_u64(buf, op)
    }

    fn send(&self, peer: usize, tag: Tag, msg: &[u8]) -> Result<(), CommError> {
        self.control.send(peer, tag, msg)
    }

    fn take_from_mailbox(&self, peers: &[usize], tag: Tag, deadline: Instant) -> Option<Taken> {
        self.control.take_from_mailbox(peers, tag, deadline)
    }

    fn subgroup_from(&self, plan: &SplitPlan) -> Result<Option<Arc<dyn ProcessGroup>>, CommError> {
        match self.control.subgroup_from(plan)? {
            Some(control) => self.derive(control).map(Some),
            None => Ok(None),
        }
    }

    fn group(&self, ranks: &[usize]) -> Result<Arc<dyn ProcessGroup>, CommError> {
        let control = self.control.group(ranks)?;
        self.derive(control)
    }

    fn rejoins(&self, rank: usize) -> u64 {
        self.control.rejoins(rank)
    }

    fn activity(&self) -> Activity {
        self.q.activity()
    }

    fn abort(&self, reason: &str) {
        self.control.abort(reason);
        self.q.fail(&CommError::Aborted {
            by: self.world_rank(self.rank()),
            reason: reason.to_string(),
        });
    }
}
