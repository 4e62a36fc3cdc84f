//! The process-group interface every strategy talks to.
//!
//! A [`ProcessGroup`] is a set of ranks that run collectives together and exchange tagged
//! point-to-point messages. The TCP `flotilla_tcp::TcpGroup` implements it over real
//! connections (or over in-memory links between threads, for unit tests:
//! `flotilla_tcp::TcpGroup::in_memory`); `flotilla_mpi::MpiGroup` implements it over MPI. Strategies
//! and servers hold an `Arc<dyn ProcessGroup>` and never see the transport.
//!
//! # Ranks
//!
//! Ranks passed to and returned by a group's methods are ranks *in that group*
//! (`0..size()`). Errors name the world rank of the process at fault (what logs and
//! launchers show); [`ProcessGroup::world_rank`] and [`ProcessGroup::group_rank`] convert.
//!
//! # Ordering
//!
//! Within one group, every member must issue the same collectives in the same order with
//! matching sizes and roots (blocking and non-blocking alike; a non-blocking one takes its
//! place in the order when it is started). Each group has its own sequence space and its own
//! queues on the shared connections, so collectives of different groups never wait on each
//! other. Point-to-point messages are outside collective ordering; messages with the same
//! (group, sender, tag) arrive in the order they were sent, and different tags never mix.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::CommError;
use crate::mailbox::Taken;
use crate::members;
use crate::pending::PendingAllReduce;
use crate::subgroup::{self, SplitPlan};

/// Traffic counters of a communicator (all connections, all channels, headers included).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommStats {
    /// Bytes written to sockets.
    pub bytes_sent: u64,
    /// Bytes read from sockets.
    pub bytes_received: u64,
    /// Frames written.
    pub frames_sent: u64,
    /// Frames read.
    pub frames_received: u64,
    /// Frames written LZ4-compressed (`flotilla_tcp::Compression::Lz4`: data frames of at
    /// least `flotilla_tcp::frame::MIN_COMPRESS_BYTES` that LZ4 made smaller); 0 without
    /// compression.
    pub frames_compressed: u64,
    /// Collectives issued so far in all groups (blocking and asynchronous).
    pub collectives: u64,
    /// Bytes this rank copied into shared-memory segments (`flotilla_tcp`'s transport
    /// between ranks of one host; 0 for other backends).
    pub shm_bytes: u64,
    /// The part of `bytes_sent` written to ranks on another host (`flotilla_tcp`, by the
    /// rendezvous' host keys): the traffic that crosses the network. 0 for other backends.
    pub bytes_sent_inter_host: u64,
}

/// Element-wise reduction of integer buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Wrapping sum.
    Sum,
    /// Maximum.
    Max,
    /// Minimum.
    Min,
    /// Bitwise AND (e.g. "ready on every rank" bit sets).
    And,
    /// Bitwise OR (e.g. "ready on some rank" bit sets).
    Or,
}

impl ReduceOp {
    /// Combines two `i64`s.
    pub fn apply_i64(self, a: i64, b: i64) -> i64 {
        match self {
            ReduceOp::Sum => a.wrapping_add(b),
            ReduceOp::Max => a.max(b),
            ReduceOp::Min => a.min(b),
            ReduceOp::And => a & b,
            ReduceOp::Or => a | b,
        }
    }

    /// Combines two `u64`s.
    pub fn apply_u64(self, a: u64, b: u64) -> u64 {
        match self {
            ReduceOp::Sum => a.wrapping_add(b),
            ReduceOp::Max => a.max(b),
            ReduceOp::Min => a.min(b),
            ReduceOp::And => a & b,
            ReduceOp::Or => a | b,
        }
    }
}

/// What a rank is doing in a group's collective sequence (for the stall inspector).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Activity {
    /// Collectives this rank has issued in the group (its next sequence number).
    pub issued: u64,
    /// The oldest collective it issued that has not finished: sequence number and age.
    pub oldest_open: Option<(u64, Duration)>,
}

/// A tag of a point-to-point message. Tags at and above [`tags::RESERVED`] are Flotilla's own.
pub type Tag = u32;

/// Tag constants.
pub mod tags {
    /// First tag reserved for Flotilla's internal protocols (servers, pipelines).
    pub const RESERVED: u32 = 0xFFFF_0000;
}

/// The largest piece of a [`ProcessGroup::send_large`] message: 8 MiB, well under any frame
/// limit worth setting, and few enough pieces that a model's shard is a handful of sends.
pub const LARGE_MESSAGE_PIECE: usize = 8 << 20;

