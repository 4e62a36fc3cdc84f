//! The middle-size all-reduce (Rabenseifner's reduce-scatter by recursive halving and
//! all-gather by recursive doubling, `CommConfig::mid_all_reduce_bytes`, on power-of-two
//! groups): the serial sum within f32 rounding, bit-identical on every rank, on worlds of
//! 1 to 8 ranks, in-memory and over 127.0.0.1; the sizes around both thresholds take the
//! algorithm they should (counted in frames: other worlds take the ring there); chunked
//! steps; bf16 on the wire; a peer that dies mid-operation named by the survivors.

mod common;

use std::thread;
use std::time::Duration;

use common::{assert_near_serial_sum, dead_peer_is_named, f32_tolerance, mix, ok, value, world};
use flotilla_tcp::{CommConfig, ProcessGroup, Transport, WireFormat};

/// Up to this many bytes: recursive doubling.
const SMALL: usize = 4 << 10;
/// Above [`SMALL`] and up to this many bytes: Rabenseifner's; above it the ring.
const MID: usize = 64 << 10;

/// Thresholds as above; one chunk holds a whole buffer of the threshold cases, so every
/// step of an algorithm is one frame and the frame count tells the algorithm.
fn cfg(n: usize) -> CommConfig {
    CommConfig::new(Some(0), n)
        .with_timeout(Duration::from_secs(5))
        .with_join_timeout(Duration::from_secs(10))
        .with_chunk_bytes(MID)
        .with_small_all_reduce_bytes(SMALL)
        .with_mid_all_reduce_bytes(MID)
        .with_transport(Transport::Tcp)
}

/// `log2` of the largest power of two `<= n`.
fn log2_floor(n: usize) -> u64 {
    u64::from(usize::BITS - 1 - n.leading_zeros())
}

/// The frames rank `r` of `n` sends for an all-reduce of `len` f32s under [`cfg`] (one
/// frame per step; every block and segment non-empty: `len >= n`): doubling's `log2 p`
/// (one more, or only one, on the ranks of its fold), Rabenseifner's `2 log2 n` on a power
/// of two, else the ring's `2 (n-1)`.
fn frames(n: usize, r: usize, len: usize) -> u64 {
    let (steps, rem) = (log2_floor(n), n - (1 << log2_floor(n)));
    let (fold_even, fold_odd) = (
        r < 2 * rem && r.is_multiple_of(2),
        r < 2 * rem && !r.is_multiple_of(2),
    );
    if n == 1 {
        0
    } else if len * 4 <= SMALL {
        if fold_even {
            1
        } else {
            steps + u64::from(fold_odd)
        }
    } else if len * 4 <= MID && n.is_power_of_two() {
        2 * steps
    } else {
        2 * (n as u64 - 1)
    }
}

/// The cases on `n` ranks: the edges of both thresholds and random lengths between them.
fn threshold_lengths(n: usize) -> Vec<usize> {
    let (s, m) = (SMALL / 4, MID / 4);
    let mut v = vec![s, s + 1, s + 2, m - 1, m, m + 1];
    v.extend((0..4).map(|k| s + 1 + (mix((n * 100 + k) as u64) % (m - s) as u64) as usize));
    v
}

/// All-reduces every case of `lens` on `n` ranks; checks each rank against the serial sum
/// (within `tolerance` times the sum of magnitudes), every rank's bits against rank 0's,
/// and, when `count`, each rank's frames against [`frames`].
fn check(n: usize, tcp: bool, c: CommConfig, lens: Vec<usize>, tolerance: f64, count: bool) {
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
            if count {
                assert_eq!(*sent, frames(n, r, len), "n {n} len {len} rank {r}: frames");
            }
            assert_near_serial_sum(n, case, r, got, tolerance);
        }
    }
}

#[test]
fn worlds_1_to_8_take_each_algorithm_at_its_sizes_and_end_bit_identical() {
    for n in 1..=8 {
        check(
            n,
            false,
            cfg(n),
            threshold_lengths(n),
            f32_tolerance(n),
            true,
        );
    }
}

/// Chunks of 4 KiB: every halving and doubling step is pipelined over many frames, and the
/// blocks of short buffers are empty on some ranks.
#[test]
fn chunked_steps_and_short_buffers_match_the_serial_sum() {
    for n in [2, 4, 8] {
        let c = cfg(n)
            .with_chunk_bytes(4096)
            .with_small_all_reduce_bytes(0)
            .with_mid_all_reduce_bytes(1 << 20);
        let lens = vec![0, 1, n - 1, n + 1, 5000, 40_000, (1 << 18) - 3];
        check(n, false, c, lens, f32_tolerance(n), false);
    }
}

#[test]
fn worlds_over_loopback_match_the_serial_sum_bit_identically() {
    let handles: Vec<_> = [2, 4, 6]
        .into_iter()
        .map(|n| {
            thread::spawn(move || {
                check(
                    n,
                    true,
                    cfg(n),
                    threshold_lengths(n),
                    f32_tolerance(n),
                    true,
                )
            })
        })
        .collect();
    for h in handles {
        h.join().expect("world panicked");
    }
}

#[test]
fn bf16_on_the_wire_stays_bit_identical_within_bf16_rounding() {
    for n in [2, 4, 8] {
        // A block's partial is rounded to bf16 once per step (unit roundoff 2^-8), the
        // result once more.
        let tol = (n as f64 + 1.0) * 2f64.powi(-8);
        let c = cfg(n).with_wire_format(WireFormat::Bf16);
        check(n, false, c, threshold_lengths(n), tol, true);
    }
}

/// A rank that dies after one all-reduce is named by every survivor of the next, which
/// fail promptly rather than at the deadline (rank 2 of 4; ranks 0 and 5 of 8).
#[test]
fn a_peer_dying_mid_operation_is_named() {
    for (n, dead) in [(4, 2), (8, 0), (8, 5)] {
        let c = cfg(n)
            .with_timeout(Duration::from_secs(8))
            .with_chunk_bytes(4096);
        dead_peer_is_named(n, dead, c, MID / 4);
    }
}
