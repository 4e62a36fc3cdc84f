//! One group's collective queue: each `f32` collective takes the next sequence number when
//! issued and runs on the group's worker thread in that order; a watchdog fails one older
//! than the group's timeout, naming the group, and aborts the communicator
//! (`ncclCommAbort`), so the worker's stuck collective returns and every later one fails.

use std::collections::BTreeMap;
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use flotilla_group::{Activity, CommError, Members, Pending, PendingSender};

use crate::comm::NcclComm;
use crate::ops::{self, Op};

/// What runs a group's collectives: the NCCL communicator ([`NcclComm`]; the queue's own
/// tests give it a stand-in that hangs until aborted).
pub(crate) trait Collectives: Send + Sync + 'static {
    /// Runs `op` as `(rank, size)`; the host buffer with the result.
    fn execute(&self, op: Op, me: (usize, usize)) -> Result<Vec<f32>, String>;
    /// Stops a collective in flight and every later one; whether this call did it.
    fn abort(&self) -> bool;
}

impl Collectives for NcclComm {
    fn execute(&self, op: Op, me: (usize, usize)) -> Result<Vec<f32>, String> {
        ops::execute(self, op, me)
    }

    fn abort(&self) -> bool {
        NcclComm::abort(self)
    }
}

/// How often the watchdog looks at the open collectives.
const WATCH_EVERY: Duration = Duration::from_millis(50);

/// The result of one collective, handed over once (by the worker, or by the watchdog first).
type Done = Arc<Mutex<Option<PendingSender<Vec<f32>>>>>;

fn complete(done: &Done, r: Result<Vec<f32>, CommError>) -> bool {
    let sender = done.lock().unwrap_or_else(|p| p.into_inner()).take();
    sender.map(|s| s.send(r)).is_some()
}

struct Job {
    seq: u64,
    op: Op,
    done: Done,
}

#[derive(Default)]
struct Inner {
    next: u64,
    /// Open collectives: when issued, their name, their completion.
    open: BTreeMap<u64, (Instant, &'static str, Done)>,
    tx: Option<Sender<Job>>,
    /// The first failure; every later collective fails with it.
    failed: Option<CommError>,
}

/// A group's queue, shared by its handle, its worker and its watchdog.
pub(crate) struct Queue {
    pub(crate) comm: Box<dyn Collectives>,
    pub(crate) members: Members,
    pub(crate) timeout: Duration,
    /// The group as errors name it (`world`, or its world ranks).
    pub(crate) name: String,
    inner: Mutex<Inner>,
}

impl Queue {
    /// The queue of a new group, with its worker and watchdog running.
    pub(crate) fn start(
        comm: Box<dyn Collectives>,
        members: Members,
        timeout: Duration,
        name: String,
    ) -> Result<Arc<Queue>, CommError> {
        let (tx, rx) = std::sync::mpsc::channel();
        let q = Arc::new(Queue {
            comm,
            members,
            timeout,
            name,
            inner: Mutex::new(Inner {
                tx: Some(tx),
                ..Inner::default()
            }),
        });
        let worker = q.clone();
        spawn("flotilla-nccl-group", move || worker.work(&rx))?;
        let watched = Arc::downgrade(&q);
        spawn("flotilla-nccl-watchdog", move || watch(&watched))?;
        Ok(q)
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Issues `op`: its place in the group's order is taken now.
    pub(crate) fn submit(&self, op: Op) -> Pending<Vec<f32>> {
        let mut q = self.lock();
        let seq = q.next;
        if let Some(e) = &q.failed {
            return Pending::ready(seq, Err(CommError::Poisoned(Box::new(e.clone()))));
        }
        let (tx, pending) = Pending::channel(seq);
        let done: Done = Arc::new(Mutex::new(Some(tx)));
        let name = op.name();
        let job = Job {
            seq,
            op,
            done: done.clone(),
        };
        if q.tx.as_ref().is_none_or(|tx| tx.send(job).is_err()) {
            complete(&done, Err(CommError::Shutdown));
            return pending;
        }
        q.next += 1;
        q.open.insert(seq, (Instant::now(), name, done));
        pending
    }

    /// Closes the worker's queue: the worker ends after what is queued.
    pub(crate) fn detach(&self) {
        self.lock().tx = None;
    }

    fn work(&self, jobs: &Receiver<Job>) {
        let me = (self.members.me(), self.members.len());
        while let Ok(job) = jobs.recv() {
            let failed = self.lock().failed.clone();
            let name = job.op.name();
            let r = match failed {
                Some(e) => Err(CommError::Poisoned(Box::new(e))),
                None => self
                    .comm
                    .execute(job.op, me)
                    .map_err(|detail| CommError::Protocol {
                        peer: self.members.world_rank(self.members.me()),
                        detail: format!(
                            "NCCL {name} #{} of group {}: {detail}",
                            job.seq, self.name
                        ),
                    }),
            };
            if let Err(e) = &r {
                self.fail(e);
            }
            self.lock().open.remove(&job.seq);
            complete(&job.done, r);
        }
    }

    /// Records the group's first failure, fails every open collective with it, then aborts
    /// the communicator. In that order: the abort makes the collective in flight return
    /// its own error ("aborted"), and the caller must get the cause (the deadline) instead.
    pub(crate) fn fail(&self, e: &CommError) {
        {
            let mut q = self.lock();
            if q.failed.is_some() {
                return;
            }
            q.failed = Some(e.clone());
            for (_, _, done) in q.open.values() {
                complete(done, Err(e.clone()));
            }
        }
        if self.comm.abort() {
            tracing::error!(group = %self.name, error = %e, "NCCL communicator aborted");
        }
    }

    /// Fails the oldest open collective once it is older than the timeout.
    fn check_deadline(&self) {
        let late = {
            let q = self.lock();
            q.open
                .iter()
                .next()
                .filter(|(_, (t, ..))| t.elapsed() >= self.timeout)
                .map(|(&seq, (_, name, _))| (seq, *name))
        };
        if let Some((seq, name)) = late {
            self.fail(&CommError::Deadline {
                waiting_for: self.members.others(),
                op: format!(
                    "NCCL {name} #{seq} of group {} ({} ranks; NCCL does not tell which rank is late)",
                    self.name,
                    self.members.len()
                ),
                after: self.timeout,
            });
        }
    }

    /// Collectives issued and the oldest open one.
    pub(crate) fn activity(&self) -> Activity {
        let q = self.lock();
        Activity {
            issued: q.next,
            oldest_open: q.open.iter().next().map(|(&s, (t, ..))| (s, t.elapsed())),
        }
    }
}

/// The watchdog: runs while the group lives.
fn watch(q: &Weak<Queue>) {
    while let Some(q) = q.upgrade() {
        q.check_deadline();
        drop(q);
        std::thread::sleep(WATCH_EVERY);
    }
}

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> Result<(), CommError> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(f)
        .map(|_| ())
        .map_err(|e| CommError::Config(format!("cannot start the thread {name}: {e}")))
}
