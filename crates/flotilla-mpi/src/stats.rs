//! The process's traffic counters (payload bytes and MPI calls; see
//! [`crate::MpiGroup`]'s `stats`).

use std::sync::atomic::{AtomicU64, Ordering};

use flotilla_group::CommStats;

/// Traffic counters of the process (payload bytes; see [`crate::MpiGroup`]'s `stats`).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    bytes_sent: AtomicU64,
    bytes_received: AtomicU64,
    frames_sent: AtomicU64,
    frames_received: AtomicU64,
    collectives: AtomicU64,
}

impl Counters {
    /// One collective call (or message) sending `n` payload bytes.
    pub(crate) fn add_sent(&self, n: u64) {
        self.bytes_sent.fetch_add(n, Ordering::Relaxed);
        self.frames_sent.fetch_add(1, Ordering::Relaxed);
    }

    /// One collective call (or message) receiving `n` payload bytes.
    pub(crate) fn add_received(&self, n: u64) {
        self.bytes_received.fetch_add(n, Ordering::Relaxed);
        self.frames_received.fetch_add(1, Ordering::Relaxed);
    }

    /// One collective issued.
    pub(crate) fn add_collective(&self) {
        self.collectives.fetch_add(1, Ordering::Relaxed);
    }

    /// The counters as the trait reports them.
    pub(crate) fn snapshot(&self) -> CommStats {
        CommStats {
            bytes_sent: self.bytes_sent.load(Ordering::Relaxed),
            bytes_received: self.bytes_received.load(Ordering::Relaxed),
            frames_sent: self.frames_sent.load(Ordering::Relaxed),
            frames_received: self.frames_received.load(Ordering::Relaxed),
            // MPI moves payloads as they are: nothing is ever compressed.
            frames_compressed: 0,
            collectives: self.collectives.load(Ordering::Relaxed),
            // MPI's own shared memory is not Flotilla's segment.
            shm_bytes: 0,
            bytes_sent_inter_host: 0,
        }
    }
}
