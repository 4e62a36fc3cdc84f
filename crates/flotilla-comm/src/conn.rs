//! One established connection to a peer rank: a locked writer and a reader task that
//! demultiplexes incoming frames into one queue per channel.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{Mutex, mpsc, watch};
use tokio::task::JoinHandle;

use crate::buf::{BufPool, PoolBuf};
use crate::config::Compression;
use crate::error::{CommError, PeerName};
use crate::frame::{self, FrameHeader, HEADER_LEN, Op, channel, flags};
use crate::wire::Ctrl;

/// Traffic counters shared by all connections of a communicator.
#[derive(Default)]
pub(crate) struct Stats {
    pub bytes_sent: AtomicU64,
    pub bytes_received: AtomicU64,
    pub frames_sent: AtomicU64,
    pub frames_received: AtomicU64,
}

/// An abort notice from a peer: (rank, reason). Shared by all connections.
pub(crate) type AbortSignal = watch::Sender<Option<(usize, String)>>;

/// A received frame; its payload buffer returns to the connection's pool when dropped.
pub(crate) struct Received {
    pub header: FrameHeader,
    pub payload: PoolBuf,
}

struct Writer {
    half: OwnedWriteHalf,
    /// Set while a frame is being written; still set if a write was cancelled half-way, in
    /// which case the stream is out of sync and must not be used again.
    in_progress: bool,
}

/// Why a connection's reader stopped.
#[derive(Debug, Clone)]
enum Lost {
    /// Socket failure or EOF.
    Io(String),
    /// The peer sent something invalid.
    Invalid(CommError),
}

/// Frames of the collective channel buffered per connection before the reader stops
/// reading (TCP backpressure). Keeps received chunks cache-warm and memory bounded; must
/// exceed [`crate::ring::LOOKAHEAD`] so the ring cannot deadlock.
pub(crate) const COLLECTIVE_QUEUE_FRAMES: usize = 16;
/// Whether the collective queue is bounded (see [`COLLECTIVE_QUEUE_FRAMES`]).
const BOUNDED_COLLECTIVE_QUEUE: bool = false;

/// Sending side of a channel queue.
enum QueueTx {
    Bounded(mpsc::Sender<Received>),
    Unbounded(mpsc::UnboundedSender<Received>),
}

/// Receiving side of a channel queue.
enum QueueRx {
    Bounded(mpsc::Receiver<Received>),
    Unbounded(mpsc::UnboundedReceiver<Received>),
}

impl QueueRx {
    async fn recv(&mut self) -> Option<Received> {
        match self {
            QueueRx::Bounded(rx) => rx.recv().await,
            QueueRx::Unbounded(rx) => rx.recv().await,
        }
    }
}

impl QueueTx {
    /// Queues a frame; `false` when nobody listens any more.
    async fn send(&self, f: Received) -> bool {
        match self {
            QueueTx::Bounded(tx) => tx.send(f).await.is_ok(),
            QueueTx::Unbounded(tx) => tx.send(f).is_ok(),
        }
    }
}

/// Options of a connection.
#[derive(Clone, Copy)]
pub(crate) struct ConnOpts {
    pub max_frame_bytes: usize,
    pub compression: Compression,
}

/// A connection to one peer rank.
pub(crate) struct Conn {
    pub rank: usize,
    writer: Mutex<Writer>,
    queues: Vec<Mutex<QueueRx>>,
    lost: Arc<OnceLock<Lost>>,
    compression: Compression,
    stats: Arc<Stats>,
    reader: JoinHandle<()>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

impl Conn {
    /// Takes over an established stream to `rank` and starts its reader task.
    pub(crate) fn start(
        stream: TcpStream,
        rank: usize,
        opts: ConnOpts,
        stats: Arc<Stats>,
        abort: Arc<AbortSignal>,
    ) -> Arc<Conn> {
        let addr = stream
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_default();
        let name = PeerName::ranked(rank, addr);
        let (rd, wr) = stream.into_split();
        let mut senders = Vec::with_capacity(channel::COUNT);
        let mut queues = Vec::with_capacity(channel::COUNT);
        for ch in 0..channel::COUNT {
            // Control and point-to-point traffic must never stall the reader: unbounded.
            let (tx, rx) = if BOUNDED_COLLECTIVE_QUEUE && ch == channel::COLLECTIVE as usize {
                let (tx, rx) = mpsc::channel(COLLECTIVE_QUEUE_FRAMES);
                (QueueTx::Bounded(tx), QueueRx::Bounded(rx))
            } else {
                let (tx, rx) = mpsc::unbounded_channel();
                (QueueTx::Unbounded(tx), QueueRx::Unbounded(rx))
            };
            senders.push(tx);
            queues.push(Mutex::new(rx));
        }
        let lost = Arc::new(OnceLock::new());
        let reader = tokio::spawn(reader_loop(
            rd,
            name.clone(),
            opts.max_frame_bytes,
            senders,
            lost.clone(),
            stats.clone(),
            abort,
        ));
        Arc::new(Conn {
            rank,
            writer: Mutex::new(Writer {
                half: wr,
                in_progress: false,
            }),
            queues,
            lost,
            compression: opts.compression,
            stats,
            reader,
        })
    }

