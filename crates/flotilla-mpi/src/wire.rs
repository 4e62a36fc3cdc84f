//! The one MPI tag Flotilla's point-to-point messages use, and how the Flotilla tag rides
//! along.
//!
//! Flotilla tags are `u32` and reach up to `0xFFFF_FFFF`, while MPI guarantees tags only up
//! to 32767 (`MPI_TAG_UB`). So every message travels under [`P2P_TAG`] with its Flotilla tag
//! in a 4-byte little-endian trailer; the receiving side buffers it by (sender, tag) in the
//! group's [`flotilla_group::Mailbox`]. A trailer (not a header) lets both sides avoid
//! moving the payload.

use flotilla_group::Tag;

/// The MPI tag of every Flotilla point-to-point message (below any `MPI_TAG_UB`).
pub(crate) const P2P_TAG: i32 = 0x2F1;
const _: () = assert!(P2P_TAG <= 32767, "MPI guarantees tags up to 32767 only");

/// Bytes of the trailer.
pub(crate) const TRAILER: usize = 4;

/// `msg` followed by `tag`: what goes on the wire.
pub(crate) fn encode(tag: Tag, msg: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(msg.len() + TRAILER);
    out.extend_from_slice(msg);
    out.extend_from_slice(&tag.to_le_bytes());
    out
}

/// Splits a received buffer into its tag and payload (in place); `None` when it is too short
/// to carry a tag.
pub(crate) fn decode(mut buf: Vec<u8>) -> Option<(Tag, Vec<u8>)> {
    let at = buf.len().checked_sub(TRAILER)?;
    let mut t = [0u8; TRAILER];
    t.copy_from_slice(&buf[at..]);
    buf.truncate(at);
    Some((Tag::from_le_bytes(t), buf))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_including_empty_messages_and_reserved_tags() {
        for (tag, msg) in [(0u32, &b""[..]), (7, b"hello"), (0xFFFF_0003, b"\x00\xff")] {
            let wire = encode(tag, msg);
            assert_eq!(wire.len(), msg.len() + TRAILER);
            assert_eq!(decode(wire), Some((tag, msg.to_vec())));
        }
        assert_eq!(decode(vec![1, 2, 3]), None);
    }
}
