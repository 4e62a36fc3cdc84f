//! One group's shared state: its communicator, members, mailbox, and the queue that orders
//! its collectives — each takes a sequence number when issued and runs on the group's worker
//! thread in that order ([`crate::worker`]); until it finishes it is *open*, which is what
//! [`flotilla_group::Activity`] reports and what the progress thread's deadline watch scans.

use std::collections::{BTreeMap, HashMap};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use flotilla_group::{Activity, CommError, Members, Pending};

use crate::ops::{Op, Out};
use crate::raw::MpiComm;
use crate::runtime::Runtime;

/// Finishes one collective: hands its result to whoever waits for it.
type Finish = Box<dyn FnOnce(Result<Out, CommError>) + Send>;

/// The completion of one collective, taken once: by the worker when MPI returns, or earlier
/// by the deadline watch or an abort (the worker's late result is then dropped).
pub(crate) struct Completion(Mutex<Option<Finish>>);

impl Completion {
    /// Completes with `r` unless already completed; whether this call did it.
    pub(crate) fn complete(&self, r: Result<Out, CommError>) -> bool {
        let f = self.0.lock().ok().and_then(|mut f| f.take());
        match f {
            Some(f) => {
                f(r);
                true
            }
            None => false,
        }
    }
}

/// A collective on its way to the worker.
pub(crate) struct Job {
    pub(crate) seq: u64,
    pub(crate) op: Op,
    pub(crate) done: Arc<Completion>,
}

/// One open collective.
struct Open {
    issued: Instant,
    name: &'static str,
    done: Arc<Completion>,
}

#[derive(Default)]
struct Queue {
    next: u64,
    open: BTreeMap<u64, Open>,
    /// The worker's queue; `None` once the group handle is gone.
    tx: Option<Sender<Job>>,
}

/// One group's state, shared by its handle, its worker and the progress thread.
pub(crate) struct GroupState {
    pub(crate) rt: &'static Runtime,
    pub(crate) comm: MpiComm,
    /// The world rank of each group rank, and this process's group rank.
    pub(crate) members: Members,
    /// Deadline of a whole collective.
    pub(crate) timeout: Duration,
    /// Point-to-point messages by sender (group rank) and tag, under group key 0.
    pub(crate) mailbox: flotilla_group::Mailbox,
    queue: Mutex<Queue>,
    /// How many groups of each member list were created from this group.
    pub(crate) derived: Mutex<HashMap<Vec<usize>, u64>>,
}

impl GroupState {
    /// A group's state (its worker not yet attached).
    pub(crate) fn new(
        rt: &'static Runtime,
        comm: MpiComm,
        members: Members,
        timeout: Duration,
    ) -> Self {
        let mailbox = flotilla_group::Mailbox::default().naming(members.world_ranks().to_vec());
        Self {
            rt,
            comm,
            members,
            timeout,
            mailbox,
            queue: Mutex::new(Queue::default()),
            derived: Mutex::new(HashMap::new()),
        }
    }

    fn queue(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Connects the worker's queue.
    pub(crate) fn attach(&self, tx: Sender<Job>) {
        self.queue().tx = Some(tx);
    }

    /// Closes the worker's queue: the worker ends after what is queued.
    pub(crate) fn detach(&self) {
        self.queue().tx = None;
    }

    /// Issues `op`: it takes the next sequence number and queues for the worker; `map`
    /// turns its result into the caller's type.
    pub(crate) fn submit<T: Send + 'static>(
        &self,
        op: Op,
        map: fn(Out) -> Result<T, CommError>,
    ) -> Pending<T> {
        let mut q = self.queue();
        let seq = q.next;
        if let Some(e) = self.rt.poisoned() {
            return Pending::ready(seq, Err(CommError::Poisoned(Box::new(e))));
        }
        let (tx, pending) = Pending::channel(seq);
        let done = Arc::new(Completion(Mutex::new(Some(Box::new(
            move |r: Result<Out, CommError>| {
                tx.send(r.and_then(map));
            },
        )))));
        let name = op.name();
        let job = Job {
            seq,
            op,
            done: done.clone(),
        };
        let queued = q.tx.as_ref().is_some_and(|tx| tx.send(job).is_ok());
        if !queued {
            done.complete(Err(CommError::Shutdown));
            return pending;
        }
        q.next += 1;
        self.rt.stats.add_collective();
        let issued = Instant::now();
        q.open.insert(seq, Open { issued, name, done });
        pending
    }

    /// Collective `seq` finished on the worker.
    pub(crate) fn close(&self, seq: u64) {
        self.queue().open.remove(&seq);
    }

    /// Collectives issued and the oldest open one.
    pub(crate) fn activity(&self) -> Activity {
        let q = self.queue();
        Activity {
            issued: q.next,
            oldest_open: q.open.iter().next().map(|(&s, o)| (s, o.issued.elapsed())),
        }
    }

    /// Fails open collectives that must not be waited for any longer: all of them once the
    /// process is poisoned (an abort: with its own error), and each one older than the
    /// group's timeout (which then poisons the process).
    pub(crate) fn watch_deadlines(&self) {
        let q = self.queue();
        for (&seq, open) in &q.open {
            if let Some(e) = self.rt.poisoned() {
                let e = match e {
                    CommError::Aborted { .. } => e,
                    e => CommError::Poisoned(Box::new(e)),
                };
                open.done.complete(Err(e));
                continue;
            }
            if open.issued.elapsed() < self.timeout {
                continue;
            }
            let e = CommError::Deadline {
                waiting_for: self.members.others(),
                op: format!(
                    "{} #{seq} of a group of {} (a blocking MPI collective: MPI does not tell which rank is late)",
                    open.name,
                    self.members.len()
                ),
                after: self.timeout,
            };
            if open.done.complete(Err(e.clone())) {
                tracing::error!(rank = self.rt.world_rank, error = %e, "collective failed");
                self.rt.poison(&e);
            }
        }
    }
}
