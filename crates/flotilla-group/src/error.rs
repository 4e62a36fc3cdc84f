//! Typed errors of every process group ([`CommError`]), and of the TCP transport's
//! rendezvous ([`RendezvousError`], which a [`CommError`] carries; the MPI backend reports a
//! config hash mismatch with it too).

use std::fmt;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Identifies the process at the other end of a connection in error messages.
///
/// Before the rendezvous has assigned or confirmed a rank only the socket address is known;
/// afterwards both are reported.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerName {
    /// The peer's rank, when known.
    pub rank: Option<usize>,
    /// The peer's socket address as text (may be empty when unknown).
    pub addr: String,
}

impl PeerName {
    /// A peer known by rank and address.
    pub fn ranked(rank: usize, addr: impl Into<String>) -> Self {
        Self {
            rank: Some(rank),
            addr: addr.into(),
        }
    }

    /// A peer known only by its socket address.
    pub fn unranked(addr: impl Into<String>) -> Self {
        Self {
            rank: None,
            addr: addr.into(),
        }
    }
}

impl fmt::Display for PeerName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.rank, self.addr.is_empty()) {
            (Some(r), true) => write!(f, "rank {r}"),
            (Some(r), false) => write!(f, "rank {r} ({})", self.addr),
            (None, _) => write!(f, "unranked process at {}", self.addr),
        }
    }
}

/// `; refused meanwhile: a; b` (the last few, after `N earlier`), or nothing.
fn refused_note(refused: &[String], earlier: usize) -> String {
    const SHOWN: usize = 5;
    if refused.is_empty() {
        return String::new();
    }
    let shown_from = refused.len().saturating_sub(SHOWN);
    let skip = shown_from + earlier;
    let more = if skip > 0 {
        format!("{skip} earlier, then ")
    } else {
        String::new()
    };
    format!(
        "; refused meanwhile: {more}{}",
        refused[shown_from..].join("; ")
    )
}

/// Rank 0's config hash, or what a refused peer is told instead.
fn hash_note(expected: &Option<u64>) -> String {
    match expected {
        Some(h) => format!("{h:#018x}"),
        None => "another one".to_string(),
    }
}

