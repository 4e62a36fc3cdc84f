//! [`MpiComm`]: one MPI communicator and the MPI calls Flotilla makes on it (through
//! rsmpi). Every size is checked against MPI's `int` counts first; MPI's own errors are
//! fatal (Open MPI's default `MPI_ERRORS_ARE_FATAL`: the job ends with MPI's message).

use mpi::collective::SystemOperation;
use mpi::datatype::PartitionMut;
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::*;

use flotilla_group::{CommError, ReduceOp, segment, shard};

use crate::wire::P2P_TAG;

/// An MPI communicator shared by the threads of a group (its worker runs the collectives,
/// the progress thread receives, callers send).
pub(crate) struct MpiComm(SimpleCommunicator);

// SAFETY: an MPI communicator handle may be used from any thread once MPI runs at
// `MPI_THREAD_MULTIPLE`, which the runtime checks before any `MpiComm` exists. Flotilla
// never runs two collectives on one communicator at once: they all go through the group's
// single worker thread; receiving (probe + matched receive) and sending are thread-safe.
unsafe impl Send for MpiComm {}
// SAFETY: as above.
unsafe impl Sync for MpiComm {}

/// `n` as an MPI count.
pub(crate) fn count(n: usize, what: &str) -> Result<i32, CommError> {
    i32::try_from(n).map_err(|_| {
        CommError::InvalidArgument(format!(
            "{what}: {n} elements exceed MPI's int count (2^31 - 1)"
        ))
    })
}

/// `buf`, or when it is empty an empty slice of `pad`: an empty `&[u8]` points at address
/// 1, which Open MPI takes for `MPI_IN_PLACE` (`(void *) 1`). (A `Vec` with capacity has a
/// real address even when empty.)
fn not_in_place<'a>(buf: &'a [u8], pad: &'a [u8; 1]) -> &'a [u8] {
    if buf.is_empty() { &pad[..0] } else { buf }
}

fn rank_of(r: usize) -> Result<i32, CommError> {
    count(r, "rank")
}

impl MpiComm {
    /// A duplicate of `MPI_COMM_WORLD` (Flotilla's world group gets its own context).
    pub(crate) fn world_dup() -> MpiComm {
        MpiComm(SimpleCommunicator::world().duplicate())
    }

    /// This process's rank in the communicator.
    pub(crate) fn rank(&self) -> usize {
        self.0.rank().max(0) as usize
    }

    /// Number of processes in the communicator.
    pub(crate) fn size(&self) -> usize {
        self.0.size().max(0) as usize
    }

    /// `MPI_Barrier`.
    pub(crate) fn barrier(&self) {
        self.0.barrier();
    }

    /// `MPI_Bcast` of `buf` from `root`.
    pub(crate) fn broadcast_f32(&self, buf: &mut [f32], root: usize) -> Result<(), CommError> {
        count(buf.len(), "broadcast_f32")?;
        self.0.process_at_rank(rank_of(root)?).broadcast_into(buf);
        Ok(())
    }

    /// `MPI_Bcast` of the length, then of the bytes, from `root`. A length above `max_len`
    /// fails on every member that passed that `max_len` (the root too, so no member is left
    /// in the second `MPI_Bcast`), before the bytes are allocated.
    pub(crate) fn broadcast_bytes(
        &self,
        buf: &mut Vec<u8>,
        root: usize,
        max_len: usize,
    ) -> Result<(), CommError> {
        let root_rank = root;
        let root = self.0.process_at_rank(rank_of(root)?);
        let mut len = buf.len() as u64;
        root.broadcast_into(&mut len);
        let n = usize::try_from(len)
            .ok()
            .filter(|&n| n <= max_len)
            .ok_or_else(|| {
                CommError::InvalidArgument(format!(
                    "broadcast_bytes: root {root_rank} broadcasts {len} bytes, more than \
                     max_len {max_len}"
                ))
            })?;
        count(n, "broadcast_bytes")?;
        buf.resize(n, 0);
        // Every member now knows the length; an empty buffer's address would read as
        // MPI_IN_PLACE (see `not_in_place`), so nothing more is sent.
        if n > 0 {
            root.broadcast_into(&mut buf[..]);
        }
        Ok(())
    }

