//! The hierarchical all-reduce on emulated hosts: ranks as threads over in-memory links,
//! each reporting the host key it is given (`TcpGroup::in_memory_on`), ranks of one key
//! sharing real segments. Bitwise the serial reference of the documented order (two hosts of
//! three ranks, so that an order of additions other than each host's left-to-right sum
//! shows in the bits: then the two added), every rank bit-identical, within
//! rounding of a serial sum for three hosts; the inter-host bytes of each run against the
//! flat algorithms' (measured, both runs); uneven hosts flat, bit for bit; buckets started
//! back to back (the non-blocking path) hierarchical too.

use std::sync::{Arc, mpsc};
use std::thread;
use std::time::{Duration, Instant};

use flotilla_group::{CommStats, ProcessGroup};

use crate::{CommConfig, Hierarchical, TcpGroup};

/// Each rank's result and its traffic during the all-reduces.
type Outcome = (Vec<Vec<u32>>, CommStats);

/// Rank `r`'s element `i` of case `case`: a full 24-bit significand at a scale from 2^-4
/// to 2^3, either sign, so that most sums of two round (values on one fixed grid would add
/// exactly, and every order of three would round once, alike): the order of additions
/// shows in the last bits.
fn value(case: usize, r: usize, i: usize) -> f32 {
    let mut z = ((case as u64) << 40) ^ ((r as u64) << 24) ^ i as u64;
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    let significand = 1.0 + (z >> 41) as f32 / (1u64 << 23) as f32;
    let scale = 2f32.powi((z & 7) as i32 - 4);
    let sign = if z & 8 == 0 { 1.0 } else { -1.0 };
    sign * significand * scale
}

fn cfg(h: Hierarchical) -> CommConfig {
    CommConfig::new(Some(0), 1)
        .with_timeout(Duration::from_secs(20))
        .with_shm_chunk_bytes(16 << 10)
        .with_hierarchical(h)
}

