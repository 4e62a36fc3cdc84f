//! Wire format of the framed transport.
//!
//! Every message is one frame: a fixed 32-byte header followed by `len` payload bytes.
//!
//! ```text
//! offset size field
//!      0    1 magic    0xF1
//!      1    1 version  2
//!      2    1 channel  logical stream (0 control, 1 collectives, 2 point-to-point)
//!      3    1 flags    bit 0: payload is LZ4 (u32 LE uncompressed size + LZ4 block)
//!      4    1 op       collective kind (see [`Op`])
//!      5    3 reserved must be zero
//!      8    8 group    process-group key (0: the world group; u64 LE)
//!     16    8 seq      collective sequence number within the group (u64 LE)
//!     24    4 tag      collectives: frame counter within the collective;
//!                      point-to-point: the message tag (u32 LE)
//!     28    4 len      payload length in bytes (u32 LE)
//! ```
//!
//! Several channels share one TCP connection per pair of ranks; the reader of a connection
//! demultiplexes frames by channel and process group: collective frames into one queue per
//! group, point-to-point frames into the tagged mailbox. A header that fails any check is a
//! [`CommError::BadFrame`] or [`CommError::FrameTooLarge`] naming the sender.

use std::io::IoSlice;

use flotilla_group::{CommError, PeerName};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// First header byte of every frame.
pub const MAGIC: u8 = 0xF1;
/// Wire protocol version carried in every header.
pub const VERSION: u8 = 2;
/// Size of the frame header in bytes.
pub const HEADER_LEN: usize = 32;
/// Payloads below this size are never compressed.
pub const MIN_COMPRESS_BYTES: usize = 4096;

/// Logical streams multiplexed over one connection.
pub mod channel {
    /// Rendezvous, handshakes and abort notices.
    pub const CONTROL: u8 = 0;
    /// Collective operations (ordered by sequence number).
    pub const COLLECTIVE: u8 = 1;
    /// Point-to-point messages (e.g. parameter-server traffic).
    pub const P2P: u8 = 2;
    /// Number of channels.
    pub const COUNT: usize = 3;
}

/// Header flag bits.
pub mod flags {
    /// The payload is LZ4-compressed with its uncompressed size prepended (u32 LE).
    pub const LZ4: u8 = 1;
    /// All flags known to this version.
    pub const KNOWN: u8 = LZ4;
}

/// Kind of operation a frame belongs to; checked on receipt to detect ranks that issue
/// collectives in different orders.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    /// Control messages.
    Control = 0,
    /// [`crate::ProcessGroup::barrier`].
    Barrier = 1,
    /// [`crate::ProcessGroup::broadcast_f32`] / [`crate::ProcessGroup::broadcast_bytes`].
    Broadcast = 2,
    /// [`crate::ProcessGroup::all_gather_bytes`].
    AllGather = 3,
    /// [`crate::ProcessGroup::all_reduce_sum`] and the asynchronous variant.
    AllReduce = 4,
    /// Point-to-point messages.
    P2p = 5,
    /// Integer reductions ([`crate::ProcessGroup::all_reduce_i64`] / `_u64`).
    Reduce = 6,
    /// [`crate::ProcessGroup::reduce_scatter_sum_f32`] and the bucket variant.
    ReduceScatter = 7,
    /// [`crate::ProcessGroup::all_gather_f32`].
    AllGatherF32 = 8,
}

impl Op {
    /// The op for a header byte, if known.
    pub fn from_u8(v: u8) -> Option<Op> {
        Some(match v {
            0 => Op::Control,
            1 => Op::Barrier,
            2 => Op::Broadcast,
            3 => Op::AllGather,
            4 => Op::AllReduce,
            5 => Op::P2p,
            6 => Op::Reduce,
            7 => Op::ReduceScatter,
            8 => Op::AllGatherF32,
            _ => return None,
        })
    }

