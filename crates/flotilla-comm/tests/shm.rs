//! The shared-memory transport (`CommConfig::transport`): ranks of one host reduce through
//! a shared segment. Worlds of 1 to 5 ranks (threads as ranks, in-memory links and over
//! 127.0.0.1), lengths 0, 1, odd and several chunks: bitwise the serial left-to-right `f32`
//! sum in rank order on every rank; buckets started back to back; sub-groups; broadcast;
//! the file-backed fallback directory; and real processes: a killed rank named by every
//! survivor, a stalled one by the deadline, no file left behind.

use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, mpsc};
use std::thread;
use std::time::{Duration, Instant};

use flotilla_comm::{CommConfig, CommError, Communicator, ProcessGroup, Transport};

const TEST_DEADLINE: Duration = Duration::from_secs(60);
/// Slots of 4 KiB (1024 floats): the lengths below span several chunks.
const CHUNK: usize = 4096;
const LENGTHS: [usize; 6] = [0, 1, 7, 1023, 1024, 5 * 1024 + 13];

fn cfg(n: usize, transport: Transport) -> CommConfig {
    CommConfig::new(Some(0), n)
        .with_timeout(Duration::from_secs(10))
        .with_join_timeout(Duration::from_secs(20))
        .with_transport(transport)
        .with_shm_chunk_bytes(CHUNK)
}

/// Runs `body` on every rank of an `n`-rank world built from `c`, each rank a thread;
/// `tcp` picks a rendezvous over 127.0.0.1, else in-memory links.
fn world<T, F>(n: usize, tcp: bool, c: CommConfig, body: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(Communicator) -> Result<T, CommError> + Send + Sync + 'static,
{
    let body = Arc::new(body);
    let (tx, rx) = mpsc::channel();
    let comms: Vec<Box<dyn FnOnce() -> Result<Communicator, CommError> + Send>> = if tcp {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = l.local_addr().expect("addr").port();
        let mut l = Some(l);
        (0..n)
            .map(|r| {
                let mut c = c.clone().with_master("127.0.0.1", port);
                c.rank = Some(r);
                let l = l.take().filter(|_| r == 0);
                Box::new(move || match l {
                    Some(l) => Communicator::connect_with_listener(c, l),
                    None => Communicator::connect(c),
                }) as Box<dyn FnOnce() -> _ + Send>
            })
            .collect()
    } else {
        Communicator::in_memory(n, c)
            .expect("in-memory world")
            .into_iter()
            .map(|c| Box::new(move || Ok(c)) as Box<dyn FnOnce() -> _ + Send>)
            .collect()
    };
    for (r, make) in comms.into_iter().enumerate() {
        let (tx, body) = (tx.clone(), body.clone());
        thread::spawn(move || {
            let _ = tx.send((r, make().and_then(|c| body(c))));
        });
    }
    let deadline = Instant::now() + TEST_DEADLINE;
    let mut out: Vec<Option<T>> = (0..n).map(|_| None).collect();
    for _ in 0..n {
        let left = deadline.saturating_duration_since(Instant::now());
        let (r, res) = rx.recv_timeout(left).expect("test world hung");
        out[r] = Some(res.unwrap_or_else(|e| panic!("rank {r}: {e}")));
    }
    out.into_iter().map(|r| r.expect("result")).collect()
}

/// SplitMix64: deterministic pseudo-random bits.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Rank `r`'s input of `len` floats (varied magnitudes and signs, so the order of the
/// additions shows in the bits).
fn input(r: usize, len: usize, salt: u64) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let bits = mix(salt ^ ((r as u64) << 40) ^ i as u64);
            let mag = ((bits >> 8) % 2000) as f32 / 7.0 - 140.0;
            mag * 10f32.powi((bits % 7) as i32 - 3)
        })
        .collect()
}

/// The serial left-to-right `f32` sum in rank order, and the f64 sum with its bound.
fn reference(n: usize, len: usize, salt: u64) -> (Vec<f32>, Vec<f64>, Vec<f64>) {
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| input(r, len, salt)).collect();
    let serial = (0..len)
        .map(|i| inputs[1..].iter().fold(inputs[0][i], |a, x| a + x[i]))
        .collect();
    let exact = (0..len)
        .map(|i| inputs.iter().map(|x| f64::from(x[i])).sum())
        .collect();
    let bound = (0..len)
        .map(|i| {
            let abs: f64 = inputs.iter().map(|x| f64::from(x[i]).abs()).sum();
            n as f64 * f64::from(f32::EPSILON) * abs
        })
        .collect();
    (serial, exact, bound)
}

fn check_sums(n: usize, tcp: bool) {
    let results = world(n, tcp, cfg(n, Transport::Shm), move |c| {
        let mut out = Vec::new();
        for (k, &len) in LENGTHS.iter().enumerate() {
            let mut buf = input(c.rank(), len, k as u64);
            c.all_reduce_sum(&mut buf)?;
            out.push(buf);
        }
        Ok((out, c.stats()))
    });
    for (k, &len) in LENGTHS.iter().enumerate() {
        let (serial, exact, bound) = reference(n, len, k as u64);
        for (r, (got, _)) in results.iter().enumerate() {
            let got = &got[k];
            for i in 0..len {
                assert_eq!(
                    got[i].to_bits(),
                    serial[i].to_bits(),
                    "n {n} len {len} rank {r} [{i}]: {} vs serial {}",
                    got[i],
                    serial[i]
                );
                let err = (f64::from(got[i]) - exact[i]).abs();
                assert!(err <= bound[i], "n {n} len {len} [{i}]: error {err}");
            }
        }
    }
    let floats: usize = LENGTHS.iter().sum();
    for (_, stats) in &results {
        let want = if n > 1 { 4 * floats as u64 } else { 0 };
        assert_eq!(stats.shm_bytes, want, "n {n}: bytes through shared memory");
    }
}

#[test]
fn sums_are_the_serial_rank_order_sum_on_every_rank_in_memory() {
    for n in 1..=5 {
        check_sums(n, false);
    }
}

#[test]
fn sums_are_the_serial_rank_order_sum_on_every_rank_over_tcp_rendezvous() {
    for n in [2, 3, 4] {
        check_sums(n, true);
    }
}
