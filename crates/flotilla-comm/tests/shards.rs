//! Reduce-scatter and all-gather of `f32`s (`ProcessGroup::reduce_scatter_sum_f32`,
//! `reduce_scatter_bucket`, `all_gather_f32`) on worlds of 1 to 5 ranks, odd lengths and
//! lengths below the world size: each rank's `flotilla_group::shard` against the serial sum
//! (exact, on values whose sums are exact), bitwise against the ring all-reduce's same shard
//! (values whose sums round, f32 and bf16 on the wire), and the gathered buffer against
//! every rank's shard put in place; in-memory and over 127.0.0.1. Over shared memory
//! (ranks of one host) the shard has the bits of the segment's all-reduce.

use std::net::TcpListener;
use std::sync::Arc;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use flotilla_comm::{
    CommConfig, CommError, Communicator, ProcessGroup, Transport, WireFormat, shard,
};

const TEST_DEADLINE: Duration = Duration::from_secs(60);

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

/// Runs `body` on every rank of an `n`-rank world (threads; `tcp`: sockets over loopback).
fn world<T, F>(n: usize, tcp: bool, c: CommConfig, body: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(Communicator) -> Result<T, CommError> + Send + Sync + 'static,
{
    let body = Arc::new(body);
    let (tx, rx) = mpsc::channel();
    if tcp {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = l.local_addr().expect("addr").port();
        let mut l = Some(l);
        for r in 0..n {
            let mut c = c.clone().with_master("127.0.0.1", port);
            c.rank = Some(r);
            let (tx, body, l) = (tx.clone(), body.clone(), l.take().filter(|_| r == 0));
            thread::spawn(move || {
                let comm = match l {
                    Some(l) => Communicator::connect_with_listener(c, l),
                    None => Communicator::connect(c),
                };
                let _ = tx.send((r, comm.and_then(|c| body(c))));
            });
        }
    } else {
        for (r, comm) in Communicator::in_memory(n, c)
            .expect("world")
            .into_iter()
            .enumerate()
        {
            let (tx, body) = (tx.clone(), body.clone());
            thread::spawn(move || {
                let _ = tx.send((r, body(comm)));
            });
        }
    }
    let deadline = Instant::now() + TEST_DEADLINE;
    let mut out: Vec<Option<T>> = (0..n).map(|_| None).collect();
    for _ in 0..n {
        let left = deadline.saturating_duration_since(Instant::now());
        let (r, res) = rx.recv_timeout(left).expect("test world hung");
        out[r] = Some(res.unwrap_or_else(|e| panic!("rank {r}: {e}")));
    }
    out.into_iter()
        .map(|o| o.expect("every rank answered"))
        .collect()
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
        let got = world(n, false, cfg(n), |c| {
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
        });
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
    for n in 1..=5 {
        let got = world(n, false, cfg(n), |c| {
            let mut outs = Vec::new();
            for len in LENGTHS {
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
                c.all_gather_f32(&mut buf)?;
                outs.push(buf);
            }
            Ok(outs)
        });
        for (k, len) in LENGTHS.into_iter().enumerate() {
            let mut whole = vec![0f32; len];
            for q in 0..n {
                for i in shard(len, n, q) {
                    whole[i] = rough(q, i);
                }
            }
            for (r, outs) in got.iter().enumerate() {
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&outs[k]), bits(&whole), "n {n} len {len} rank {r}");
            }
        }
    }
}

/// The shard of a reduce-scatter has the bits the group's all-reduce gives it, and
/// reduce-scatter then all-gather is the all-reduce, bit for bit.
fn matches_the_all_reduce(n: usize, tcp: bool, c: CommConfig) {
    let got = world(n, tcp, c, |c| {
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
    });
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
