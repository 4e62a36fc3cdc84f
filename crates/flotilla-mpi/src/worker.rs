//! A group's worker thread: runs the group's collectives one at a time, in the order they
//! were issued, whichever thread issued them. That order is the group's collective order
//! (blocking calls and [`flotilla_group::ProcessGroup::all_reduce_start`] alike), and it
//! keeps MPI's rule that one communicator never runs two collectives at once. Different
//! groups' workers run concurrently (hence `MPI_THREAD_MULTIPLE`).

use std::sync::Arc;
use std::sync::mpsc::Receiver;

use flotilla_group::CommError;

use crate::ops;
use crate::state::{GroupState, Job};

/// Starts the worker of `g`, which ends when `g`'s queue is closed and drained.
pub(crate) fn spawn(g: Arc<GroupState>, jobs: Receiver<Job>) -> Result<(), CommError> {
    std::thread::Builder::new()
        .name("flotilla-mpi-group".into())
        .spawn(move || run(&g, &jobs))
        .map(|_| ())
        .map_err(|e| CommError::Config(format!("cannot start an MPI group worker thread: {e}")))
}

fn run(g: &GroupState, jobs: &Receiver<Job>) {
    while let Ok(job) = jobs.recv() {
        let r = match g.rt.poisoned() {
            Some(e) => Err(CommError::Poisoned(Box::new(e))),
            None => ops::execute(&g.comm, job.op, &g.rt.stats),
        };
        if let Err(e) = &r
            && !matches!(e, CommError::Aborted { .. } | CommError::Poisoned(_))
            && g.rt.poison(e)
        {
            tracing::error!(rank = g.rt.world_rank, error = %e, "collective failed");
        }
        // Closed before the caller hears of it: its next look at the activity agrees.
        g.close(job.seq);
        job.done.complete(r);
    }
}
