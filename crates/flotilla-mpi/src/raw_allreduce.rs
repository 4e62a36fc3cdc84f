//! Open MPI's own all-reduce with nothing of Flotilla's in between ([`RawAllReduce`]):
//! `MPI_Allreduce` (sum of `f32`) called directly on a communicator of its own from the
//! calling thread, with no queue, worker or copy of the backend's — the reference `flotilla
//! bench allreduce --backend mpi` times next to the MPI backend's and the TCP ring's figures.

use flotilla_group::{CommError, ProcessGroup};
use mpi::collective::SystemOperation;
use mpi::traits::*;

use crate::group::MpiGroup;
use crate::raw::{MpiComm, count};

/// Raw `MPI_Allreduce` on a duplicate of `MPI_COMM_WORLD`.
pub struct RawAllReduce {
    comm: MpiComm,
    out: Vec<f32>,
}

impl RawAllReduce {
    /// A communicator of its own, duplicated in `world`'s collective order. Collective over
    /// `world` (every process of the job).
    pub fn new(world: &MpiGroup) -> Result<Self, CommError> {
        world.barrier()?;
        let comm = MpiComm::world_dup();
        if comm.size() != world.size() {
            return Err(CommError::InvalidArgument(format!(
                "raw all-reduce: MPI_COMM_WORLD has {} processes, the group {}",
                comm.size(),
                world.size()
            )));
        }
        Ok(RawAllReduce {
            comm,
            out: Vec::new(),
        })
    }

    /// Sums `buf` over every process, in place. Collective.
    pub fn sum(&mut self, buf: &mut Vec<f32>) -> Result<(), CommError> {
        count(buf.len(), "raw all-reduce")?;
        self.out.resize(buf.len(), 0.0);
        self.comm
            .inner()
            .all_reduce_into(&buf[..], &mut self.out[..], SystemOperation::sum());
        std::mem::swap(buf, &mut self.out);
        Ok(())
    }
}
