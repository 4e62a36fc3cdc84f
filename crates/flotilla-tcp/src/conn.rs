//! One established connection to a peer rank: an outbound half (a locked TCP or TLS writer,
//! or an in-memory link straight into the peer's [`Inbound`]) and an inbound half that
//! demultiplexes the peer's frames: collective frames into one queue per process group,
//! point-to-point frames into the process's [`Mailbox`], abort notices into the shared
//! abort signal.
//!
//! What a peer makes this process hold is bounded. Frames of a group this process does not
//! know (yet: a peer may start a new group's traffic before this rank made the group) are
//! taken for at most [`MAX_UNKNOWN_GROUPS`] such groups at a time; a frame of one more
//! closes the connection with an error naming the peer and the group. A group's queue
//! (its collective frames, and in the mailbox its point-to-point messages) holds at most
//! [`Endpoint::max_queued_bytes`] of one peer's bytes: the frame that would pass it fails
//! that group's traffic from the peer with an error naming both, and the peer's later frames
//! of the group are dropped.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, RwLock};

use flotilla_group::{CommError, DEFAULT_MAX_QUEUED_BYTES, MESSAGE_OVERHEAD, Mailbox, PeerName};
use tokio::io::AsyncReadExt;
use tokio::sync::{Mutex, mpsc, watch};
use tokio::task::JoinHandle;

use crate::buf::{BufPool, PoolBuf};
use crate::config::Compression;
use crate::frame::{self, FrameHeader, HEADER_LEN, Op, channel, flags};
use crate::stream::{ReadHalf, Stream, WriteHalf};
use crate::wire::Ctrl;

/// Traffic counters shared by all connections of a communicator.
#[derive(Default)]
pub(crate) struct Stats {
    pub bytes_sent: AtomicU64,
    pub bytes_received: AtomicU64,
    pub frames_sent: AtomicU64,
    pub frames_received: AtomicU64,
    /// Frames written LZ4-compressed (see [`Compression::Lz4`]).
    pub frames_compressed: AtomicU64,
    /// Bytes copied into shared-memory segments (`crate::shm`).
    pub shm_bytes: AtomicU64,
    /// The part of `bytes_sent` written to ranks on another host (by the rendezvous' host
    /// keys): what crosses the network between hosts.
    pub bytes_sent_inter_host: AtomicU64,
}

/// An abort notice from a peer: (rank, reason). Shared by all connections.
pub(crate) type AbortSignal = watch::Sender<Option<(usize, String)>>;

/// A received frame; its payload buffer returns to the connection's pool when dropped.
pub(crate) struct Received {
    pub header: FrameHeader,
    pub payload: PoolBuf,
}

/// The receiving side of one process, shared by all its connections.
pub(crate) struct Endpoint {
    /// Point-to-point messages of every peer.
    pub mailbox: Mailbox,
    /// The first abort notice received from any peer.
    pub abort: AbortSignal,
    /// Traffic counters.
    pub stats: Stats,
    /// The most bytes one peer may have queued here in one group
    /// ([`crate::CommConfig::max_queued_bytes`]).
    pub max_queued_bytes: usize,
    /// The keys of the groups this process made (the world's, 0, from the start).
    groups: RwLock<HashSet<u64>>,
}

impl Default for Endpoint {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_QUEUED_BYTES)
    }
}

impl Endpoint {
    /// An endpoint whose peers may each queue at most `max_queued_bytes` per group.
    pub(crate) fn new(max_queued_bytes: usize) -> Self {
        Self {
            mailbox: Mailbox::with_limit(max_queued_bytes),
            abort: watch::channel(None).0,
            stats: Stats::default(),
            max_queued_bytes,
            groups: RwLock::new(HashSet::from([0])),
        }
    }

    /// Records that this process has the group of `key`: its frames are always taken.
    pub(crate) fn add_group(&self, key: u64) {
        let mut g = self.groups.write().unwrap_or_else(|p| p.into_inner());
        g.insert(key);
    }

    fn knows(&self, key: u64) -> bool {
        let g = self.groups.read().unwrap_or_else(|p| p.into_inner());
        g.contains(&key)
    }
}

