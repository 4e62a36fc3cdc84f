//! Reduce-scatter and all-gather of `f32`s (`ProcessGroup::reduce_scatter_sum_f32`,
//! `reduce_scatter_bucket`, `all_gather_f32`) on worlds of 1 to 5 ranks, odd lengths and
//! lengths below the world size: each rank's `flotilla_group::shard` against the serial sum
//! (exact, on values whose sums are exact), bitwise against the ring all-reduce's same shard
//! (values whose sums round, f32 and bf16 on the wire), and the gathered buffer against
//! every rank's shard put in place (over TCP and over shared memory, blocking and started in
//! the background); in-memory and over 127.0.0.1. Over shared memory
//! (ranks of one host) the shard has the bits of the segment's all-reduce.

// Only the world of ranks is used here; the rest of `common` serves the all-reduce tests.
#[allow(dead_code)]
mod common;

use std::time::Duration;

use common::{ok, world};
use flotilla_tcp::{CommConfig, ProcessGroup, Transport, WireFormat, shard};

fn cfg(n: usize) -> CommConfig {
    // Every all-reduce on the TCP ring (no doubling, no Rabenseifner), in small chunks so
    // segments pipeline.
    CommConfig::new(Some(0), n)
        .with_timeout(Duration::from_secs(10))
        .with_join_timeout(Duration::from_secs(10))
        .with_chunk_bytes(1024)
        .with_small_all_reduce_bytes(0)
        .with_mid_all_reduce_bytes(0)
        .with_transport(Transport::Tcp)
}

const LENGTHS: [usize; 9] = [0, 1, 2, 3, 4, 7, 13, 1001, 3001];

/// Rank `r`'s element `i`: a multiple of 1/4 in [-64, 64), so every sum of 5 is exact.
fn exact(r: usize, i: usize) -> f32 {
    ((r * 7919 + i * 104_729) % 512) as f32 / 4.0 - 64.0
}

/// Rank `r`'s element `i`: bits below f32's precision in any sum, so order shows.
fn rough(r: usize, i: usize) -> f32 {
    let z = ((r as u64) << 32 ^ i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (z >> 40) as f32 / (1u64 << 24) as f32 * 8.0 - 4.0
}

#[test]
fn reduce_scatter_gives_each_rank_the_serial_sum_of_its_shard() {
    for n in 1..=5 {
        let got = ok(world(n, false, cfg(n), |c| {
            let mut outs = Vec::new();
            for (k, len) in LENGTHS.into_iter().enumerate() {
                let mut buf: Vec<f32> = (0..len).map(|i| exact(c.rank(), i)).collect();
                if k % 2 == 0 {
                    c.reduce_scatter_sum_f32(&mut buf)?;
                } else {
                    buf = c.reduce_scatter_bucket(buf, k).wait()?;
                }
                outs.push(buf);
            }
            Ok(outs)
        }));
        for (k, len) in LENGTHS.into_iter().enumerate() {
            for (r, outs) in got.iter().enumerate() {
                assert_eq!(outs[k].len(), len);
                for i in shard(len, n, r) {
                    let serial: f32 = (0..n).map(|q| exact(q, i)).sum();
                    assert_eq!(outs[k][i], serial, "n {n} len {len} rank {r} at {i}");
                }
            }
        }
    }
}

#[test]
fn all_gather_puts_every_shard_in_place_on_every_rank() {
    let cases = (1..=5).flat_map(|n| [(n, Transport::Tcp), (n, Transport::Shm)]);
    for (n, transport) in cases {
        let got = ok(world(n, false, cfg(n).with_transport(transport), |c| {
            let mut outs = Vec::new();
            for (k, len) in LENGTHS.into_iter().enumerate() {
                let mine = shard(len, c.size(), c.rank());
                let mut buf: Vec<f32> = (0..len)
                    .map(|i| {
                        if mine.contains(&i) {
                            rough(c.rank(), i)
                        } else {
                            f32::NAN
                        }
                    })
                    .collect();
                if k % 2 == 0 {
                    c.all_gather_f32(&mut buf)?;
                } else {
                    buf = c.all_gather_bucket(buf, k).wait()?;
                }
                outs.push(buf);
            }
            Ok(outs)
        }));
        for (k, len) in LENGTHS.into_iter().enumerate() {
            let mut whole = vec![0f32; len];
            for q in 0..n {
                for i in shard(len, n, q) {
                    whole[i] = rough(q, i);
                }
            }
            for (r, outs) in got.iter().enumerate() {
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                let what = format!("{transport:?}, n {n} len {len} rank {r}");
                assert_eq!(bits(&outs[k]), bits(&whole), "{what}");
            }
        }
    }
}

/// The shard of a reduce-scatter has the bits the group's all-reduce gives it, and
/// reduce-scatter then all-gather is the all-reduce, bit for bit.
fn matches_the_all_reduce(n: usize, tcp: bool, c: CommConfig) {
    let got = ok(world(n, tcp, c, |c| {
        let mut outs = Vec::new();
        for len in LENGTHS {
            let input: Vec<f32> = (0..len).map(|i| rough(c.rank(), i)).collect();
            let mut reduced = input.clone();
            c.all_reduce_sum(&mut reduced)?;
            let mut scattered = input.clone();
            c.reduce_scatter_sum_f32(&mut scattered)?;
            let mut gathered = scattered.clone();
            c.all_gather_f32(&mut gathered)?;
            outs.push((reduced, scattered, gathered));
        }
        Ok(outs)
    }));
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (k, len) in LENGTHS.into_iter().enumerate() {
        for (r, outs) in got.iter().enumerate() {
            let (reduced, scattered, gathered) = &outs[k];
            let mine = shard(len, n, r);
            assert_eq!(
                bits(&scattered[mine.clone()]),
                bits(&reduced[mine]),
                "n {n} len {len} rank {r}: shard differs from the all-reduce's"
            );
            assert_eq!(bits(gathered), bits(reduced), "n {n} len {len} rank {r}");
        }
    }
}

#[test]
fn shards_are_bitwise_the_ring_all_reduce_in_memory() {
    for n in 1..=5 {
        matches_the_all_reduce(n, false, cfg(n));
    }
}

#[test]
fn shards_are_bitwise_the_ring_all_reduce_over_tcp_and_bf16() {
    matches_the_all_reduce(3, true, cfg(3));
    matches_the_all_reduce(4, false, cfg(4).with_wire_format(WireFormat::Bf16));
}

#[test]
fn shards_are_bitwise_the_shared_memory_all_reduce() {
    for n in 1..=5 {
        matches_the_all_reduce(n, false, cfg(n).with_transport(Transport::Shm));
    }
}
