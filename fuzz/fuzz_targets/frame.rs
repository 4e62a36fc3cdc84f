//! The frame decoder: header checks, `read_frame` (header + payload, LZ4) under a frame-size
//! limit. Properties: garbage is an error, never a panic; a header that decodes re-encodes to
//! the same 32 bytes; nothing larger than the limit is accepted or allocated; a plain payload
//! is exactly the bytes that followed the header; valid headers round-trip.
#![no_main]

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use flotilla_tcp::PeerName;
use flotilla_tcp::frame::{self, FrameHeader, HEADER_LEN, flags};
use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;

/// The frame-size limit of the target (small, so that claimed lengths above it are common).
const MAX: usize = 1 << 16;

/// Runs a future that never waits (it reads from a slice) to completion.
fn block_on<F: Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    let mut cx = Context::from_waker(Waker::noop());
    match f.as_mut().poll(&mut cx) {
        Poll::Ready(v) => v,
        Poll::Pending => panic!("reading from a slice never waits"),
    }
}

fn header_from(u: &mut Unstructured<'_>) -> Result<FrameHeader> {
    Ok(FrameHeader {
        channel: u.int_in_range(0..=2)?,
        flags: u.int_in_range(0..=flags::KNOWN)?,
        op: u.int_in_range(0..=6)?,
        group: u.arbitrary()?,
        seq: u.arbitrary()?,
        tag: u.arbitrary()?,
        len: u.arbitrary()?,
    })
}

fuzz_target!(|data: &[u8]| {
    let peer = PeerName::ranked(1, "fuzz");
    if let Some(hb) = data.first_chunk::<HEADER_LEN>() {
        if let Ok(h) = FrameHeader::decode(hb, MAX, &peer) {
            assert_eq!(&h.encode(), hb, "a decoded header re-encodes differently");
            assert!(h.len as usize <= MAX);
        }
    }
    let mut reader = data;
    if let Ok((h, payload)) = block_on(frame::read_frame(&mut reader, MAX, &peer)) {
        assert!(payload.len() <= MAX, "payload beyond the limit");
        if h.flags & flags::LZ4 == 0 {
            assert_eq!(payload, data[HEADER_LEN..HEADER_LEN + h.len as usize]);
        }
    }
    let mut out = Vec::new();
    if frame::decompress_into(data, &mut out, MAX, &peer).is_ok() {
        assert!(out.len() <= MAX);
    }
    let mut u = Unstructured::new(data);
    if let Ok(h) = header_from(&mut u) {
        match FrameHeader::decode(&h.encode(), MAX, &peer) {
            Ok(back) => assert_eq!(back, h),
            Err(_) => assert!(h.len as usize > MAX, "a valid header was refused: {h:?}"),
        }
    }
});