    /// Human-readable name.
    pub fn name(self) -> &'static str {
        match self {
            Op::Control => "control",
            Op::Barrier => "barrier",
            Op::Broadcast => "broadcast",
            Op::AllGather => "all_gather",
            Op::AllReduce => "all_reduce",
            Op::P2p => "p2p",
            Op::Reduce => "reduce",
            Op::ReduceScatter => "reduce_scatter",
            Op::AllGatherF32 => "all_gather_f32",
        }
    }
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// Logical channel (see [`channel`]).
    pub channel: u8,
    /// Flag bits (see [`flags`]).
    pub flags: u8,
    /// Operation kind (see [`Op`]).
    pub op: u8,
    /// Key of the process group the frame belongs to (0: the world group).
    pub group: u64,
    /// Collective sequence number within the group.
    pub seq: u64,
    /// Frame counter within the collective.
    pub tag: u32,
    /// Payload length in bytes (as sent, i.e. compressed size when compressed).
    pub len: u32,
}

impl FrameHeader {
    /// Encodes the header.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0] = MAGIC;
        b[1] = VERSION;
        b[2] = self.channel;
        b[3] = self.flags;
        b[4] = self.op;
        b[8..16].copy_from_slice(&self.group.to_le_bytes());
        b[16..24].copy_from_slice(&self.seq.to_le_bytes());
        b[24..28].copy_from_slice(&self.tag.to_le_bytes());
        b[28..32].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Decodes and validates a header received from `peer`.
    pub fn decode(
        b: &[u8; HEADER_LEN],
        max_frame_bytes: usize,
        peer: &PeerName,
    ) -> Result<Self, CommError> {
        let bad = |detail: String| {
            Err(CommError::BadFrame {
                peer: peer.clone(),
                detail,
            })
        };
        if b[0] != MAGIC {
            return bad(format!(
                "bad magic byte {:#04x} (expected {MAGIC:#04x}); not a flotilla peer?",
                b[0]
            ));
        }
        if b[1] != VERSION {
            return bad(format!(
                "unsupported wire version {} (this build speaks {VERSION})",
                b[1]
            ));
        }
        if b[2] as usize >= channel::COUNT {
            return bad(format!("unknown channel {}", b[2]));
        }
        if b[3] & !flags::KNOWN != 0 {
            return bad(format!("unknown flags {:#04x}", b[3]));
        }
        if Op::from_u8(b[4]).is_none() {
            return bad(format!("unknown op {}", b[4]));
        }
        if b[5..8] != [0, 0, 0] {
            return bad("reserved header bytes are not zero".to_string());
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| u64::from(u32_at(i)) | (u64::from(u32_at(i + 4)) << 32);
        let len = u32_at(28);
        if len as usize > max_frame_bytes {
            return Err(CommError::FrameTooLarge {
                peer: peer.clone(),
                len: len as u64,
                max: max_frame_bytes,
            });
        }
        Ok(FrameHeader {
            channel: b[2],
            flags: b[3],
            op: b[4],
            group: u64_at(8),
            seq: u64_at(16),
            tag: u32_at(24),
            len,
        })
    }
}

/// LZ4-compresses `payload` (size-prepended) if that makes it smaller.
pub fn compress(payload: &[u8]) -> Option<Vec<u8>> {
    if payload.len() < MIN_COMPRESS_BYTES || payload.len() > u32::MAX as usize {
        return None;
    }
    let c = lz4_flex::block::compress_prepend_size(payload);
    (c.len() < payload.len()).then_some(c)
}

/// Decompresses a size-prepended LZ4 payload into `out` (cleared first), refusing to
/// expand beyond `max_frame_bytes`.
pub fn decompress_into(
    payload: &[u8],
    out: &mut Vec<u8>,
    max_frame_bytes: usize,
    peer: &PeerName,
) -> Result<(), CommError> {
    let bad = |detail: String| CommError::BadFrame {
        peer: peer.clone(),
        detail,
    };
    if payload.len() < 4 {
        return Err(bad(
            "compressed payload shorter than its size prefix".to_string()
        ));
    }
    let size = u32::from_le_bytes([payload[0], payload[1], payload[2], payload[3]]) as usize;
    if size > max_frame_bytes {
        return Err(CommError::FrameTooLarge {
            peer: peer.clone(),
            len: size as u64,
            max: max_frame_bytes,
        });
    }
    out.clear();
    out.resize(size, 0);
    let n = lz4_flex::block::decompress_into(&payload[4..], out)
        .map_err(|e| bad(format!("LZ4 payload does not decompress: {e}")))?;
    if n != size {
        return Err(bad(format!(
            "LZ4 payload decompressed to {n} bytes, header said {size}"
        )));
    }
    Ok(())
}

/// Writes header and payload with as few syscalls as possible (vectored writes).
pub async fn write_raw<W: AsyncWrite + Unpin>(
    w: &mut W,
    header: &[u8; HEADER_LEN],
    payload: &[u8],
) -> std::io::Result<()> {
    let mut bufs = [IoSlice::new(header), IoSlice::new(payload)];
    let mut slices: &mut [IoSlice<'_>] = &mut bufs;
    while !slices.is_empty() {
        let n = w.write_vectored(slices).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut slices, n);
    }
    Ok(())
}

/// Writes one frame (no compression). Used by the rendezvous and by tests.
pub async fn write_frame<W: AsyncWrite + Unpin>(
    w: &mut W,
    channel: u8,
    op: Op,
    seq: u64,
    tag: u32,
    payload: &[u8],
) -> std::io::Result<()> {
    let len = u32::try_from(payload.len())
        .map_err(|_| std::io::Error::other("frame payload exceeds 4 GiB"))?;
    let header = FrameHeader {
        channel,
        flags: 0,
        op: op as u8,
        group: 0,
        seq,
        tag,
        len,
    }
    .encode();
    write_raw(w, &header, payload).await?;
    w.flush().await
}

/// Reads the payload announced by `header` into `out` (cleared first) without zero-filling,
/// decompressing if flagged.
pub async fn read_payload<R: AsyncRead + Unpin>(
    r: &mut R,
    header: &FrameHeader,
    out: &mut Vec<u8>,
    scratch: &mut Vec<u8>,
    max_frame_bytes: usize,
    peer: &PeerName,
) -> std::io::Result<Result<(), CommError>> {
    let len = header.len as usize;
    let target: &mut Vec<u8> = if header.flags & flags::LZ4 != 0 {
        &mut *scratch
    } else {
        &mut *out
    };
    target.clear();
    // Exactly: a reused receive buffer keeps the capacity of the frames it carried.
    target.reserve_exact(len);
    while target.len() < len {
        let remaining = (len - target.len()) as u64;
        let n = (&mut *r).take(remaining).read_buf(target).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
    }
    if header.flags & flags::LZ4 != 0 {
        return Ok(decompress_into(scratch, out, max_frame_bytes, peer));
    }
    Ok(Ok(()))
}

/// Reads one whole frame (header + payload). Used by the rendezvous and by tests.
///
/// I/O failures are reported as [`CommError::PeerLost`]-style text through `Io`; header
/// problems as [`CommError::BadFrame`] / [`CommError::FrameTooLarge`].
pub async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    max_frame_bytes: usize,
    peer: &PeerName,
) -> Result<(FrameHeader, Vec<u8>), ReadError> {
    let mut hb = [0u8; HEADER_LEN];
    r.read_exact(&mut hb).await.map_err(ReadError::Io)?;
    let header = FrameHeader::decode(&hb, max_frame_bytes, peer).map_err(ReadError::Comm)?;
    let mut out = Vec::new();
    let mut scratch = Vec::new();
    read_payload(r, &header, &mut out, &mut scratch, max_frame_bytes, peer)
        .await
        .map_err(ReadError::Io)?
        .map_err(ReadError::Comm)?;
    Ok((header, out))
}