/// Why a connection's inbound half stopped.
#[derive(Debug, Clone)]
enum Lost {
    /// Socket failure or EOF (or the in-memory peer went away).
    Io(String),
    /// The peer sent something invalid.
    Invalid(CommError),
}

/// Receive buffers a connection keeps for reuse ([`BufPool`]): the frames a pipelined step
/// has in flight on one link ([`crate::pipe::LOOKAHEAD`], 2, sent ahead of the one being
/// reduced) and one more. Frames beyond these (a broadcast's chain runs ahead) get buffers
/// of their own from the allocator, freed when done; so between collectives a connection
/// holds this many chunk-sized buffers, not as many as its busiest moment needed.
pub(crate) const POOLED_FRAMES: usize = 4;

/// Groups unknown to this process of which one peer may have frames held here at a time.
/// A peer may legitimately start a new group's traffic before this rank made the group (a
/// rank leaves a `split` early, `group` is not collective); a few are enough for that.
pub(crate) const MAX_UNKNOWN_GROUPS: usize = 64;

type Rx = Arc<Mutex<mpsc::UnboundedReceiver<Received>>>;

/// The collective queue of one process group on one connection.
struct Queue {
    /// `None` once the connection is gone or the queue refused (receivers then drain and
    /// see the end).
    tx: Option<mpsc::UnboundedSender<Received>>,
    rx: Rx,
    /// Bytes queued and not yet taken (each frame counted with [`MESSAGE_OVERHEAD`]).
    queued: Arc<AtomicUsize>,
    /// Why the group's frames from the peer are refused (they passed the limit).
    refused: Option<CommError>,
}

#[derive(Default)]
struct Queues {
    by_group: HashMap<u64, Queue>,
    closed: bool,
    /// Groups of the peer's frames this process knew (checked against the endpoint once).
    known: HashSet<u64>,
    /// Groups of the peer's frames this process did not know, at most
    /// [`MAX_UNKNOWN_GROUPS`] (pruned of those it came to know when full).
    unknown: HashSet<u64>,
}

impl Queues {
    fn get(&mut self, group: u64) -> &mut Queue {
        let closed = self.closed;
        self.by_group.entry(group).or_insert_with(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            Queue {
                tx: (!closed).then_some(tx),
                rx: Arc::new(Mutex::new(rx)),
                queued: Arc::default(),
                refused: None,
            }
        })
    }

    /// Whether frames of `group` are taken from the peer: a group this process knows, or
    /// one of at most [`MAX_UNKNOWN_GROUPS`] it does not know yet.
    fn admit(&mut self, ep: &Endpoint, group: u64) -> bool {
        if self.known.contains(&group) {
            return true;
        }
        if ep.knows(group) {
            self.unknown.remove(&group);
            self.known.insert(group);
            return true;
        }
        if self.unknown.contains(&group) {
            return true;
        }
        if self.unknown.len() >= MAX_UNKNOWN_GROUPS {
            let (known, unknown) = self.unknown.drain().partition(|&g| ep.knows(g));
            self.known.extend::<HashSet<u64>>(known);
            self.unknown = unknown;
        }
        self.unknown.len() < MAX_UNKNOWN_GROUPS && self.unknown.insert(group)
    }
}

/// The inbound half of a connection: what one peer sent, demultiplexed.
pub(crate) struct Inbound {
    /// The peer's world rank.
    rank: usize,
    /// `flotilla_bytes_received_total{peer}`.
    received: metrics::Counter,
    queues: std::sync::Mutex<Queues>,
    lost: OnceLock<Lost>,
}

impl Inbound {
    fn new(rank: usize) -> Arc<Self> {
        Arc::new(Self {
            rank,
            received: metrics::counter!("flotilla_bytes_received_total", "peer" => rank.to_string()),
            queues: std::sync::Mutex::new(Queues::default()),
            lost: OnceLock::new(),
        })
    }

