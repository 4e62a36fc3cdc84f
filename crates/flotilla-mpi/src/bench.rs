//! Open MPI's own all-reduce, timed: `MPI_Allreduce` (sum of `f32`) called directly on a
//! communicator of its own from the calling thread, with no Flotilla queue, worker or copy
//! in between — the reference `flotilla bench allreduce --backend mpi` puts next to the
//! MPI backend's and the TCP ring's figures.

use flotilla_group::bench::{BenchOptions, BenchRow, measure_allreduce};
use flotilla_group::{CommError, ProcessGroup};
use mpi::collective::SystemOperation;
use mpi::traits::*;

use crate::group::MpiGroup;
use crate::raw::{MpiComm, count};

/// Times raw `MPI_Allreduce` with the loop and conventions of
/// [`flotilla_group::bench::run_allreduce`]; `world` (every process of the job) synchronises
/// the iterations and gathers the times. Collective over `world`.
pub fn raw_allreduce(world: &MpiGroup, opts: &BenchOptions) -> Result<Vec<BenchRow>, CommError> {
    // A communicator of its own, duplicated in `world`'s collective order.
    world.barrier()?;
    let comm = MpiComm::world_dup();
    if comm.size() != world.size() {
        return Err(CommError::InvalidArgument(format!(
            "raw bench: MPI_COMM_WORLD has {} processes, the group {}",
            comm.size(),
            world.size()
        )));
    }
    let mut out: Vec<f32> = Vec::new();
    measure_allreduce(world, opts, &mut |buf: &mut Vec<f32>| {
        count(buf.len(), "raw all-reduce")?;
        out.resize(buf.len(), 0.0);
        comm.inner()
            .all_reduce_into(&buf[..], &mut out[..], SystemOperation::sum());
        std::mem::swap(buf, &mut out);
        Ok(())
    })
}