/// Why a rendezvous failed. Rank 0 sends this to the offending rank (and to every other
/// connected rank), so all sides report the same error (but for what only the job may
/// know: [`RendezvousError::redacted`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[non_exhaustive]
pub enum RendezvousError {
    /// The peer's model/training config hash differs from rank 0's.
    #[error(
        "{peer} has config hash {got:#018x} but rank 0 has {}",
        hash_note(expected)
    )]
    ConfigHashMismatch {
        /// The offending peer.
        peer: PeerName,
        /// Rank 0's hash; `None` in what a refused peer is told
        /// ([`RendezvousError::redacted`]).
        expected: Option<u64>,
        /// The peer's hash.
        got: u64,
    },
    /// The authentication handshake failed: the peer does not hold this job's secret (or
    /// this side does not hold the peer's), or spoke no valid handshake.
    #[error("authentication failed: {peer} {reason}")]
    AuthFailed {
        /// The other end of the connection.
        peer: PeerName,
        /// What failed (never the secret or a proof).
        reason: String,
    },
    /// The peer sent no proof of the secret, but this job requires one.
    #[error(
        "{peer} did not authenticate but rank 0 requires this job's secret (set FLOTILLA_SECRET or FLOTILLA_SECRET_FILE)"
    )]
    AuthRequired {
        /// The peer that skipped the handshake.
        peer: PeerName,
    },
    /// The peer started the authentication handshake, but rank 0 has no secret configured.
    #[error(
        "{peer} authenticates with a secret but rank 0 has none configured (set the same FLOTILLA_SECRET or FLOTILLA_SECRET_FILE on every rank)"
    )]
    AuthNotConfigured {
        /// The peer that started the handshake.
        peer: PeerName,
    },
    /// The TLS handshake with the peer failed: its certificate is not signed by this job's
    /// CA or not valid for its address, it refused this side's certificate, or it does not
    /// speak TLS.
    #[error("TLS handshake with {peer} failed: {reason}")]
    TlsFailed {
        /// The other end of the connection.
        peer: PeerName,
        /// What failed.
        reason: String,
    },
    /// The peer did not start TLS, but this job requires it on every connection.
    #[error(
        "{peer} did not start TLS, but this job requires TLS on every connection (set comm.tls or FLOTILLA_TLS_CA, FLOTILLA_TLS_CERT and FLOTILLA_TLS_KEY on every rank; see `flotilla certs`)"
    )]
    TlsRequired {
        /// The peer that spoke plain text.
        peer: PeerName,
    },
    /// The peer started TLS, but this process has no TLS configured.
    #[error(
        "{peer} speaks TLS, but this process has no TLS configured (set the same comm.tls or FLOTILLA_TLS_* settings on every rank)"
    )]
    TlsNotConfigured {
        /// The peer that started a TLS handshake.
        peer: PeerName,
    },
    /// Two processes claimed the same rank.
    #[error("{peer} claims a rank already taken by {holder}")]
    DuplicateRank {
        /// The second claimant.
        peer: PeerName,
        /// Address of the process that claimed the rank first.
        holder: String,
    },
    /// The claimed rank is not below the world size.
    #[error("{peer} is out of range for world size {world_size}")]
    RankOutOfRange {
        /// The offending peer.
        peer: PeerName,
        /// The world size.
        world_size: usize,
    },
    /// The peer was started with a different world size.
    #[error("{peer} has world size {got} but rank 0 has {expected}")]
    WorldSizeMismatch {
        /// The offending peer.
        peer: PeerName,
        /// Rank 0's world size.
        expected: usize,
        /// The peer's world size.
        got: usize,
    },
    /// The peer speaks another rendezvous protocol version.
    #[error("{peer} speaks protocol version {got}, rank 0 speaks {expected}")]
    ProtocolVersion {
        /// The offending peer.
        peer: PeerName,
        /// Rank 0's protocol version.
        expected: u32,
        /// The peer's protocol version.
        got: u32,
    },
    /// Not every rank joined within `join_timeout`.
    #[error(
        "rendezvous timed out after {after:?}: rank(s) {missing} never joined ({present} of {world_size} present){}",
        refused_note(refused, *refused_earlier)
    )]
    JoinTimeout {
        /// The configured join timeout.
        after: Duration,
        /// Comma-separated list of the missing ranks.
        missing: String,
        /// How many processes (including rank 0) were present.
        present: usize,
        /// The world size.
        world_size: usize,
        /// Join requests refused meanwhile (failed authentication, wrong config, world size, a
        /// duplicate rank;
        /// connections that were no Flotilla rank), each with its reason, oldest first: the
        /// last few only.
        refused: Vec<String>,
        /// How many were refused before those of `refused` (not kept, so that a flood of
        /// strangers costs rank 0 no memory).
        #[serde(default)]
        refused_earlier: usize,
    },
    /// Rank 0 gave up on the rendezvous for a reason not tied to the receiving rank.
    #[error("rank 0 aborted the rendezvous: {reason}")]
    MasterFailed {
        /// Rank 0's error.
        reason: String,
    },
    /// A rank could not build its peer connections after the address table was distributed.
    #[error("{peer} failed to build the peer mesh: {reason}")]
    MeshFailed {
        /// The rank that failed.
        peer: PeerName,
        /// Its error.
        reason: String,
    },
    /// An elastic job has fewer ranks than its minimum: it stops (no survivor waits for
    /// ranks that will not come).
    #[error("the job is down to {present} rank(s), fewer than its minimum of {min}; lost: {lost}")]
    BelowMinimum {
        /// The job's minimum number of ranks.
        min: usize,
        /// How many ranks are left.
        present: usize,
        /// The lost processes (their slots and last ranks), oldest first.
        lost: String,
    },
    /// A process of an elastic job came back from a generation the job has left without it
    /// (frozen or cut off past the deadline): it is refused and exits, to be replaced.
    #[error(
        "{peer} is of generation {generation}, but the job went on without it in generation \
         {current} (it was frozen or cut off past the deadline); it exits, to be replaced"
    )]
    StaleGeneration {
        /// The stale process.
        peer: PeerName,
        /// The generation it was last a member of.
        generation: u64,
        /// The job's generation.
        current: u64,
    },
    /// An elastic job finished while this process stood by (its pipeline had no whole
    /// replica with a place for it): nothing is left for it to do, and it ends as the job
    /// did (exit 0 for `flotilla train`).
    #[error(
        "the job finished while this process stood by (no whole replica had a place for it \
         after generation {generation})"
    )]
    StoodBy {
        /// The last generation the job formed.
        generation: u64,
    },
    /// An elastic job already has its maximum number of ranks.
    #[error("{peer} cannot join: the job already has its maximum of {max} ranks")]
    JobFull {
        /// The refused process.
        peer: PeerName,
        /// The job's maximum.
        max: usize,
    },
}

impl RendezvousError {
    /// The error as a refused peer is told it: without what only the job knows (rank 0's
    /// config hash, which would let a stranger learn the job's configuration). Rank 0 logs
    /// the full error itself.
    pub fn redacted(&self) -> RendezvousError {
        match self {
            RendezvousError::ConfigHashMismatch { peer, got, .. } => {
                RendezvousError::ConfigHashMismatch {
                    peer: peer.clone(),
                    expected: None,
                    got: *got,
                }
            }
            other => other.clone(),
        }
    }
}