    fn queues(&self) -> std::sync::MutexGuard<'_, Queues> {
        self.queues.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Routes one received frame to where it is waited for. Fails (the connection must
    /// close) for a frame of one group too many that this process does not know.
    fn dispatch(
        &self,
        ep: &Endpoint,
        header: FrameHeader,
        payload: PoolBuf,
    ) -> Result<(), CommError> {
        let bytes = (HEADER_LEN + header.len as usize) as u64;
        ep.stats.bytes_received.fetch_add(bytes, Ordering::Relaxed);
        self.received.increment(bytes);
        ep.stats.frames_received.fetch_add(1, Ordering::Relaxed);
        if header.channel == channel::CONTROL {
            if let Ok(Ctrl::Abort { reason }) = Ctrl::decode(&payload) {
                tracing::warn!(peer = self.rank, %reason, "peer aborted");
                ep.abort.send_if_modified(|slot| {
                    let first = slot.is_none();
                    if first {
                        *slot = Some((self.rank, reason));
                    }
                    first
                });
            }
            return Ok(());
        }
        let mut q = self.queues();
        if !q.admit(ep, header.group) {
            return Err(self.unknown_group(header.group));
        }
        if header.channel == channel::P2P {
            drop(q);
            let (group, tag) = (header.group, header.tag);
            if let Err(e) = ep
                .mailbox
                .deliver(group, self.rank, tag, payload.into_vec())
            {
                tracing::debug!(peer = self.rank, error = %e, "point-to-point message refused");
            }
            return Ok(());
        }
        let limit = ep.max_queued_bytes;
        let queue = q.get(header.group);
        let Some(tx) = &queue.tx else {
            return Ok(());
        };
        let cost = payload.len().saturating_add(MESSAGE_OVERHEAD);
        if queue.queued.fetch_add(cost, Ordering::Relaxed) + cost > limit {
            let e = self.overflow(header.group, limit);
            tracing::error!(peer = self.rank, error = %e, "a group's frames refused");
            queue.tx = None;
            queue.refused = Some(e);
            return Ok(());
        }
        // A closed receiver only means nobody listens to that group any more.
        let _ = tx.send(Received { header, payload });
        Ok(())
    }

    /// The error for a frame of a group unknown here, past [`MAX_UNKNOWN_GROUPS`].
    fn unknown_group(&self, group: u64) -> CommError {
        CommError::Protocol {
            peer: self.rank,
            detail: format!(
                "sent a frame of group {group:016x}, which this process does not have, while \
                 frames of {MAX_UNKNOWN_GROUPS} other groups it does not have were held; its \
                 connection is closed"
            ),
        }
    }

    /// The error for collective frames of `group` past the limit.
    fn overflow(&self, group: u64, limit: usize) -> CommError {
        CommError::Protocol {
            peer: self.rank,
            detail: format!(
                "queued more than {limit} bytes of collective frames of group {group:016x} \
                 that no collective here took; its frames of that group are refused (the \
                 limit is CommConfig::max_queued_bytes)"
            ),
        }
    }

    /// Marks the connection gone: waiting receivers drain their queues and then see the end;
    /// the mailbox reports the peer as lost.
    fn close(&self, ep: &Endpoint, why: Lost) {
        let _ = self.lost.set(why);
        {
            let mut q = self.queues();
            q.closed = true;
            for queue in q.by_group.values_mut() {
                queue.tx = None;
            }
        }
        ep.mailbox
            .peer_lost(self.rank, self.lost_error("point-to-point receive"));
    }

    /// The next collective frame of `group`, or `None` once the connection is gone (or the
    /// group's queue refused) and the queue drained.
    async fn recv(&self, group: u64) -> Option<Received> {
        let (rx, queued) = {
            let mut q = self.queues();
            let queue = q.get(group);
            (queue.rx.clone(), queue.queued.clone())
        };
        let mut rx = rx.lock().await;
        let f = rx.recv().await?;
        let cost = f.payload.len().saturating_add(MESSAGE_OVERHEAD);
        queued.fetch_sub(cost, Ordering::Relaxed);
        Some(f)
    }

    /// Why `group`'s queue ended during `op`: its frames refused, or the connection lost.
    fn group_lost_error(&self, group: u64, op: &str) -> CommError {
        let refused = self
            .queues()
            .by_group
            .get(&group)
            .and_then(|q| q.refused.clone());
        refused.unwrap_or_else(|| self.lost_error(op))
    }

    fn lost_error(&self, op: &str) -> CommError {
        match self.lost.get() {
            Some(Lost::Invalid(e)) => e.clone(),
            Some(Lost::Io(reason)) => CommError::PeerLost {
                peer: self.rank,
                op: op.to_string(),
                reason: reason.clone(),
            },
            None => CommError::PeerLost {
                peer: self.rank,
                op: op.to_string(),
                reason: "connection closed".to_string(),
            },
        }
    }
}

struct Writer {
    half: WriteHalf,
    /// Set while a frame is being written; still set if a write was cancelled half-way, in
    /// which case the stream is out of sync and must not be used again.
    in_progress: bool,
}

/// Options of a connection.
#[derive(Clone, Copy)]
pub(crate) struct ConnOpts {
    pub max_frame_bytes: usize,
    pub compression: Compression,
    /// The largest receive buffer kept for reuse: the collectives' chunk
    /// ([`crate::CommConfig::chunk_bytes`]); larger frames' buffers are freed when done.
    pub pooled_frame_bytes: usize,
}

/// How frames leave this process for the peer.
enum Outbound {
    /// A TCP stream (plain or TLS).
    Tcp {
        writer: Mutex<Writer>,
        compression: Compression,
    },
    /// Another communicator in this process: frames are handed to its inbound half.
    Memory {
        peer: Arc<Endpoint>,
        at_peer: Arc<Inbound>,
        pool: Arc<BufPool>,
    },
}

/// A connection to one peer rank.
pub(crate) struct Conn {
    pub rank: usize,
    out: Outbound,
    /// `flotilla_bytes_sent_total{peer}`.
    sent: metrics::Counter,
    /// `flotilla_frames_compressed_total{peer}`.
    compressed: metrics::Counter,
    inbound: Arc<Inbound>,
    ep: Arc<Endpoint>,
    reader: Option<JoinHandle<()>>,
    /// A rejoined rank's link: point-to-point messages only, never collectives.
    p2p_only: bool,
    /// The peer is on another host: what is sent counts in `bytes_sent_inter_host`.
    inter_host: bool,
}

impl Drop for Conn {
    fn drop(&mut self) {
        if let Some(r) = &self.reader {
            r.abort();
        }
        if let Outbound::Memory { peer, at_peer, .. } = &self.out {
            at_peer.close(peer, Lost::Io("connection closed by peer".into()));
        }
    }
}

/// The `flotilla_bytes_sent_total{peer}` counter of the connection to `rank`.
fn sent_counter(rank: usize) -> metrics::Counter {
    metrics::counter!("flotilla_bytes_sent_total", "peer" => rank.to_string())
}

/// The `flotilla_frames_compressed_total{peer}` counter of the connection to `rank`: frames
/// that went out LZ4-compressed.
fn compressed_counter(rank: usize) -> metrics::Counter {
    metrics::counter!("flotilla_frames_compressed_total", "peer" => rank.to_string())
}

impl Conn {
    /// Takes over an established stream (plain TCP or TLS) to `rank` and starts its reader
    /// task (must be called inside the communicator's runtime).
    pub(crate) fn tcp(stream: Stream, rank: usize, opts: ConnOpts, ep: Arc<Endpoint>) -> Conn {
        let addr = stream
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_default();
        let name = PeerName::ranked(rank, addr);
        let (rd, wr) = stream.into_split();
        let inbound = Inbound::new(rank);
        let reader = tokio::spawn(reader_loop(rd, name, opts, inbound.clone(), ep.clone()));
        Conn {
            rank,
            sent: sent_counter(rank),
            compressed: compressed_counter(rank),
            out: Outbound::Tcp {
                writer: Mutex::new(Writer {
                    half: wr,
                    in_progress: false,
                }),
                compression: opts.compression,
            },
            inbound,
            ep,
            reader: Some(reader),
            p2p_only: false,
            inter_host: false,
        }
    }

