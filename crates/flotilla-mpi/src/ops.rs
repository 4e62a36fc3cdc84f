//! The collectives a group's worker runs ([`Op`]), what they return ([`Out`]) and running
//! one on a communicator, counting its payload bytes.

use flotilla_group::{CommError, ReduceOp};

use crate::raw::MpiComm;
use crate::stats::Counters;

/// One collective, with the buffers it owns while queued.
pub(crate) enum Op {
    /// `MPI_Barrier`.
    Barrier,
    /// `MPI_Bcast` of `f32`s from a root.
    BroadcastF32(Vec<f32>, usize),
    /// Length and bytes broadcast from a root, at most `max_len` (the last field) bytes.
    BroadcastBytes(Vec<u8>, usize, usize),
    /// Byte strings of every member.
    AllGather(Vec<u8>),
    /// `MPI_Allreduce` (sum) of `f32`s.
    AllReduceF32(Vec<f32>),
    /// `MPI_Reduce_scatter` (sum) of `f32`s into each rank's `flotilla_group::shard`.
    ReduceScatterF32(Vec<f32>),
    /// `MPI_Allgatherv` of each rank's `flotilla_group::shard` of `f32`s.
    AllGatherF32(Vec<f32>),
    /// `MPI_Allreduce` of `i64`s.
    AllReduceI64(Vec<i64>, ReduceOp),
    /// `MPI_Allreduce` of `u64`s.
    AllReduceU64(Vec<u64>, ReduceOp),
    /// `MPI_Comm_split` with MPI color (`None`: undefined) and key.
    Split(Option<i32>, i32),
    /// `MPI_Comm_create_group` of these ranks under this tag.
    CreateGroup(Vec<usize>, i32),
}

impl Op {
    /// The operation's name in errors and logs.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Op::Barrier => "MPI_Barrier",
            Op::BroadcastF32(..) | Op::BroadcastBytes(..) => "MPI_Bcast",
            Op::AllGather(_) | Op::AllGatherF32(_) => "MPI_Allgatherv",
            Op::ReduceScatterF32(_) => "MPI_Reduce_scatter",
            Op::AllReduceF32(_) | Op::AllReduceI64(..) | Op::AllReduceU64(..) => "MPI_Allreduce",
            Op::Split(..) => "MPI_Comm_split",
            Op::CreateGroup(..) => "MPI_Comm_create_group",
        }
    }
}

/// What a collective returns.
pub(crate) enum Out {
    /// Nothing (barrier).
    Unit,
    /// `f32`s (broadcast, all-reduce).
    F32(Vec<f32>),
    /// Bytes (broadcast).
    Bytes(Vec<u8>),
    /// Every member's bytes (all-gather).
    Gathered(Vec<Vec<u8>>),
    /// `i64`s.
    I64(Vec<i64>),
    /// `u64`s.
    U64(Vec<u64>),
    /// A new communicator (`None`: this member joined none).
    Comm(Option<MpiComm>),
}

fn wrong(op: &str) -> CommError {
    CommError::InvalidArgument(format!("internal: {op} returned an unexpected result kind"))
}

impl Out {
    /// The `f32`s of a broadcast or all-reduce.
    pub(crate) fn f32s(self) -> Result<Vec<f32>, CommError> {
        match self {
            Out::F32(v) => Ok(v),
            _ => Err(wrong("f32 collective")),
        }
    }

    /// The bytes of a broadcast.
    pub(crate) fn bytes(self) -> Result<Vec<u8>, CommError> {
        match self {
            Out::Bytes(v) => Ok(v),
            _ => Err(wrong("broadcast_bytes")),
        }
    }

    /// The strings of an all-gather.
    pub(crate) fn gathered(self) -> Result<Vec<Vec<u8>>, CommError> {
        match self {
            Out::Gathered(v) => Ok(v),
            _ => Err(wrong("all_gather_bytes")),
        }
    }

    /// The words of an `i64` reduction.
    pub(crate) fn i64s(self) -> Result<Vec<i64>, CommError> {
        match self {
            Out::I64(v) => Ok(v),
            _ => Err(wrong("all_reduce_i64")),
        }
    }

    /// The words of a `u64` reduction.
    pub(crate) fn u64s(self) -> Result<Vec<u64>, CommError> {
        match self {
            Out::U64(v) => Ok(v),
            _ => Err(wrong("all_reduce_u64")),
        }
    }

    /// The communicator of a split or group creation.
    pub(crate) fn comm(self) -> Result<Option<MpiComm>, CommError> {
        match self {
            Out::Comm(c) => Ok(c),
            _ => Err(wrong("split")),
        }
    }

    /// Nothing (a barrier).
    pub(crate) fn unit(self) -> Result<(), CommError> {
        match self {
            Out::Unit => Ok(()),
            _ => Err(wrong("barrier")),
        }
    }
}

/// Runs `op` on `comm`, adding its payload bytes (what this rank contributed, what it got)
/// to `stats`.
pub(crate) fn execute(comm: &MpiComm, op: Op, stats: &Counters) -> Result<Out, CommError> {
    let (out, sent, received) = match op {
        Op::Barrier => {
            comm.barrier();
            (Out::Unit, 0, 0)
        }
        Op::BroadcastF32(mut v, root) => {
            comm.broadcast_f32(&mut v, root)?;
            let n = 4 * v.len();
            let me = comm.rank() == root;
            (Out::F32(v), if me { n } else { 0 }, if me { 0 } else { n })
        }
        Op::BroadcastBytes(mut v, root, max_len) => {
            comm.broadcast_bytes(&mut v, root, max_len)?;
            let me = comm.rank() == root;
            let n = v.len() + 8;
            (
                Out::Bytes(v),
                if me { n } else { 0 },
                if me { 0 } else { n },
            )
        }
        Op::AllGather(mine) => {
            let all = comm.all_gather_bytes(&mine)?;
            let got = all.iter().map(Vec::len).sum::<usize>() + 4 * all.len();
            (Out::Gathered(all), mine.len() + 4, got)
        }
        Op::AllReduceF32(v) => {
            let n = 4 * v.len();
            (Out::F32(comm.all_reduce_f32(&v)?), n, n)
        }
        Op::ReduceScatterF32(v) => {
            let n = 4 * v.len();
            (Out::F32(comm.reduce_scatter_f32(&v)?), n, n)
        }
        Op::AllGatherF32(v) => {
            let n = 4 * v.len();
            (
                Out::F32(comm.all_gather_f32(&v)?),
                n / comm.size().max(1),
                n,
            )
        }
        Op::AllReduceI64(mut v, op) => {
            comm.all_reduce_i64(&mut v, op)?;
            let n = 8 * v.len();
            (Out::I64(v), n, n)
        }
        Op::AllReduceU64(mut v, op) => {
            comm.all_reduce_u64(&mut v, op)?;
            let n = 8 * v.len();
            (Out::U64(v), n, n)
        }
        Op::Split(color, key) => (Out::Comm(comm.split(color, key)), 0, 0),
        Op::CreateGroup(ranks, tag) => (Out::Comm(Some(comm.create_group(&ranks, tag)?)), 0, 0),
    };
    stats.add_sent(sent as u64);
    stats.add_received(received as u64);
    Ok(out)
}
