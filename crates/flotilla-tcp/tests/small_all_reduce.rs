//! The small-message all-reduce (recursive doubling, `CommConfig::small_all_reduce_bytes`):
//! the serial sum within f32 rounding, bit-identical on every rank, on worlds of 1 to 7
//! ranks (powers of two and the fold-in/fold-out of the others), in-memory and over
//! 127.0.0.1; bf16 on the wire; a peer that dies mid-operation named by the survivors.

mod common;

use std::thread;
use std::time::Duration;

use common::{assert_near_serial_sum, dead_peer_is_named, f32_tolerance, mix, ok, value, world};
use flotilla_tcp::{CommConfig, ProcessGroup, Transport, WireFormat};

/// Every f32 all-reduce of the tests fits under this threshold.
const SMALL: usize = 64 << 10;

fn cfg(n: usize) -> CommConfig {
    CommConfig::new(Some(0), n)
        .with_timeout(Duration::from_secs(5))
        .with_join_timeout(Duration::from_secs(10))
        .with_chunk_bytes(4096)
        .with_small_all_reduce_bytes(SMALL)
        .with_transport(Transport::Tcp)
}

/// Lengths of the cases on `n` ranks: 0, 1, fewer than `n`, random ones up to the threshold.
fn lengths(n: usize) -> Vec<usize> {
    let mut v = vec![0, 1, n.saturating_sub(1), n + 1, SMALL / 4];
    v.extend((0..6).map(|k| (mix((n * 100 + k) as u64) % (SMALL as u64 / 4)) as usize));
    v
}

/// The frames rank `r` of `n` sends in a recursive-doubling all-reduce of `len` floats (one
/// frame a step, the whole buffer in each): none when alone or empty; of the fold's first
/// `2 (n - p)` ranks (`p` the largest power of two `<= n`), an even one hands its buffer
/// over (one frame), an odd one doubles and sends the result back (`log2 p + 1`); the
/// others double (`log2 p`). The ring sends `2 (n - 1)` (at least; more chunks, more frames),
/// Rabenseifner's `2 log2 n`: at 2 ranks, 2 against the doubling's 1.
fn frames(n: usize, r: usize, len: usize) -> u64 {
    if len == 0 || n == 1 {
        return 0;
    }
    let steps = u64::from(usize::BITS - 1 - n.leading_zeros());
    let rem = n - (1 << steps);
    match r {
        r if r < 2 * rem && r.is_multiple_of(2) => 1,
        r if r < 2 * rem => steps + 1,
        _ => steps,
    }
}

/// All-reduces every case of [`lengths`] on `n` ranks; checks each rank against the serial
/// sum (within `tolerance` times the sum of magnitudes), every rank's bits against rank
/// 0's, and that each case took exactly the doubling's frames ([`frames`]).
fn check(n: usize, tcp: bool, c: CommConfig, tolerance: f64) {
    let lens = lengths(n);
    let lens2 = lens.clone();
    let res = ok(world(n, tcp, c, move |c| {
        let mut outs = Vec::new();
        for (case, &len) in lens2.iter().enumerate() {
            let mut buf: Vec<f32> = (0..len).map(|i| value(case, c.rank(), i)).collect();
            let before = c.stats().frames_sent;
            c.all_reduce_sum(&mut buf)?;
            outs.push((buf, c.stats().frames_sent - before));
        }
        Ok(outs)
    }));
    for (case, &len) in lens.iter().enumerate() {
        for (r, outs) in res.iter().enumerate() {
            let (got, sent) = &outs[case];
            let first_diff = got
                .iter()
                .zip(&res[0][case].0)
                .position(|(a, b)| a.to_bits() != b.to_bits());
            assert_eq!(
                first_diff, None,
                "n {n} len {len}: rank {r} differs from rank 0"
            );
            assert_eq!(
                *sent,
                frames(n, r, len),
                "n {n} len {len} rank {r}: frames sent"
            );
            assert_near_serial_sum(n, case, r, got, tolerance);
        }
    }
}

#[test]
fn worlds_1_to_7_in_memory_match_the_serial_sum_bit_identically() {
    for n in 1..=7 {
        check(n, false, cfg(n), f32_tolerance(n));
    }
}

#[test]
fn worlds_over_loopback_match_the_serial_sum_bit_identically() {
    let handles: Vec<_> = [2, 5, 6]
        .into_iter()
        .map(|n| thread::spawn(move || check(n, true, cfg(n), f32_tolerance(n))))
        .collect();
    for h in handles {
        h.join().expect("world panicked");
    }
}

#[test]
fn bf16_on_the_wire_stays_bit_identical_within_bf16_rounding() {
    for n in [3, 4, 7] {
        // Every partial is rounded to bf16 once per step (unit roundoff 2^-8), the result
        // once more.
        let tol = (n as f64 + 1.0) * 2f64.powi(-8);
        check(n, false, cfg(n).with_wire_format(WireFormat::Bf16), tol);
    }
}

/// A rank that dies after one all-reduce is named by every survivor of the next, which
/// fail promptly rather than at the deadline: its partners see the lost connection, the
/// others the partners' abort notice (dead ranks 4 and 0 of 5 ranks: the doubling's and
/// the fold's; rank 2 of 4).
#[test]
fn a_peer_dying_mid_operation_is_named() {
    for (n, dead) in [(5, 4), (5, 0), (4, 2)] {
        dead_peer_is_named(n, dead, cfg(n).with_timeout(Duration::from_secs(8)), 1000);
    }
}