    /// Marks the connection as a rejoined rank's: collectives refuse it.
    pub(crate) fn for_point_to_point_only(mut self) -> Self {
        self.p2p_only = true;
        self
    }

    /// Marks the connection as one to a rank on another host (`yes`): its bytes count in
    /// [`Stats::bytes_sent_inter_host`].
    pub(crate) fn between_hosts(mut self, yes: bool) -> Self {
        self.inter_host = yes;
        self
    }

    /// Whether collectives refuse this connection.
    pub(crate) fn point_to_point_only(&self) -> bool {
        self.p2p_only
    }

    /// Whether the connection is gone (closed, reset, or a bad frame).
    pub(crate) fn is_lost(&self) -> bool {
        self.inbound.lost.get().is_some()
    }

    /// Two connected in-memory ends: the first is `a`'s connection to `b`, the second
    /// `b`'s connection to `a`; each keeps [`POOLED_FRAMES`] buffers of up to
    /// `pooled_frame_bytes` for the frames it hands over.
    pub(crate) fn memory_pair(
        (a, a_ep): (usize, &Arc<Endpoint>),
        (b, b_ep): (usize, &Arc<Endpoint>),
        pooled_frame_bytes: usize,
    ) -> (Conn, Conn) {
        let (at_a, at_b) = (Inbound::new(b), Inbound::new(a));
        let end = |rank,
                   ep: &Arc<Endpoint>,
                   inbound: &Arc<Inbound>,
                   peer: &Arc<Endpoint>,
                   at_peer: &Arc<Inbound>| Conn {
            rank,
            sent: sent_counter(rank),
            compressed: compressed_counter(rank),
            out: Outbound::Memory {
                peer: peer.clone(),
                at_peer: at_peer.clone(),
                pool: BufPool::new(POOLED_FRAMES, pooled_frame_bytes),
            },
            inbound: inbound.clone(),
            ep: ep.clone(),
            reader: None,
            p2p_only: false,
            inter_host: false,
        };
        (
            end(b, a_ep, &at_a, b_ep, &at_b),
            end(a, b_ep, &at_b, a_ep, &at_a),
        )
    }