/// A group of ranks: collectives, tagged point-to-point messages and sub-groups.
///
/// A backend implements the required methods (among them the backend's parts of two
/// provided ones: [`ProcessGroup::take_from_mailbox`] behind `recv_any`,
/// [`ProcessGroup::subgroup_from`] behind `split`) and gets the rest, written once here.
///
/// Blocking methods must not be called from inside an async runtime. Every wait on another
/// rank has a deadline (the group's [`ProcessGroup::timeout`] for collectives, the caller's
/// for receives) and a failure names the rank at fault.
pub trait ProcessGroup: Send + Sync + std::fmt::Debug {
    /// This process's rank in the group.
    fn rank(&self) -> usize;

    /// Number of ranks in the group.
    fn size(&self) -> usize;

    /// The world rank of group rank `rank`.
    fn world_rank(&self, rank: usize) -> usize;

    /// The group rank of world rank `world_rank`, if it is a member.
    fn group_rank(&self, world_rank: usize) -> Option<usize>;

    /// Deadline of every wait inside a collective.
    fn timeout(&self) -> Duration;

    /// Traffic counters of the process (all groups share the connections).
    fn stats(&self) -> CommStats;

    /// Returns once every member has entered the barrier.
    fn barrier(&self) -> Result<(), CommError>;

    /// Copies `root`'s buffer into every member's `buf` (all pass the same length).
    fn broadcast_f32(&self, buf: &mut [f32], root: usize) -> Result<(), CommError>;

    /// Replaces every member's `buf` with `root`'s bytes (lengths may differ before).
    ///
    /// `max_len` is the caller's bound on the length (every member passes the same): a
    /// broadcast of more bytes fails on every member with an error naming the root, before
    /// a byte of it is allocated, so a peer's word never makes this process allocate more
    /// than the caller allows. Non-root members grow `buf` as the bytes arrive (never
    /// beyond the root's length), not ahead of them.
    fn broadcast_bytes(
        &self,
        buf: &mut Vec<u8>,
        root: usize,
        max_len: usize,
    ) -> Result<(), CommError>;

    /// Gathers one byte string from every member; element `i` is rank `i`'s.
    fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, CommError>;

