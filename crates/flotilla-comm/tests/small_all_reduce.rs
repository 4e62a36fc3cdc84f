//! The small-message all-reduce (recursive doubling, `CommConfig::small_all_reduce_bytes`):
//! the serial sum within f32 rounding, bit-identical on every rank, on worlds of 1 to 7
//! ranks (powers of two and the fold-in/fold-out of the others), in-memory and over
//! 127.0.0.1; bf16 on the wire; a peer that dies mid-operation named by the survivors.

use std::net::TcpListener;
use std::sync::Arc;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use flotilla_comm::{CommConfig, CommError, Communicator, ProcessGroup, Transport, WireFormat};

const TEST_DEADLINE: Duration = Duration::from_secs(30);

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

/// Runs `body` on every rank of an `n`-rank world built from `c` (with its rank), each rank
/// a thread; `tcp` picks sockets over loopback, else in-memory links.
fn world<T, F>(n: usize, tcp: bool, c: CommConfig, body: F) -> Vec<Result<T, CommError>>
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
        let comms = Communicator::in_memory(n, c).expect("in-memory world");
        for (r, comm) in comms.into_iter().enumerate() {
            let (tx, body) = (tx.clone(), body.clone());
            thread::spawn(move || {
                let _ = tx.send((r, body(comm)));
            });
        }
    }
    let deadline = Instant::now() + TEST_DEADLINE;
    let mut out: Vec<Option<Result<T, CommError>>> = (0..n).map(|_| None).collect();
    for _ in 0..n {
        let left = deadline.saturating_duration_since(Instant::now());
        let (r, res) = rx.recv_timeout(left).expect("test world hung");
        out[r] = Some(res);
    }
    out.into_iter().map(|r| r.expect("result")).collect()
}

fn ok<T>(v: Vec<Result<T, CommError>>) -> Vec<T> {
    v.into_iter()
        .enumerate()
        .map(|(r, x)| x.unwrap_or_else(|e| panic!("rank {r}: {e}")))
        .collect()
}

/// SplitMix64: deterministic pseudo-random bits.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Rank `r`'s element `i` of case `case`: in [-4, 4), with bits below f32's precision in
/// any sum, so the order of additions shows in the result's last bits.
fn value(case: usize, r: usize, i: usize) -> f32 {
    let bits = mix(((case as u64) << 40) ^ ((r as u64) << 24) ^ i as u64);
    (bits >> 40) as f32 / (1u64 << 24) as f32 * 8.0 - 4.0
}

/// Lengths of the cases on `n` ranks: 0, 1, fewer than `n`, random ones up to the threshold.
fn lengths(n: usize) -> Vec<usize> {
    let mut v = vec![0, 1, n.saturating_sub(1), n + 1, SMALL / 4];
    v.extend((0..6).map(|k| (mix((n * 100 + k) as u64) % (SMALL as u64 / 4)) as usize));
    v
}

/// All-reduces every case of [`lengths`] on `n` ranks; checks each rank against the serial
/// sum (within `tolerance` times the sum of magnitudes), every rank's bits against rank
/// 0's, and that each case took the doubling's frames, not the ring's.
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
    let steps = usize::BITS - 1 - n.leading_zeros();
    for (case, &len) in lens.iter().enumerate() {
        for (r, outs) in res.iter().enumerate() {
            let (got, frames) = &outs[case];
            let first_diff = got
                .iter()
                .zip(&res[0][case].0)
                .position(|(a, b)| a.to_bits() != b.to_bits());
            assert_eq!(
                first_diff, None,
                "n {n} len {len}: rank {r} differs from rank 0"
            );
            // Doubling: one frame per step (two for a rank of the fold), none when empty.
            let most = if len == 0 || n == 1 {
                0
            } else {
                steps as u64 + 1
            };
            assert!(*frames <= most, "n {n} len {len} rank {r}: {frames} frames");
            for (i, &g) in got.iter().enumerate() {
                let exact: f64 = (0..n).map(|q| value(case, q, i) as f64).sum();
                let mag: f64 = (0..n).map(|q| (value(case, q, i) as f64).abs()).sum();
                let bound = tolerance * mag + 1e-30;
                assert!(
                    (g as f64 - exact).abs() <= bound,
                    "n {n} len {len} rank {r} element {i}: {g} vs {exact} (bound {bound})"
                );
            }
        }
    }
}

/// f32 rounding of `n - 1` additions: at most `(n - 1) * 2^-24` of the magnitudes' sum.
fn f32_tolerance(n: usize) -> f64 {
    (n.max(2) - 1) as f64 * 2f64.powi(-24)
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
        let t = Instant::now();
        let res = world(
            n,
            true,
            cfg(n).with_timeout(Duration::from_secs(8)),
            move |c| {
                let mut buf = vec![1.0f32; 1000];
                c.all_reduce_sum(&mut buf)?;
                if c.rank() == dead {
                    return Ok(()); // dropped: its sockets close
                }
                thread::sleep(Duration::from_millis(100));
                let r = c.all_reduce_sum(&mut buf);
                if r.is_err() {
                    // A failed rank lives on a moment (reporting, as a process would), so its
                    // abort notice, naming the dead rank, reaches the others before its close.
                    thread::sleep(Duration::from_millis(500));
                }
                r
            },
        );
        assert!(t.elapsed() < Duration::from_secs(6), "{:?}", t.elapsed());
        for (r, out) in res.iter().enumerate().filter(|&(r, _)| r != dead) {
            let e = out.as_ref().expect_err("a survivor must fail");
            assert!(
                e.to_string().contains(&format!("rank {dead}")),
                "n {n}, rank {r}: {e}"
            );
        }
    }
}