    /// Sends one frame. Data channels are LZ4-compressed when configured and worthwhile.
    pub(crate) async fn send(
        &self,
        chan: u8,
        op: Op,
        (group, seq, tag): (u64, u64, u32),
        payload: &[u8],
    ) -> std::io::Result<()> {
        let len = u32::try_from(payload.len())
            .map_err(|_| std::io::Error::other("frame payload exceeds 4 GiB"))?;
        let header = FrameHeader {
            channel: chan,
            flags: 0,
            op: op as u8,
            group,
            seq,
            tag,
            len,
        };
        let sent = match &self.out {
            Outbound::Memory {
                peer,
                at_peer,
                pool,
            } => {
                if at_peer.lost.get().is_some() {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::BrokenPipe,
                        "connection closed",
                    ));
                }
                let mut buf = pool.take();
                buf.vec_mut().extend_from_slice(payload);
                if let Err(e) = at_peer.dispatch(peer, header, buf) {
                    at_peer.close(peer, Lost::Invalid(e));
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::BrokenPipe,
                        "the peer refused a frame and closed the connection",
                    ));
                }
                payload.len()
            }
            Outbound::Tcp {
                writer,
                compression,
            } => {
                self.write_tcp(writer, *compression, header, payload)
                    .await?
            }
        };
        let stats = &self.ep.stats;
        let bytes = (HEADER_LEN + sent) as u64;
        stats.bytes_sent.fetch_add(bytes, Ordering::Relaxed);
        if self.inter_host {
            stats
                .bytes_sent_inter_host
                .fetch_add(bytes, Ordering::Relaxed);
        }
        self.sent.increment(bytes);
        stats.frames_sent.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Writes one frame to a TCP stream, LZ4-compressed when `compression` says so, the
    /// channel carries data and LZ4 makes the payload smaller (counted in
    /// `frames_compressed`). Returns the payload bytes written.
    async fn write_tcp(
        &self,
        writer: &Mutex<Writer>,
        compression: Compression,
        mut header: FrameHeader,
        payload: &[u8],
    ) -> std::io::Result<usize> {
        let compressed = match compression {
            Compression::Lz4 if header.channel != channel::CONTROL => frame::compress(payload),
            _ => None,
        };
        let body = match &compressed {
            Some(c) => {
                header.flags = flags::LZ4;
                header.len = c.len() as u32;
                c.as_slice()
            }
            None => payload,
        };
        let mut w = writer.lock().await;
        if w.in_progress {
            return Err(std::io::Error::other(
                "an earlier write to this peer was interrupted; stream out of sync",
            ));
        }
        w.in_progress = true;
        frame::write_raw(&mut w.half, &header.encode(), body).await?;
        w.half.push().await?;
        w.in_progress = false;
        if compressed.is_some() {
            let frames = &self.ep.stats.frames_compressed;
            frames.fetch_add(1, Ordering::Relaxed);
            self.compressed.increment(1);
        }
        Ok(body.len())
    }

    /// The next collective frame of `group`, or `None` once the connection is gone and the
    /// queue drained.
    pub(crate) async fn recv(&self, group: u64) -> Option<Received> {
        self.inbound.recv(group).await
    }

    /// The error to report when the queue ended while waiting during `op`.
    pub(crate) fn lost_error(&self, op: &str) -> CommError {
        self.inbound.lost_error(op)
    }

    /// The error to report when `group`'s queue ended while waiting during `op`: the
    /// group's frames were refused, or the connection is lost.
    pub(crate) fn group_lost_error(&self, group: u64, op: &str) -> CommError {
        self.inbound.group_lost_error(group, op)
    }

    /// The error for a failed send during `op`.
    pub(crate) fn send_error(&self, op: &str, e: &std::io::Error) -> CommError {
        match self.inbound.lost.get() {
            Some(Lost::Invalid(inner)) => inner.clone(),
            _ => CommError::PeerLost {
                peer: self.rank,
                op: op.to_string(),
                reason: frame::describe_io(e),
            },
        }
    }

    /// Closes the sending side (the peer sees EOF after all queued data).
    pub(crate) async fn shutdown(&self) {
        use tokio::io::AsyncWriteExt;
        match &self.out {
            Outbound::Tcp { writer, .. } => {
                let mut w = writer.lock().await;
                let _ = w.half.shutdown().await;
            }
            Outbound::Memory { peer, at_peer, .. } => {
                at_peer.close(peer, Lost::Io("connection closed by peer".into()));
            }
        }
    }
}