    /// Sums `buf` element-wise over the group in place (the TCP backend: recursive doubling
    /// for small buffers, Rabenseifner's halving and doubling for middle sizes, ring
    /// reduce-scatter + all-gather above; bf16 on the wire when so configured). All members
    /// end bit-identical.
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), CommError>;

    /// Starts [`ProcessGroup::all_reduce_sum`] in the background and returns at once.
    fn all_reduce_start(&self, buf: Vec<f32>) -> PendingAllReduce;

    /// [`ProcessGroup::all_reduce_start`] of gradient bucket `bucket`: the same collective,
    /// labelled with the bucket in the timeline.
    fn all_reduce_bucket(&self, buf: Vec<f32>, bucket: usize) -> PendingAllReduce {
        let _ = bucket;
        self.all_reduce_start(buf)
    }

    /// Sums `buf` element-wise over the group, leaving this rank's shard of the sum in
    /// `buf[`[`crate::shard`](crate::shard())`(buf.len(), size, rank)]` (the rest of `buf`
    /// is unspecified): the first half of a ring all-reduce. The TCP backend sums each value in
    /// the order its ring all-reduce does (bitwise its result there, bf16 rounding included);
    /// MPI (`MPI_Reduce_scatter`) in MPI's order.
    fn reduce_scatter_sum_f32(&self, buf: &mut [f32]) -> Result<(), CommError>;

    /// [`ProcessGroup::reduce_scatter_sum_f32`] of gradient bucket `bucket`, started in the
    /// background (its place in the group's order taken now); the result is the whole
    /// buffer, of which this rank's shard holds the sum.
    fn reduce_scatter_bucket(&self, buf: Vec<f32>, bucket: usize) -> PendingAllReduce;

    /// Fills `buf` with every rank's shard: each member passes its own values in its
    /// [`crate::shard`](crate::shard()) of `buf` (the rest is overwritten), and all end with
    /// the same buffer, bit for bit. The second half of a ring all-reduce.
    fn all_gather_f32(&self, buf: &mut [f32]) -> Result<(), CommError>;

    /// [`ProcessGroup::all_gather_f32`] of bucket `bucket` (ZeRO-3's parameters), started in
    /// the background (its place in the group's order taken now): what a rank computes
    /// meanwhile overlaps it. The result is the gathered buffer.
    fn all_gather_bucket(&self, buf: Vec<f32>, bucket: usize) -> PendingAllReduce;

    /// Reduces small integer buffers element-wise (counters, flags, bit sets), combining in
    /// rank order so every member gets the same result.
    fn all_reduce_i64(&self, buf: &mut [i64], op: ReduceOp) -> Result<(), CommError>;

    /// Like [`ProcessGroup::all_reduce_i64`] for `u64` words (bit sets with AND / OR).
    fn all_reduce_u64(&self, buf: &mut [u64], op: ReduceOp) -> Result<(), CommError>;

    /// Sends `msg` to `peer` under `tag` (outside collective ordering).
    fn send(&self, peer: usize, tag: Tag, msg: &[u8]) -> Result<(), CommError>;

    /// Receives the next message with `tag` from `peer`, waiting until `deadline`.
    fn recv(&self, peer: usize, tag: Tag, deadline: Instant) -> Result<Vec<u8>, CommError> {
        self.recv_any(&[peer], tag, deadline).map(|(_, m)| m)
    }

    /// Sends `msg` of any length to `peer` under `tag` as [`ProcessGroup::send`] does, in
    /// pieces of at most [`LARGE_MESSAGE_PIECE`] bytes after one giving its length (a
    /// frame is at most `max_frame_bytes`, 64 MiB by default; a ZeRO rank's optimizer
    /// shard of a large model is more). Take it with [`ProcessGroup::recv_large`].
    fn send_large(&self, peer: usize, tag: Tag, msg: &[u8]) -> Result<(), CommError> {
        self.send(peer, tag, &(msg.len() as u64).to_le_bytes())?;
        for piece in msg.chunks(LARGE_MESSAGE_PIECE) {
            self.send(peer, tag, piece)?;
        }
        Ok(())
    }

    /// [`ProcessGroup::send_large`] of the `len` bytes `from` reads (a file), read one piece
    /// at a time: the message is never whole in memory. Fewer than `len` bytes is an error.
    fn send_large_from(
        &self,
        peer: usize,
        tag: Tag,
        from: &mut dyn std::io::Read,
        len: u64,
    ) -> Result<(), CommError> {
        self.send(peer, tag, &len.to_le_bytes())?;
        // Pieces of a file are smaller than a buffer's: a file is sent because its bytes are
        // too many to hold, so the sender holds one small piece and the receiver one or two.
        const FILE_PIECE: u64 = 1 << 20;
        let mut piece = vec![0u8; usize::try_from(len.min(FILE_PIECE)).unwrap_or(0)];
        let mut left = len;
        while left > 0 {
            let n = usize::try_from(left.min(FILE_PIECE)).unwrap_or(piece.len());
            from.read_exact(&mut piece[..n]).map_err(|e| {
                CommError::io(format!("reading a message of {len} bytes to send"), e)
            })?;
            self.send(peer, tag, &piece[..n])?;
            left -= n as u64;
        }
        Ok(())
    }

    /// Receives a message of [`ProcessGroup::send_large`] from `peer` under `tag`, every
    /// piece by `deadline`.
    fn recv_large(&self, peer: usize, tag: Tag, deadline: Instant) -> Result<Vec<u8>, CommError> {
        let mut msg = Vec::new();
        self.recv_large_with(peer, tag, deadline, &mut |piece| {
            msg.extend_from_slice(piece);
            Ok(())
        })?;
        Ok(msg)
    }

    /// [`ProcessGroup::recv_large`] that hands each piece to `sink` as it arrives (a file
    /// written as the message comes), instead of putting the message together in memory.
    fn recv_large_with(
        &self,
        peer: usize,
        tag: Tag,
        deadline: Instant,
        sink: &mut dyn FnMut(&[u8]) -> Result<(), CommError>,
    ) -> Result<(), CommError> {
        let head = self.recv(peer, tag, deadline)?;
        let len = <[u8; 8]>::try_from(head.as_slice())
            .map(u64::from_le_bytes)
            .map_err(|_| CommError::Protocol {
                peer,
                detail: format!(
                    "a large message began with {} bytes, not its length",
                    head.len()
                ),
            })?;
        let len = usize::try_from(len).map_err(|_| CommError::Protocol {
            peer,
            detail: format!("a large message of {len} bytes"),
        })?;
        let mut got = 0;
        while got < len {
            let piece = self.recv(peer, tag, deadline)?;
            if piece.is_empty() || got + piece.len() > len {
                return Err(CommError::Protocol {
                    peer,
                    detail: format!(
                        "a large message of {len} bytes: a piece of {} after {got}",
                        piece.len()
                    ),
                });
            }
            sink(&piece)?;
            got += piece.len();
        }
        Ok(())
    }

    /// Receives the earliest-arrived message with `tag` from any of `peers`; returns the
    /// sender (group rank) and the message. A peer whose connection is gone (and has nothing
    /// queued) is a [`CommError::PeerLost`] naming it; at the deadline, a
    /// [`CommError::Deadline`] names every peer still silent.
    fn recv_any(
        &self,
        peers: &[usize],
        tag: Tag,
        deadline: Instant,
    ) -> Result<(usize, Vec<u8>), CommError> {
        let started = Instant::now();
        let size = self.size();
        let world: Vec<usize> = peers
            .iter()
            .map(|&p| {
                if p < size {
                    Ok(self.world_rank(p))
                } else {
                    Err(members::out_of_range("peer", p, size))
                }
            })
            .collect::<Result<_, _>>()?;
        match self.take_from_mailbox(peers, tag, deadline) {
            Some(Taken::Message(i, m)) => Ok((peers[i], m)),
            Some(Taken::Lost(e)) => Err(e),
            None => Err(CommError::Deadline {
                waiting_for: world,
                op: format!("receive (tag {tag})"),
                after: deadline.saturating_duration_since(started),
            }),
        }
    }

    /// The backend's part of [`ProcessGroup::recv_any`] (call that instead): takes the
    /// earliest-arrived message with `tag` from any of `peers` (group ranks, already checked)
    /// out of this group's [`crate::Mailbox`], or the error of a sender that is gone and has
    /// nothing queued, waiting until `deadline`; `None` when the deadline passed.
    fn take_from_mailbox(&self, peers: &[usize], tag: Tag, deadline: Instant) -> Option<Taken>;

    /// Splits the group (collectively, like `MPI_Comm_split`): members passing the same
    /// `color` form a new group, ordered by `(key, rank)`; `None` joins no group.
    fn split(
        &self,
        color: Option<u32>,
        key: i64,
    ) -> Result<Option<Arc<dyn ProcessGroup>>, CommError> {
        let all = self.all_gather_bytes(&subgroup::encode(color, key))?;
        let plan = subgroup::plan(&all, self.rank(), |r| self.world_rank(r))?;
        self.subgroup_from(&plan)
    }

    /// The backend's part of [`ProcessGroup::split`] (call that instead): this member's new
    /// group from `plan`, which every member derived from the same all-gather. Every member
    /// calls it, those joining no group (`plan.color` is `None`) too, so it may be
    /// collective (`MPI_Comm_split`) and may count splits alike on every member.
    fn subgroup_from(&self, plan: &SplitPlan) -> Result<Option<Arc<dyn ProcessGroup>>, CommError>;

    /// The sub-group of `ranks` (group ranks, in the new group's order); only the members
    /// call it, in the same order relative to their other `group` calls with these ranks.
    fn group(&self, ranks: &[usize]) -> Result<Arc<dyn ProcessGroup>, CommError>;

    /// How many times group rank `rank` rejoined the running job after its connection was
    /// lost (a replaced worker; see `flotilla_tcp::Rejoin`): a receiver that gave the
    /// rank up listens to it again when this grows. The default: ranks never rejoin.
    fn rejoins(&self, rank: usize) -> u64 {
        let _ = rank;
        0
    }

    /// This rank's place in the group's collective sequence (the default knows nothing).
    fn activity(&self) -> Activity {
        Activity::default()
    }

    /// Makes this process's collectives in progress and later ones fail with
    /// [`CommError::Aborted`] carrying `reason` (the stall inspector's abort; every rank
    /// decides it in the same round). The default does nothing.
    fn abort(&self, reason: &str) {
        let _ = reason;
    }

    /// Gathers one `u64` from every member.
    fn all_gather_u64(&self, v: u64) -> Result<Vec<u64>, CommError> {
        let all = self.all_gather_bytes(&v.to_le_bytes())?;
        all.iter()
            .enumerate()
            .map(|(r, b)| {
                <[u8; 8]>::try_from(b.as_slice())
                    .map(u64::from_le_bytes)
                    .map_err(|_| CommError::Protocol {
                        peer: self.world_rank(r),
                        detail: format!("all_gather_u64: {} bytes instead of 8", b.len()),
                    })
            })
            .collect()
    }
}