/// All-reduces each length of `lens` on a world whose rank `r` is on host `hosts[r]`;
/// returns every rank's results (as bits) and its traffic.
fn run(hosts: &[&str], c: CommConfig, lens: &[usize]) -> Vec<Outcome> {
    let keys = hosts.iter().map(|h| format!("host-{h}")).collect();
    let comms = TcpGroup::in_memory_on(keys, c).expect("world");
    let lens: Arc<[usize]> = lens.into();
    let (tx, rx) = mpsc::channel();
    for (r, comm) in comms.into_iter().enumerate() {
        let (tx, lens) = (tx.clone(), lens.clone());
        thread::spawn(move || {
            let before = comm.stats();
            let out = lens.iter().enumerate().map(|(case, &len)| {
                let mut buf: Vec<f32> = (0..len).map(|i| value(case, r, i)).collect();
                comm.all_reduce_sum(&mut buf)
                    .map(|()| buf.iter().map(|x| x.to_bits()).collect())
            });
            let out: Result<Vec<Vec<u32>>, _> = out.collect();
            let after = comm.stats();
            let traffic = CommStats {
                bytes_sent: after.bytes_sent - before.bytes_sent,
                bytes_sent_inter_host: after.bytes_sent_inter_host - before.bytes_sent_inter_host,
                shm_bytes: after.shm_bytes - before.shm_bytes,
                ..after
            };
            let _ = tx.send((r, out.map(|o| (o, traffic))));
        });
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut got: Vec<Option<Outcome>> = hosts.iter().map(|_| None).collect();
    for _ in hosts {
        let left = deadline.saturating_duration_since(Instant::now());
        let (r, res) = rx.recv_timeout(left).expect("world hung");
        got[r] = Some(res.unwrap_or_else(|e| panic!("rank {r}: {e}")));
    }
    got.into_iter().map(|o| o.expect("every rank")).collect()
}

/// Every rank's results are the same bits; returns rank 0's.
fn agreed(out: &[Outcome]) -> Vec<Vec<u32>> {
    for (r, (o, _)) in out.iter().enumerate() {
        assert!(o == &out[0].0, "rank {r} differs from rank 0");
    }
    out[0].0.clone()
}

/// Sizes that take each TCP algorithm between the hosts (doubling, Rabenseifner's, ring)
/// and lengths not divisible by the ranks per host.
const LENS: [usize; 5] = [0, 3, 1001, 200_003, 1_100_001];

fn small_thresholds(c: CommConfig) -> CommConfig {
    // Doubling to 64 KiB, Rabenseifner's to 1 MiB, the ring above (over the shard sizes).
    let mut c = c;
    c.small_all_reduce_bytes = 64 << 10;
    c.mid_all_reduce_bytes = 1 << 20;
    c
}

/// The reference of two hosts of three ranks (`[0, 2, 4]` and `[1, 3, 5]`): each host's
/// left-to-right sum in rank order, then the two added (a sum of two is the same bits in
/// either order, so three a host it takes for the order to show).
fn two_hosts_of_three(case: usize, i: usize) -> f32 {
    let host =
        |rs: [usize; 3]| value(case, rs[0], i) + value(case, rs[1], i) + value(case, rs[2], i);
    host([0, 2, 4]) + host([1, 3, 5])
}

#[test]
fn two_hosts_sum_each_host_in_rank_order_then_the_hosts_on_every_rank() {
    let hosts = ["a", "b", "a", "b", "a", "b"];
    let out = run(&hosts, small_thresholds(cfg(Hierarchical::Auto)), &LENS);
    let got = agreed(&out);
    for (case, bits) in got.iter().enumerate() {
        assert_eq!(bits.len(), LENS[case]);
        for (i, &x) in bits.iter().enumerate() {
            let want = two_hosts_of_three(case, i);
            assert_eq!(x, want.to_bits(), "case {case} element {i}");
        }
    }
    for (r, (_, s)) in out.iter().enumerate() {
        assert!(s.shm_bytes > 0, "rank {r} used no shared memory");
    }
}

#[test]
fn three_hosts_agree_bitwise_within_rounding_of_a_serial_sum() {
    let hosts = ["a", "a", "b", "b", "c", "c"];
    let out = run(&hosts, small_thresholds(cfg(Hierarchical::Auto)), &LENS);
    let got = agreed(&out);
    for (case, bits) in got.iter().enumerate() {
        assert_eq!(bits.len(), LENS[case]);
        for (i, &x) in bits.iter().enumerate() {
            let exact: f64 = (0..6).map(|r| f64::from(value(case, r, i))).sum();
            let mag: f64 = (0..6).map(|r| f64::from(value(case, r, i)).abs()).sum();
            let x = f64::from(f32::from_bits(x));
            assert!(
                (x - exact).abs() <= 5.0 * 2f64.powi(-24) * mag,
                "case {case} element {i}: {x} against {exact}"
            );
        }
    }
}

/// Inter-host bytes of the whole job, without frame headers' share (`frames` at most
/// 32 bytes each over `payload`): asserts they are `payload` within 1 %.
fn assert_bytes(out: &[Outcome], payload: f64, what: &str) -> f64 {
    let sent: u64 = out.iter().map(|(_, s)| s.bytes_sent_inter_host).sum();
    let x = sent as f64;
    assert!(
        x >= payload && x <= payload * 1.01,
        "{what}: {sent} B between hosts, {payload} B of payload expected"
    );
    x
}

#[test]
fn two_hosts_of_two_send_half_the_inter_host_bytes_of_flat_rabenseifner() {
    // 4 MiB: Rabenseifner's flat (a power of two, under 16 MiB); the hosts contiguous.
    let (hosts, len) = (["a", "a", "b", "b"], 1 << 20);
    let s = (len * 4) as f64;
    let hier = run(&hosts, cfg(Hierarchical::Auto), &[len]);
    let flat = run(&hosts, cfg(Hierarchical::Off), &[len]);
    // Hierarchical: 4 ranks x 2 (H-1)/H x S/k; flat: 4 ranks x S (halving and doubling
    // each cross once, on half the buffer).
    let h = assert_bytes(&hier, 4.0 * s / 2.0, "hierarchical");
    let f = assert_bytes(&flat, 4.0 * s, "flat");
    assert!((h / f - 0.5).abs() < 0.01, "{h} / {f}");
    for (r, (_, st)) in flat.iter().enumerate() {
        assert_eq!(st.shm_bytes, 0, "rank {r}: flat used shared memory");
    }
}

#[test]
fn two_hosts_of_two_send_two_thirds_of_a_flat_rings_inter_host_bytes() {
    // The ring: hosts contiguous, so 2 of its 4 links cross (2 (n-1)/n S each way on them).
    let (hosts, len) = (["a", "a", "b", "b"], 1 << 20);
    let s = (len * 4) as f64;
    let mut c = cfg(Hierarchical::Auto);
    (c.small_all_reduce_bytes, c.mid_all_reduce_bytes) = (0, 0);
    let hier = run(&hosts, c.clone(), &[len]);
    let flat = run(&hosts, c.with_hierarchical(Hierarchical::Off), &[len]);
    let h = assert_bytes(&hier, 2.0 * s, "hierarchical");
    let f = assert_bytes(&flat, 2.0 * 1.5 * s, "flat ring");
    assert!((h / f - 2.0 / 3.0).abs() < 0.01, "{h} / {f}");
}

#[test]
fn uneven_hosts_and_one_rank_per_host_stay_flat_bit_for_bit() {
    for hosts in [&["a", "a", "b"][..], &["a", "b", "c", "d"][..]] {
        let on = run(hosts, cfg(Hierarchical::Auto), &LENS);
        let off = run(hosts, cfg(Hierarchical::Off), &LENS);
        assert_eq!(agreed(&on), agreed(&off), "hosts {hosts:?}");
        let bytes = |o: &[Outcome]| -> Vec<u64> {
            o.iter().map(|(_, s)| s.bytes_sent_inter_host).collect()
        };
        assert_eq!(bytes(&on), bytes(&off), "hosts {hosts:?}");
        assert!(on.iter().all(|(_, s)| s.shm_bytes == 0), "hosts {hosts:?}");
    }
}

#[test]
fn buckets_started_back_to_back_are_hierarchical_and_in_order() {
    let hosts = ["a", "b", "a", "b", "a", "b"];
    let keys = hosts.iter().map(|h| format!("host-{h}")).collect();
    let comms = TcpGroup::in_memory_on(keys, cfg(Hierarchical::Auto)).expect("world");
    let lens = [1001usize, 300_001, 5];
    let (tx, rx) = mpsc::channel();
    for (r, comm) in comms.into_iter().enumerate() {
        let tx = tx.clone();
        thread::spawn(move || {
            let pending: Vec<_> = lens
                .iter()
                .enumerate()
                .map(|(b, &len)| {
                    let buf = (0..len).map(|i| value(b, r, i)).collect();
                    comm.all_reduce_bucket(buf, b)
                })
                .collect();
            let got: Result<Vec<Vec<f32>>, _> = pending.into_iter().map(|p| p.wait()).collect();
            let _ = tx.send((r, got, comm.stats()));
        });
    }
    for _ in hosts {
        let (r, got, stats) = rx.recv_timeout(Duration::from_secs(60)).expect("hung");
        let got = got.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert!(
            stats.shm_bytes > 0 && stats.bytes_sent_inter_host > 0,
            "rank {r}"
        );
        for (b, buf) in got.iter().enumerate() {
            assert_eq!(buf.len(), lens[b]);
            for (i, x) in buf.iter().enumerate() {
                let want = two_hosts_of_three(b, i);
                assert_eq!(
                    x.to_bits(),
                    want.to_bits(),
                    "rank {r} bucket {b} element {i}"
                );
            }
        }
    }
}
