//! A broadcast's declared length is a peer's word: rank 0 of an in-memory world plays a
//! root that announces more than it sends (its frames written straight onto its link, as
//! a misbehaving peer would), and rank 1, in `broadcast_bytes`, must not allocate on that
//! word: refuse a length above its maximum at once, and hold no more than what arrived of
//! a length it accepts.

use std::time::{Duration, Instant};

use flotilla_group::{CommError, ProcessGroup};

use crate::frame::{Op, channel};
use crate::{CommConfig, TcpGroup};

const CHUNK: usize = 64 << 10;

/// A world of two (rank 0 the forger) whose chain broadcast moves `CHUNK`-byte chunks.
fn world() -> Vec<TcpGroup> {
    let cfg = CommConfig::new(Some(0), 2)
        .with_timeout(Duration::from_secs(1))
        .with_chunk_bytes(CHUNK);
    TcpGroup::in_memory(2, cfg).expect("world")
}

/// Writes frame `tag` of the world's first collective (a broadcast) from rank 0 to rank 1.
fn forge(comms: &[TcpGroup], tag: u32, payload: &[u8]) {
    let w = comms[0].world();
    let conn = w.conn(1).expect("link to rank 1");
    w.handle
        .block_on(conn.send(channel::COLLECTIVE, Op::Broadcast, (0, 0, tag), payload))
        .expect("forged frame");
}

/// A root announcing 64 GiB to a rank whose maximum is 1 MiB: refused at once, naming the
/// root, before anything is allocated (today's zero-fill of the announced length would
/// abort the process on the allocation).
#[test]
fn a_declared_64_gib_broadcast_allocates_nothing() {
    let comms = world();
    forge(&comms, 0, &(64u64 << 30).to_le_bytes());
    let mut buf = Vec::new();
    let t = Instant::now();
    let e = comms[1]
        .broadcast_bytes(&mut buf, 0, 1 << 20)
        .expect_err("more than the maximum");
    assert!(
        t.elapsed() < Duration::from_millis(900),
        "{e}: not before the timeout"
    );
    assert!(
        matches!(&e, CommError::Protocol { peer: 0, detail } if detail.contains("68719476736 bytes")),
        "{e}"
    );
    assert_eq!(buf.capacity(), 0, "allocated {} bytes", buf.capacity());
}

/// A root announcing 256 MiB (within the maximum) that sends one chunk and goes silent: the
/// receiver times out holding about what arrived, not the announced length.
#[test]
fn a_broadcast_grows_with_what_arrived_not_with_what_was_announced() {
    let comms = world();
    forge(&comms, 0, &(256u64 << 20).to_le_bytes());
    forge(&comms, 1, &[7u8; CHUNK]);
    let mut buf = Vec::new();
    let e = comms[1]
        .broadcast_bytes(&mut buf, 0, 1 << 30)
        .expect_err("the rest never comes");
    assert!(matches!(e, CommError::Timeout { peer: 0, .. }), "{e}");
    assert!(
        buf.capacity() <= 2 * CHUNK,
        "holds {} bytes after {CHUNK} arrived",
        buf.capacity()
    );
    assert_eq!(buf, vec![7u8; CHUNK]);
}