    /// Sends one frame. Data channels are LZ4-compressed when configured and worthwhile.
    pub(crate) async fn send(
        &self,
        chan: u8,
        op: Op,
        seq: u64,
        tag: u32,
        payload: &[u8],
    ) -> std::io::Result<()> {
        let compressed = match self.compression {
            Compression::Lz4 if chan != channel::CONTROL => frame::compress(payload),
            _ => None,
        };
        let (fl, body) = match &compressed {
            Some(c) => (flags::LZ4, c.as_slice()),
            None => (0, payload),
        };
        let len = u32::try_from(body.len())
            .map_err(|_| std::io::Error::other("frame payload exceeds 4 GiB"))?;
        let header = FrameHeader {
            channel: chan,
            flags: fl,
            op: op as u8,
            seq,
            tag,
            len,
        }
        .encode();
        let mut w = self.writer.lock().await;
        if w.in_progress {
            return Err(std::io::Error::other(
                "an earlier write to this peer was interrupted; stream out of sync",
            ));
        }
        w.in_progress = true;
        frame::write_raw(&mut w.half, &header, body).await?;
        w.in_progress = false;
        self.stats
            .bytes_sent
            .fetch_add((HEADER_LEN + body.len()) as u64, Ordering::Relaxed);
        self.stats.frames_sent.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// The next frame of `chan`, or `None` once the connection is gone and the queue drained.
    pub(crate) async fn recv(&self, chan: u8) -> Option<Received> {
        self.queues[chan as usize].lock().await.recv().await
    }

    /// The error to report when the queue ended while waiting during `op`.
    pub(crate) fn lost_error(&self, op: &str) -> CommError {
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

    /// The error for a failed send during `op`.
    pub(crate) fn send_error(&self, op: &str, e: &std::io::Error) -> CommError {
        match self.lost.get() {
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
        let mut w = self.writer.lock().await;
        let _ = w.half.shutdown().await;
    }
}

async fn reader_loop(
    mut rd: OwnedReadHalf,
    name: PeerName,
    max_frame_bytes: usize,
    senders: Vec<QueueTx>,
    lost: Arc<OnceLock<Lost>>,
    stats: Arc<Stats>,
    abort: Arc<AbortSignal>,
) {
    let pool = BufPool::new(COLLECTIVE_QUEUE_FRAMES + 8);
    let mut scratch = Vec::new();
    let rank = name.rank.unwrap_or(usize::MAX);
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
        stats
            .bytes_received
            .fetch_add((HEADER_LEN + header.len as usize) as u64, Ordering::Relaxed);
        stats.frames_received.fetch_add(1, Ordering::Relaxed);
        if header.channel == channel::CONTROL
            && let Ok(Ctrl::Abort { reason }) = Ctrl::decode(&buf)
        {
            tracing::warn!(peer = %name, %reason, "peer aborted");
            abort.send_if_modified(|slot| {
                if slot.is_none() {
                    *slot = Some((rank, reason));
                    true
                } else {
                    false
                }
            });
            continue;
        }
        // A dropped receiver only means nobody listens on that channel any more.
        let _ = senders[header.channel as usize]
            .send(Received {
                header,
                payload: buf,
            })
            .await;
    };
    tracing::debug!(peer = %name, reason = ?why, "connection reader stopped");
    let _ = lost.set(why);
    // Dropping the senders wakes every waiter with `None`.
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;
    use tokio::net::TcpListener;

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
        }
    }

    #[tokio::test]
    async fn demux_and_compression() {
        let (a, b) = pair().await;
        let abort = Arc::new(watch::channel(None).0);
        let ca = Conn::start(a, 1, opts(), Arc::default(), abort.clone());
        let cb = Conn::start(b, 0, opts(), Arc::default(), abort.clone());
        let big = vec![7u8; 100_000];
        ca.send(channel::P2P, Op::P2p, 0, 1, b"p2p").await.unwrap();
        ca.send(channel::COLLECTIVE, Op::AllReduce, 9, 2, &big)
            .await
            .unwrap();
        let f = cb.recv(channel::COLLECTIVE).await.unwrap();
        assert_eq!(
            (f.header.seq, f.header.tag, &*f.payload == big.as_slice()),
            (9, 2, true)
        );
        assert_eq!(f.header.flags, flags::LZ4);
        assert_eq!(&*cb.recv(channel::P2P).await.unwrap().payload, b"p2p");
        ca.send(
            channel::CONTROL,
            Op::Control,
            0,
            0,
            &Ctrl::Abort {
                reason: "boom".into(),
            }
            .encode(),
        )
        .await
        .unwrap();
        let mut rx = abort.subscribe();
        let got = rx.wait_for(|a| a.is_some()).await.unwrap().clone();
        assert_eq!(got, Some((0, "boom".to_string())));
    }

    #[tokio::test]
    async fn corrupt_frame_is_typed_error_naming_peer() {
        let (mut raw, b) = pair().await;
        let cb = Conn::start(
            b,
            4,
            opts(),
            Arc::default(),
            Arc::new(watch::channel(None).0),
        );
        let mut h = FrameHeader {
            channel: 1,
            flags: 0,
            op: 4,
            seq: 0,
            tag: 0,
            len: 4,
        }
        .encode();
        h[1] = 99; // wrong version
        raw.write_all(&h).await.unwrap();
        assert!(cb.recv(channel::COLLECTIVE).await.is_none());
        let e = cb.lost_error("all_reduce");
        assert!(matches!(e, CommError::BadFrame { .. }), "{e}");
        assert!(e.to_string().contains("rank 4"), "{e}");
        assert!(e.to_string().contains("version 99"), "{e}");
    }

    #[tokio::test]
    async fn oversize_frame_is_typed_error() {
        let (mut raw, b) = pair().await;
        let cb = Conn::start(
            b,
            2,
            opts(),
            Arc::default(),
            Arc::new(watch::channel(None).0),
        );
        let h = FrameHeader {
            channel: 1,
            flags: 0,
            op: 4,
            seq: 0,
            tag: 0,
            len: u32::MAX,
        }
        .encode();
        raw.write_all(&h).await.unwrap();
        assert!(cb.recv(channel::COLLECTIVE).await.is_none());
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