async fn reader_loop(
    mut rd: ReadHalf,
    name: PeerName,
    opts: ConnOpts,
    inbound: Arc<Inbound>,
    ep: Arc<Endpoint>,
) {
    let max_frame_bytes = opts.max_frame_bytes;
    let pool = BufPool::new(POOLED_FRAMES, opts.pooled_frame_bytes);
    let mut scratch = Vec::new();
    let why = loop {
        let mut hb = [0u8; HEADER_LEN];
        if let Err(e) = rd.read_exact(&mut hb).await {
            break Lost::Io(frame::describe_io(&e));
        }
        let header = match FrameHeader::decode(&hb, max_frame_bytes, &name) {
            Ok(h) => h,
            Err(e) => break Lost::Invalid(e),
        };
        let mut buf = pool.take();
        match frame::read_payload(
            &mut rd,
            &header,
            buf.vec_mut(),
            &mut scratch,
            max_frame_bytes,
            &name,
        )
        .await
        {
            Err(e) => break Lost::Io(frame::describe_io(&e)),
            Ok(Err(e)) => break Lost::Invalid(e),
            Ok(Ok(())) => {}
        }
        if scratch.capacity() > opts.pooled_frame_bytes {
            // A compressed frame larger than the chunk: its staging is not kept either.
            scratch = Vec::new();
        }
        if let Err(e) = inbound.dispatch(&ep, header, buf) {
            break Lost::Invalid(e);
        }
    };
    tracing::debug!(peer = %name, reason = ?why, "connection reader stopped");
    inbound.close(&ep, why);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};
    use tokio::io::AsyncWriteExt;
    use tokio::net::{TcpListener, TcpStream};

    use flotilla_group::Taken;

    async fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (b, _) = l.accept().await.unwrap();
        (a, b)
    }

    fn opts() -> ConnOpts {
        ConnOpts {
            max_frame_bytes: 1 << 20,
            compression: Compression::Lz4,
            pooled_frame_bytes: 64 << 10,
        }
    }

    fn take_p2p(ep: &Endpoint, from: usize, tag: u32) -> Vec<u8> {
        match ep
            .mailbox
            .take(0, &[from], tag, Instant::now() + Duration::from_secs(5))
        {
            Some(Taken::Message(_, m)) => m,
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn demux_and_compression() {
        let (a, b) = pair().await;
        let (ea, eb) = (Arc::new(Endpoint::default()), Arc::new(Endpoint::default()));
        let ca = Conn::tcp(Stream::Plain(a), 1, opts(), ea.clone());
        let _cb = Conn::tcp(Stream::Plain(b), 0, opts(), eb.clone());
        let big = vec![7u8; 100_000];
        ca.send(channel::P2P, Op::P2p, (0, 0, 1), b"p2p")
            .await
            .unwrap();
        ca.send(channel::COLLECTIVE, Op::AllReduce, (0, 9, 2), &big)
            .await
            .unwrap();
        ca.send(channel::COLLECTIVE, Op::AllReduce, (5, 1, 0), b"g5")
            .await
            .unwrap();
        // The group-5 frame waits in its own queue; group 0 sees only its frame.
        let f = _cb.recv(0).await.unwrap();
        assert_eq!(
            (f.header.seq, f.header.tag, &*f.payload == big.as_slice()),
            (9, 2, true)
        );
        assert_eq!(f.header.flags, flags::LZ4);
        // Only the large data frame was worth compressing.
        assert_eq!(ea.stats.frames_compressed.load(Ordering::Relaxed), 1);
        assert_eq!(&*_cb.recv(5).await.unwrap().payload, b"g5");
        let eb2 = eb.clone();
        let got = tokio::task::spawn_blocking(move || take_p2p(&eb2, 0, 1))
            .await
            .unwrap();
        assert_eq!(got, b"p2p");
        ca.send(
            channel::CONTROL,
            Op::Control,
            (0, 0, 0),
            &Ctrl::Abort {
                reason: "boom".into(),
            }
            .encode(),
        )
        .await
        .unwrap();
        let mut rx = eb.abort.subscribe();
        let got = rx.wait_for(|a| a.is_some()).await.unwrap().clone();
        assert_eq!(got, Some((0, "boom".to_string())));
    }

    #[tokio::test]
    async fn memory_pair_delivers_and_reports_loss() {
        let (ea, eb) = (Arc::new(Endpoint::default()), Arc::new(Endpoint::default()));
        let (ab, ba) = Conn::memory_pair((0, &ea), (1, &eb), 64 << 10);
        ab.send(channel::COLLECTIVE, Op::AllReduce, (0, 3, 4), b"hi")
            .await
            .unwrap();
        let f = ba.recv(0).await.unwrap();
        assert_eq!(
            (f.header.seq, f.header.tag, &*f.payload),
            (3, 4, &b"hi"[..])
        );
        drop(ab);
        assert!(ba.recv(0).await.is_none());
        assert!(ba.lost_error("x").to_string().contains("rank 0"));
        assert!(matches!(
            eb.mailbox.take(0, &[0], 0, Instant::now()),
            Some(Taken::Lost(_))
        ));
    }

    #[tokio::test]
    async fn corrupt_frame_is_typed_error_naming_peer() {
        let (mut raw, b) = pair().await;
        let cb = Conn::tcp(Stream::Plain(b), 4, opts(), Arc::default());
        let mut h = FrameHeader {
            channel: 1,
            flags: 0,
            op: 4,
            group: 0,
            seq: 0,
            tag: 0,
            len: 4,
        }
        .encode();
        h[1] = 99; // wrong version
        raw.write_all(&h).await.unwrap();
        assert!(cb.recv(0).await.is_none());
        let e = cb.lost_error("all_reduce");
        assert!(matches!(e, CommError::BadFrame { .. }), "{e}");
        assert!(e.to_string().contains("rank 4"), "{e}");
        assert!(e.to_string().contains("version 99"), "{e}");
    }

    #[tokio::test]
    async fn oversize_frame_is_typed_error() {
        let (mut raw, b) = pair().await;
        let cb = Conn::tcp(Stream::Plain(b), 2, opts(), Arc::default());
        let h = FrameHeader {
            channel: 1,
            flags: 0,
            op: 4,
            group: 0,
            seq: 0,
            tag: 0,
            len: u32::MAX,
        }
        .encode();
        raw.write_all(&h).await.unwrap();
        assert!(cb.recv(0).await.is_none());
        let e = cb.lost_error("all_reduce");
        assert!(
            matches!(
                e,
                CommError::FrameTooLarge {
                    len: 4294967295,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("rank 2"), "{e}");
    }
}