    /// `MPI_Allgather` of the lengths, then `MPI_Allgatherv` of the bytes.
    pub(crate) fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        let n = self.size();
        let len = count(mine.len(), "all_gather_bytes")?;
        let mut counts = vec![0i32; n];
        self.0.all_gather_into(&len, &mut counts[..]);
        let mut displs = Vec::with_capacity(n);
        let mut total = 0usize;
        for &c in &counts {
            displs.push(count(total, "all_gather_bytes (total)")?);
            total += c.max(0) as usize;
        }
        count(total, "all_gather_bytes (total)")?;
        let mut all = Vec::with_capacity(total.max(1));
        all.resize(total, 0u8);
        let pad = [0u8; 1];
        {
            let mut part = PartitionMut::new(&mut all[..], &counts[..], &displs[..]);
            self.0
                .all_gather_varcount_into(not_in_place(mine, &pad), &mut part);
        }
        Ok(counts
            .iter()
            .zip(&displs)
            .map(|(&c, &d)| all[d as usize..d as usize + c.max(0) as usize].to_vec())
            .collect())
    }

    /// `MPI_Allreduce` with `MPI_SUM` on `MPI_FLOAT`.
    pub(crate) fn all_reduce_f32(&self, buf: &[f32]) -> Result<Vec<f32>, CommError> {
        count(buf.len(), "all_reduce_sum")?;
        let mut out = vec![0f32; buf.len()];
        self.0
            .all_reduce_into(buf, &mut out[..], SystemOperation::sum());
        Ok(out)
    }

    /// `MPI_Reduce_scatter` (sum) of `buf`: `buf` with this rank's [`shard`] replaced by
    /// its sum over the communicator. MPI's blocks go in rank order and rank `r`'s shard is
    /// segment `r + 1`, so the buffer is sent rotated to start at segment 1 (rsmpi has only
    /// the equal-block variant, hence the FFI call).
    pub(crate) fn reduce_scatter_f32(&self, buf: &[f32]) -> Result<Vec<f32>, CommError> {
        let (n, len) = (self.size(), buf.len());
        count(len, "reduce_scatter_sum_f32")?;
        let counts = (0..n)
            .map(|q| count(shard(len, n, q).len(), "reduce_scatter_sum_f32"))
            .collect::<Result<Vec<i32>, _>>()?;
        let cut = segment(len, n, 1 % n.max(1)).start;
        let rotated: Vec<f32> = buf[cut..].iter().chain(&buf[..cut]).copied().collect();
        let mine = shard(len, n, self.rank());
        let mut out = vec![0f32; mine.len().max(1)];
        // SAFETY: `rotated` holds the sum of `counts` values, `out` at least this rank's
        // count; both outlive the blocking call; the datatype, operation and communicator
        // handles come from rsmpi. Neither pointer is 1 (MPI_IN_PLACE): `out` is never empty
        // and an empty `rotated` is dangling at f32's alignment.
        unsafe {
            mpi::ffi::MPI_Reduce_scatter(
                rotated.as_ptr().cast(),
                out.as_mut_ptr().cast(),
                counts.as_ptr(),
                f32::equivalent_datatype().as_raw(),
                SystemOperation::sum().as_raw(),
                self.0.as_raw(),
            );
        }
        let mut result = buf.to_vec();
        result[mine.clone()].copy_from_slice(&out[..mine.len()]);
        Ok(result)
    }

    /// `MPI_Allgatherv` of every rank's [`shard`] of `buf`, each at its place.
    pub(crate) fn all_gather_f32(&self, buf: &[f32]) -> Result<Vec<f32>, CommError> {
        let (n, len) = (self.size(), buf.len());
        count(len, "all_gather_f32")?;
        let mut out = buf.to_vec();
        if len == 0 {
            return Ok(out);
        }
        let mut counts = Vec::with_capacity(n);
        let mut displs = Vec::with_capacity(n);
        for q in 0..n {
            let s = shard(len, n, q);
            counts.push(count(s.len(), "all_gather_f32")?);
            displs.push(count(s.start, "all_gather_f32")?);
        }
        let mine = &buf[shard(len, n, self.rank())];
        let mut part = PartitionMut::new(&mut out[..], &counts[..], &displs[..]);
        self.0.all_gather_varcount_into(mine, &mut part);
        Ok(out)
    }

    /// `MPI_Allreduce` of `i64`s; a sum runs on the unsigned bit patterns, so it wraps.
    pub(crate) fn all_reduce_i64(&self, buf: &mut [i64], op: ReduceOp) -> Result<(), CommError> {
        count(buf.len(), "all_reduce_i64")?;
        if op == ReduceOp::Sum {
            let mut words: Vec<u64> = buf.iter().map(|&v| v as u64).collect();
            self.all_reduce_u64(&mut words, op)?;
            for (v, w) in buf.iter_mut().zip(words) {
                *v = w as i64;
            }
            return Ok(());
        }
        let mine = buf.to_vec();
        self.0.all_reduce_into(&mine[..], buf, system_op(op));
        Ok(())
    }

    /// `MPI_Allreduce` of `u64`s.
    pub(crate) fn all_reduce_u64(&self, buf: &mut [u64], op: ReduceOp) -> Result<(), CommError> {
        count(buf.len(), "all_reduce_u64")?;
        let mine = buf.to_vec();
        self.0.all_reduce_into(&mine[..], buf, system_op(op));
        Ok(())
    }

    /// `MPI_Comm_split` (`color` `None`: `MPI_UNDEFINED`).
    pub(crate) fn split(&self, color: Option<i32>, key: i32) -> Option<MpiComm> {
        let color = color.map_or_else(Color::undefined, Color::with_value);
        self.0.split_by_color_with_key(color, key).map(MpiComm)
    }

    /// `MPI_Comm_create_group` of `ranks` (in that order) under `tag`; only they call it.
    pub(crate) fn create_group(&self, ranks: &[usize], tag: i32) -> Result<MpiComm, CommError> {
        let ranks: Vec<i32> = ranks
            .iter()
            .map(|&r| rank_of(r))
            .collect::<Result<_, _>>()?;
        let group = self.0.group().include(&ranks);
        self.0
            .split_by_subgroup_with_tag(&group, tag)
            .map(MpiComm)
            .ok_or_else(|| {
                CommError::InvalidArgument(format!(
                    "group {ranks:?}: MPI_Comm_create_group returned no communicator for a member"
                ))
            })
    }

    /// `MPI_Send` of a point-to-point message (already carrying its Flotilla tag).
    pub(crate) fn send(&self, dest: usize, wire: &[u8]) -> Result<(), CommError> {
        count(wire.len(), "send")?;
        self.0
            .process_at_rank(rank_of(dest)?)
            .send_with_tag(wire, P2P_TAG);
        Ok(())
    }

    /// One waiting point-to-point message, if any (`MPI_Improbe` + `MPI_Mrecv`): the sender's
    /// rank and the bytes.
    pub(crate) fn poll_recv(&self) -> Option<(usize, Vec<u8>)> {
        let probed = self
            .0
            .any_process()
            .immediate_matched_probe_with_tag(P2P_TAG)?;
        let (bytes, status) = probed.matched_receive_vec::<u8>();
        Some((status.source_rank().max(0) as usize, bytes))
    }

    /// The rsmpi communicator (for the raw benchmark).
    pub(crate) fn inner(&self) -> &SimpleCommunicator {
        &self.0
    }
}

fn system_op(op: ReduceOp) -> SystemOperation {
    match op {
        ReduceOp::Sum => SystemOperation::sum(),
        ReduceOp::Max => SystemOperation::max(),
        ReduceOp::Min => SystemOperation::min(),
        ReduceOp::And => SystemOperation::bitwise_and(),
        ReduceOp::Or => SystemOperation::bitwise_or(),
    }
}