/// Errors returned by the communication layer.
///
/// Every error caused by a remote process names that process (by rank once known, by
/// address before). The type is `Clone` so that a communicator can remember the failure that
/// made it unusable and report it again on later calls.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum CommError {
    /// The configuration is invalid (or an environment variable could not be parsed).
    #[error("invalid communication config: {0}")]
    Config(String),
    /// A caller passed an invalid argument (e.g. a root rank out of range).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A local socket operation (bind, listen, resolve) failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        #[source]
        source: Arc<io::Error>,
    },
    /// The master (rank 0) could not be reached before the join deadline.
    #[error("could not reach master at {addr} within {after:?}: {last_error}")]
    MasterUnreachable {
        /// The master address.
        addr: String,
        /// The join timeout.
        after: Duration,
        /// The last connection error.
        last_error: String,
    },
    /// A frame with a bad magic, version, channel, flags or payload was received.
    #[error("bad frame from {peer}: {detail}")]
    BadFrame {
        /// The sender.
        peer: PeerName,
        /// What was wrong.
        detail: String,
    },
    /// A frame header announced a payload larger than `max_frame_bytes`.
    #[error("frame from {peer} announces {len} bytes, more than max_frame_bytes = {max}")]
    FrameTooLarge {
        /// The sender.
        peer: PeerName,
        /// The announced length.
        len: u64,
        /// The configured maximum.
        max: usize,
    },
    /// A wait on a peer exceeded the configured timeout.
    #[error("timed out after {after:?} waiting for rank {peer} during {op}")]
    Timeout {
        /// The rank that was waited on.
        peer: usize,
        /// The operation (with its sequence number).
        op: String,
        /// The configured timeout.
        after: Duration,
    },
    /// A receive from several peers reached its deadline with none of them heard from.
    #[error(
        "timed out after {after:?} during {op}: no message from rank(s) {}",
        list(waiting_for)
    )]
    Deadline {
        /// The world ranks still silent.
        waiting_for: Vec<usize>,
        /// The operation.
        op: String,
        /// How long was waited.
        after: Duration,
    },
    /// The connection to a peer closed or failed.
    #[error("connection to rank {peer} lost during {op}: {reason}")]
    PeerLost {
        /// The peer rank.
        peer: usize,
        /// The operation in progress.
        op: String,
        /// Why (EOF, reset, ...).
        reason: String,
    },
    /// A peer sent a frame that does not belong to the current collective: ranks issued
    /// collectives in different orders or with different sizes.
    #[error("protocol error with rank {peer}: {detail}")]
    Protocol {
        /// The peer rank.
        peer: usize,
        /// What was expected and what arrived.
        detail: String,
    },
    /// Another rank failed a collective and told everybody to stop.
    #[error("collective aborted by rank {by}: {reason}")]
    Aborted {
        /// The rank that aborted.
        by: usize,
        /// Its error message.
        reason: String,
    },
    /// Some ranks submitted a tensor (or entered a collective) and others did not for longer
    /// than the stall limit (`stall_shutdown_s`).
    #[error("stalled for {after:?}: {what}")]
    Stalled {
        /// The world ranks that never submitted what the others wait for.
        waiting_for: Vec<usize>,
        /// What waits, for whom (one line per tensor or collective).
        what: String,
        /// How long the oldest of them waited.
        after: Duration,
    },
    /// The rendezvous failed.
    #[error(transparent)]
    Rendezvous(#[from] RendezvousError),
    /// A backend's own setup failed (the TCP transport's TLS files, each error naming the
    /// file): the backend's typed error, kept as the source.
    #[error(transparent)]
    Setup(Arc<dyn std::error::Error + Send + Sync>),
    /// An earlier collective failed; the communicator cannot be used any more.
    #[error("communicator unusable after an earlier failure: {0}")]
    Poisoned(Box<CommError>),
    /// The communicator (or its runtime) was shut down while an operation was pending.
    #[error("communicator shut down")]
    Shutdown,
}

fn list(ranks: &[usize]) -> String {
    ranks
        .iter()
        .map(|r| r.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

impl CommError {
    /// Wraps a local I/O error with context.
    pub fn io(context: impl Into<String>, source: io::Error) -> Self {
        CommError::Io {
            context: context.into(),
            source: Arc::new(source),
        }
    }

    /// The rank this error blames, if any.
    pub fn blamed_rank(&self) -> Option<usize> {
        match self {
            CommError::Timeout { peer, .. }
            | CommError::PeerLost { peer, .. }
            | CommError::Protocol { peer, .. } => Some(*peer),
            CommError::BadFrame { peer, .. } | CommError::FrameTooLarge { peer, .. } => peer.rank,
            CommError::Aborted { by, .. } => Some(*by),
            CommError::Deadline { waiting_for, .. } | CommError::Stalled { waiting_for, .. } => {
                waiting_for.first().copied()
            }
            CommError::Poisoned(inner) => inner.blamed_rank(),
            _ => None,
        }
    }
}