/// Failure of [`read_frame`]: either the socket failed/closed, or the data was invalid.
#[derive(Debug)]
pub enum ReadError {
    /// The connection failed or was closed (`UnexpectedEof`).
    Io(std::io::Error),
    /// The peer sent an invalid frame.
    Comm(CommError),
}

impl ReadError {
    /// Converts into a [`CommError`], describing I/O failures as a lost connection to `peer`.
    pub fn into_comm(self, peer: &PeerName, during: &str) -> CommError {
        match self {
            ReadError::Comm(e) => e,
            ReadError::Io(e) => match peer.rank {
                Some(rank) => CommError::PeerLost {
                    peer: rank,
                    op: during.to_string(),
                    reason: describe_io(&e),
                },
                None => CommError::io(format!("{during}: connection from {peer}"), e),
            },
        }
    }
}

/// Short description of a socket error, with EOF spelled out.
pub fn describe_io(e: &std::io::Error) -> String {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        "connection closed by peer".to_string()
    } else {
        e.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer() -> PeerName {
        PeerName::ranked(3, "10.0.0.3:1234")
    }

    #[test]
    fn header_roundtrip() {
        let h = FrameHeader {
            channel: channel::COLLECTIVE,
            flags: flags::LZ4,
            op: Op::AllReduce as u8,
            group: 0xDEAD_BEEF_0000_0001,
            seq: 1 << 40,
            tag: 77,
            len: 4096,
        };
        assert_eq!(
            FrameHeader::decode(&h.encode(), 1 << 20, &peer()).unwrap(),
            h
        );
    }

    #[test]
    fn header_rejects_garbage() {
        let good = FrameHeader {
            channel: 0,
            flags: 0,
            op: 0,
            group: 0,
            seq: 0,
            tag: 0,
            len: 10,
        }
        .encode();
        for (i, v) in [
            (0usize, 0u8),
            (1, 1),
            (1, 9),
            (2, 9),
            (3, 0x80),
            (4, 200),
            (6, 1),
        ] {
            let mut b = good;
            b[i] = v;
            let e = FrameHeader::decode(&b, 1 << 20, &peer()).unwrap_err();
            assert!(matches!(e, CommError::BadFrame { .. }), "{i}: {e}");
            assert!(e.to_string().contains("rank 3"), "{e}");
        }
        let big = FrameHeader {
            channel: 0,
            flags: 0,
            op: 0,
            group: 0,
            seq: 0,
            tag: 0,
            len: 1 << 21,
        }
        .encode();
        assert!(matches!(
            FrameHeader::decode(&big, 1 << 20, &peer()),
            Err(CommError::FrameTooLarge { .. })
        ));
    }

    #[test]
    fn lz4_roundtrip_and_bomb() {
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 7) as u8).collect();
        let c = compress(&data).expect("compressible");
        let mut out = Vec::new();
        decompress_into(&c, &mut out, 1 << 20, &peer()).unwrap();
        assert_eq!(out, data);
        assert!(matches!(
            decompress_into(&c, &mut out, 50_000, &peer()),
            Err(CommError::FrameTooLarge { .. })
        ));
        let mut broken = c.clone();
        broken.truncate(c.len() / 2);
        assert!(matches!(
            decompress_into(&broken, &mut out, 1 << 20, &peer()),
            Err(CommError::BadFrame { .. })
        ));
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

        #[test]
        fn valid_headers_round_trip(
            channel in 0u8..3, flags in 0u8..=flags::KNOWN, op in 0u8..7,
            group: u64, seq: u64, tag: u32, len: u32,
        ) {
            let h = FrameHeader { channel, flags, op, group, seq, tag, len };
            match FrameHeader::decode(&h.encode(), 1 << 20, &peer()) {
                Ok(back) => proptest::prop_assert_eq!(back, h),
                Err(e) => proptest::prop_assert!(len > 1 << 20, "{e}"),
            }
        }

        #[test]
        fn any_header_bytes_decode_to_themselves_or_an_error(b: [u8; HEADER_LEN]) {
            if let Ok(h) = FrameHeader::decode(&b, 1 << 20, &peer()) {
                proptest::prop_assert_eq!(h.encode(), b);
            }
        }
    }

    #[tokio::test]
    async fn frame_roundtrip_over_pipe() {
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        write_frame(&mut a, channel::P2P, Op::P2p, 5, 6, b"hello")
            .await
            .unwrap();
        let (h, p) = read_frame(&mut b, 1 << 20, &peer()).await.unwrap();
        assert_eq!(
            (h.channel, h.seq, h.tag, p.as_slice()),
            (channel::P2P, 5, 6, &b"hello"[..])
        );
    }
}
