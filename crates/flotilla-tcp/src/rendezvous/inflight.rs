//! Connections accepted and not yet through their handshakes (TLS, the secret's, the first
//! message): each read on a task of its own, at most [`InFlight::cap`] at a time. Past the
//! cap the oldest is dropped: a rank of the job gets through its handshakes in a few round
//! trips, so what has waited longest is a silent or slow stranger, and strangers, however
//! many, never hold the door shut for the ranks (nor hold more than the cap's memory).

use std::collections::VecDeque;
use std::net::SocketAddr;

use tokio::task::{AbortHandle, Id, JoinSet};

/// Connections read at once beyond those the listener expects (a job's ranks).
pub(super) const SPARE: usize = 64;

/// The connections being read, oldest first.
pub(super) struct InFlight<T> {
    tasks: JoinSet<T>,
    order: VecDeque<(Id, AbortHandle, SocketAddr)>,
    cap: usize,
}

impl<T: Send + 'static> InFlight<T> {
    /// Room for `expected` connections (the ranks that come to this listener) and
    /// [`SPARE`] more.
    pub(super) fn new(expected: usize) -> Self {
        Self {
            tasks: JoinSet::new(),
            order: VecDeque::new(),
            cap: expected.saturating_add(SPARE),
        }
    }

    /// How many connections may be read at once.
    pub(super) fn cap(&self) -> usize {
        self.cap
    }

    /// Connections being read.
    pub(super) fn len(&self) -> usize {
        self.order.len()
    }

    /// Starts reading the connection from `addr` with `read`; at the cap, first drops the
    /// oldest connection being read and returns its address.
    pub(super) fn start(
        &mut self,
        addr: SocketAddr,
        read: impl Future<Output = T> + Send + 'static,
    ) -> Option<SocketAddr> {
        let dropped = (self.order.len() >= self.cap)
            .then(|| self.order.pop_front())
            .flatten()
            .map(|(_, task, addr)| {
                task.abort();
                addr
            });
        let task = self.tasks.spawn(read);
        self.order.push_back((task.id(), task, addr));
        dropped
    }

    /// The next connection read to its end (`None` while none is being read).
    pub(super) async fn next(&mut self) -> Option<T> {
        loop {
            let done = self.tasks.join_next_with_id().await?;
            let id = match &done {
                Ok((id, _)) => *id,
                Err(e) => e.id(),
            };
            self.order.retain(|(i, _, _)| *i != id);
            // A dropped connection's task ends cancelled: nothing to report.
            if let Ok((_, out)) = done {
                return Some(out);
            }
        }
    }
}
