//! End-to-end tests: every rank is a thread with its own TcpGroup over 127.0.0.1, with
//! `transport: tcp` (the ring, the doubling and the wire; `tests/shm.rs` has the shared
//! memory that `auto` picks for ranks of one host).

use std::net::TcpListener;
use std::sync::Arc;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use flotilla_tcp::{
    CommConfig, CommError, CommStats, Compression, ProcessGroup, RendezvousError, Secret, TcpGroup,
    Transport, WireFormat,
};

/// Upper bound for any single test world.
const TEST_DEADLINE: Duration = Duration::from_secs(25);

/// A free port on 127.0.0.1 plus the listener holding it (for rank 0).
fn master_listener() -> (TcpListener, u16) {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = l.local_addr().expect("addr").port();
    (l, port)
}

/// A rank of the tests' TCP worlds, with the tests' secret (a TCP rank refuses without one).
fn base(rank: Option<usize>, n: usize, port: u16) -> CommConfig {
    CommConfig::new(rank, n)
        .with_secret(secret("flotilla-test"))
        .with_master("127.0.0.1", port)
        .with_timeout(Duration::from_secs(10))
        .with_join_timeout(Duration::from_secs(10))
        .with_transport(Transport::Tcp)
}

/// Runs `procs` (one per process: its config) as threads; rank 0 (the config with
/// `rank == Some(0)`) gets a pre-bound listener. Returns each process's result, in order.
fn run_procs<T, F>(procs: Vec<CommConfig>, body: F) -> Vec<Result<T, CommError>>
where
    T: Send + 'static,
    F: Fn(TcpGroup) -> Result<T, CommError> + Send + Sync + 'static,
{
    let (listener, port) = master_listener();
    let mut listener = Some(listener);
    let body = Arc::new(body);
    let (tx, rx) = mpsc::channel();
    let count = procs.len();
    for (i, mut cfg) in procs.into_iter().enumerate() {
        cfg.master_port = port;
        let l = if cfg.rank == Some(0) {
            listener.take()
        } else {
            None
        };
        let (tx, body) = (tx.clone(), body.clone());
        thread::spawn(move || {
            let comm = match l {
                Some(l) => TcpGroup::connect_with_listener(cfg, l),
                None => TcpGroup::connect(cfg),
            };
            let r = comm.and_then(|c| body(c));
            let _ = tx.send((i, r));
        });
    }
    drop(listener);
    let deadline = Instant::now() + TEST_DEADLINE;
    let mut out: Vec<Option<Result<T, CommError>>> = (0..count).map(|_| None).collect();
    for _ in 0..count {
        let left = deadline.saturating_duration_since(Instant::now());
        let (i, r) = rx
            .recv_timeout(left)
            .expect("test world did not finish in time (hang)");
        out[i] = Some(r);
    }
    out.into_iter()
        .map(|r| r.expect("missing result"))
        .collect()
}

/// `n` ranks with explicit ranks and `tweak` applied to every config.
fn run_world<T, F>(
    n: usize,
    tweak: impl Fn(CommConfig) -> CommConfig,
    body: F,
) -> Vec<Result<T, CommError>>
where
    T: Send + 'static,
    F: Fn(TcpGroup) -> Result<T, CommError> + Send + Sync + 'static,
{
    run_procs((0..n).map(|r| tweak(base(Some(r), n, 0))).collect(), body)
}

fn all_ok<T>(v: Vec<Result<T, CommError>>) -> Vec<T> {
    v.into_iter()
        .enumerate()
        .map(|(i, r)| r.unwrap_or_else(|e| panic!("process {i} failed: {e}")))
        .collect()
}

/// Small integers: every partial sum is exact in f32 (and in bf16 when below 256).
fn value(rank: usize, i: usize) -> f32 {
    ((i * 7 + rank * 13) % 17) as f32 - 8.0
}

/// All-reduces buffers of `lens` on `n` ranks and checks them against the serial sum;
/// returns each rank's traffic counters.
fn check_all_reduce(
    n: usize,
    lens: &[usize],
    tweak: fn(CommConfig) -> CommConfig,
) -> Vec<CommStats> {
    let lens_owned = lens.to_vec();
    let results = all_ok(run_world(n, tweak, move |c| {
        let mut outs = Vec::new();
        for &len in &lens_owned {
            let mut buf: Vec<f32> = (0..len).map(|i| value(c.rank(), i)).collect();
            c.all_reduce_sum(&mut buf)?;
            outs.push(buf);
        }
        Ok((outs, c.stats()))
    }));
    for (li, &len) in lens.iter().enumerate() {
        let expected: Vec<f32> = (0..len)
            .map(|i| (0..n).map(|r| value(r, i)).sum())
            .collect();
        for (rank, (outs, _)) in results.iter().enumerate() {
            assert!(
                outs[li] == expected,
                "world {n} len {len}: rank {rank} differs from the serial sum"
            );
        }
    }
    results.into_iter().map(|(_, stats)| stats).collect()
}

#[test]
fn all_reduce_matches_serial_sum_for_worlds_1_to_5() {
    let lens = [0, 1, 7, 1_000_003, 5, 64 * 1024 + 3];
    let handles: Vec<_> = (1..=5)
        .map(|n| {
            thread::spawn(move || check_all_reduce(n, &lens, |c| c.with_chunk_bytes(64 << 10)))
        })
        .collect();
    for h in handles {
        h.join().expect("world panicked");
    }
}

#[test]
fn all_reduce_bf16_wire_and_lz4() {
    // Sums of at most 4 values in -8..=8 are exactly representable in bf16.
    check_all_reduce(4, &[0, 3, 100_001], |c| {
        c.with_wire_format(WireFormat::Bf16)
            .with_chunk_bytes(16 << 10)
    });
    // lz4 really engages (the values repeat every 17 elements), on every rank, and sends
    // fewer bytes than the same reduction without it, which compresses nothing.
    let lz4 = check_all_reduce(3, &[10, 300_000], |c| c.with_compression(Compression::Lz4));
    let plain = check_all_reduce(3, &[10, 300_000], |c| c);
    for (rank, (z, p)) in lz4.iter().zip(&plain).enumerate() {
        assert!(
            z.frames_compressed > 0 && p.frames_compressed == 0,
            "rank {rank}: {} frames compressed with lz4, {} without",
            z.frames_compressed,
            p.frames_compressed
        );
        assert!(
            z.bytes_sent < p.bytes_sent / 2,
            "rank {rank}: lz4 sent {} bytes, uncompressed {}",
            z.bytes_sent,
            p.bytes_sent
        );
    }
}

#[test]
fn bf16_wire_stays_within_its_rounding_bound_and_sends_half_the_bytes() {
    // Values that bf16 cannot represent exactly: the result is not the f32 sum, but each
    // element stays within bf16's rounding of every partial sum, and half the bytes move.
    let n = 3;
    let len = 50_000;
    let x = |rank: usize, i: usize| (i as f32 * 0.0137 + rank as f32 * 0.71).sin() * 3.3;
    let run = |format: WireFormat| {
        all_ok(run_world(
            n,
            move |c| c.with_wire_format(format),
            move |c| {
                let mut buf: Vec<f32> = (0..len).map(|i| x(c.rank(), i)).collect();
                c.all_reduce_sum(&mut buf)?;
                Ok((buf, c.stats().bytes_sent))
            },
        ))
    };
    let (f32_run, bf16_run) = (run(WireFormat::F32), run(WireFormat::Bf16));
    let mut inexact = 0;
    for i in 0..len {
        let exact: f64 = (0..n).map(|r| x(r, i) as f64).sum();
        let magnitude: f64 = (0..n).map(|r| (x(r, i) as f64).abs()).sum();
        let got = bf16_run[0].0[i] as f64;
        // n roundings to bf16 (8 significant bits: unit roundoff 2^-8), each of a partial sum
        // no larger than the sum of magnitudes.
        let bound = n as f64 * magnitude * 2f64.powi(-8) + 1e-6;
        assert!(
            (got - exact).abs() <= bound,
            "element {i}: bf16 sum {got} vs exact {exact}, bound {bound}"
        );
        if bf16_run[0].0[i] != f32_run[0].0[i] {
            inexact += 1;
        }
    }
    assert!(
        inexact > len / 2,
        "only {inexact} elements differ from the f32 sum"
    );
    for (rank, ((_, b16), (_, b32))) in bf16_run.iter().zip(&f32_run).enumerate() {
        let ratio = *b16 as f64 / *b32 as f64;
        assert!(
            (0.45..0.6).contains(&ratio),
            "rank {rank}: bf16 sent {b16} bytes, f32 {b32} (ratio {ratio:.3})"
        );
    }
}

#[test]
fn bf16_results_are_bit_identical_across_ranks() {
    let res = all_ok(run_world(
        3,
        |c| c.with_wire_format(WireFormat::Bf16),
        |c| {
            let mut buf: Vec<f32> = (0..10_000)
                .map(|i| (i as f32 * 0.001 + c.rank() as f32).sin())
                .collect();
            c.all_reduce_sum(&mut buf)?;
            Ok(buf.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
        },
    ));
    assert!(res.iter().all(|r| *r == res[0]));
}

#[test]
fn async_buckets_in_flight_keep_issue_order() {
    let n = 3;
    let sizes = [1000usize, 17, 250_000, 0, 4096];
    let res = all_ok(run_world(
        n,
        |c| c.with_chunk_bytes(32 << 10),
        move |c| {
            let r = c.rank();
            let mut pending: Vec<_> = sizes
                .iter()
                .enumerate()
                .map(|(b, &len)| c.all_reduce_start((0..len).map(|i| value(r + b, i)).collect()))
                .collect();
            // A blocking collective issued while buckets are in flight runs after them.
            let gathered = c.all_gather_u64(r as u64 * 10)?;
            let mut extra = vec![r as f32; 33];
            c.all_reduce_sum(&mut extra)?;
            pending.push(c.all_reduce_start(vec![1.0; 5]));
            // Wait in reverse order.
            let mut outs: Vec<Vec<f32>> = Vec::new();
            while let Some(p) = pending.pop() {
                outs.push(p.wait()?);
            }
            outs.reverse();
            Ok((outs, gathered, extra))
        },
    ));
    for (outs, gathered, extra) in res {
        assert_eq!(gathered, vec![0, 10, 20]);
        assert_eq!(extra, vec![3.0; 33]);
        for (b, &len) in sizes.iter().enumerate() {
            let expected: Vec<f32> = (0..len)
                .map(|i| (0..n).map(|r| value(r + b, i)).sum())
                .collect();
            assert_eq!(outs[b], expected, "bucket {b}");
        }
        assert_eq!(outs[sizes.len()], vec![3.0; 5]);
    }
}

#[test]
fn broadcast_barrier_all_gather_p2p_and_stats() {
    let n = 4;
    let res = all_ok(run_world(
        n,
        |c| c.with_chunk_bytes(4096),
        |c| {
            let r = c.rank();
            c.barrier()?;
            let mut f: Vec<f32> = if r == 2 {
                (0..10_001).map(|i| i as f32).collect()
            } else {
                vec![-1.0; 10_001]
            };
            c.broadcast_f32(&mut f, 2)?;
            let mut b: Vec<u8> = if r == 1 {
                (0..20_000u32).map(|i| (i % 251) as u8).collect()
            } else {
                vec![9; r]
            };
            c.broadcast_bytes(&mut b, 1, 20_000)?;
            let mut empty = if r == 3 { Vec::new() } else { vec![1u8; 3] };
            c.broadcast_bytes(&mut empty, 3, 0)?;
            let g = c.all_gather_u64(1000 + r as u64)?;
            // Point-to-point ring of messages.
            let n = c.size();
            c.send((r + 1) % n, 0, format!("hello from {r}").as_bytes())?;
            let msg = c.recv((r + n - 1) % n, 0, Instant::now() + Duration::from_secs(10))?;
            c.barrier()?;
            Ok((f, b, empty, g, msg, c.stats()))
        },
    ));
    for (r, (f, b, empty, g, msg, stats)) in res.into_iter().enumerate() {
        assert!(
            f.iter().enumerate().all(|(i, &x)| x == i as f32),
            "rank {r} broadcast_f32"
        );
        assert_eq!(
            b,
            (0..20_000u32).map(|i| (i % 251) as u8).collect::<Vec<_>>()
        );
        assert!(empty.is_empty());
        assert_eq!(g, vec![1000, 1001, 1002, 1003]);
        assert_eq!(
            String::from_utf8(msg).unwrap(),
            format!("hello from {}", (r + n - 1) % n)
        );
        assert!(stats.bytes_sent > 0 && stats.frames_received > 0 && stats.collectives == 6);
    }
}

#[test]
fn unranked_processes_get_assigned_ranks() {
    let procs = vec![base(None, 3, 0), base(Some(0), 3, 0), base(None, 3, 0)];
    let res = all_ok(run_procs(procs, |c| c.all_gather_u64(c.rank() as u64)));
    for g in res {
        assert_eq!(g, vec![0, 1, 2]);
    }
}

#[test]
fn rendezvous_missing_rank_times_out_naming_it() {
    let t = Instant::now();
    let procs = vec![
        base(Some(0), 3, 0).with_join_timeout(Duration::from_millis(1500)),
        base(Some(1), 3, 0).with_join_timeout(Duration::from_millis(1500)),
    ];
    let res = run_procs(procs, |_c| Ok(()));
    assert!(
        t.elapsed() < Duration::from_secs(6),
        "took {:?}",
        t.elapsed()
    );
    for r in res {
        let e = r.expect_err("rendezvous must fail");
        let msg = e.to_string();
        assert!(
            matches!(
                e,
                CommError::Rendezvous(RendezvousError::JoinTimeout { .. })
            ),
            "{msg}"
        );
        assert!(
            msg.contains("rank(s) 2 never joined (2 of 3 present)"),
            "{msg}"
        );
    }
}

#[test]
fn unreachable_master_fails_within_join_timeout() {
    let (l, port) = master_listener();
    drop(l);
    let t = Instant::now();
    let e = TcpGroup::connect(base(Some(1), 2, port).with_join_timeout(Duration::from_millis(600)))
        .unwrap_err();
    assert!(matches!(e, CommError::MasterUnreachable { .. }), "{e}");
    assert!(t.elapsed() < Duration::from_secs(3));
}

/// Rank 0's error when a join was refused and the job then timed out waiting for that rank.
fn assert_refused_at_timeout(e: &CommError, reason: &str) {
    let msg = e.to_string();
    assert!(
        matches!(
            e,
            CommError::Rendezvous(RendezvousError::JoinTimeout { refused, .. }) if !refused.is_empty()
        ),
        "{msg}"
    );
    assert!(
        msg.contains("refused meanwhile") && msg.contains(reason),
        "{msg}"
    );
}

/// A rank with another config is told so at once (naming it, but not rank 0's hash: a
/// refused peer learns nothing of the job); rank 0 refuses it, keeps waiting for the real
/// rank 2, and at its deadline names the refused join.
#[test]
fn config_hash_mismatch_is_refused_and_named() {
    let join = Duration::from_secs(2);
    let procs = vec![
        base(Some(0), 3, 0)
            .with_join_timeout(join)
            .with_config_hash(0xAAAA),
        base(Some(1), 3, 0)
            .with_join_timeout(join)
            .with_config_hash(0xAAAA),
        base(Some(2), 3, 0)
            .with_join_timeout(join)
            .with_config_hash(0xBBBB),
    ];
    let res = run_procs(procs, |_c| Ok(()));
    let e = res[2].as_ref().expect_err("the odd rank must fail");
    assert!(
        matches!(e, CommError::Rendezvous(RendezvousError::ConfigHashMismatch { peer, .. }) if peer.rank == Some(2)),
        "{e}"
    );
    assert!(
        matches!(
            e,
            CommError::Rendezvous(RendezvousError::ConfigHashMismatch {
                expected: None,
                got: 0xBBBB,
                ..
            })
        ),
        "{e:?}"
    );
    assert!(
        e.to_string()
            .contains("has config hash 0x000000000000bbbb but rank 0 has another one")
            && !e.to_string().contains("aaaa"),
        "{e}"
    );
    for r in &res[..2] {
        let e = r.as_ref().expect_err("the others time out");
        assert_refused_at_timeout(e, "a join: rank 2 (127.0.0.1:");
        assert_refused_at_timeout(e, "has config hash 0x000000000000bbbb but rank 0 has");
    }
}

/// A secret named `s` (long enough to be accepted).
fn secret(s: &str) -> Option<Secret> {
    Some(Secret::new(format!("{s}-0123456789abcdef").into_bytes()).expect("secret"))
}

/// A rank that opted out of authentication (neither a secret nor TLS).
fn insecure(c: CommConfig) -> CommConfig {
    c.with_secret(None).with_insecure(true)
}

/// A rank with another secret fails authentication against rank 0 and is told so, naming
/// rank 0; rank 0 refuses it, keeps waiting, and at its deadline names the refusal. Neither
/// error shows either secret.
#[test]
fn wrong_secret_is_refused_at_the_rendezvous_and_named() {
    let join = Duration::from_secs(2);
    let procs = vec![
        base(Some(0), 2, 0)
            .with_join_timeout(join)
            .with_secret(secret("cluster-secret-A")),
        base(Some(1), 2, 0)
            .with_join_timeout(join)
            .with_secret(secret("wrong-secret-B")),
    ];
    let res = run_procs(procs, |_c| Ok(()));
    let e = res[1].as_ref().expect_err("must fail");
    assert!(
        matches!(e, CommError::Rendezvous(RendezvousError::AuthFailed { peer, .. }) if peer.rank == Some(0)),
        "{e}"
    );
    let msg = e.to_string();
    assert!(
        msg.contains("authentication failed: rank 0 (127.0.0.1:")
            && msg.contains("does not share this job's secret"),
        "{msg}"
    );
    let e0 = res[0].as_ref().expect_err("rank 0 times out");
    assert_refused_at_timeout(e0, "authentication failed: unranked process at 127.0.0.1:");
    for e in [e, e0] {
        let text = format!("{e} {e:?}");
        assert!(
            !text.contains("secret-A") && !text.contains("secret-B"),
            "secret leaked: {text}"
        );
    }
}

/// A secret on one side only (the other said `insecure`): the side without one is told what
/// to set.
#[test]
fn a_secret_on_one_side_only_is_refused_and_named() {
    let join = Duration::from_millis(1500);
    let procs = vec![
        base(Some(0), 2, 0)
            .with_join_timeout(join)
            .with_secret(secret("s")),
        insecure(base(Some(1), 2, 0).with_join_timeout(join)),
    ];
    let res = run_procs(procs, |_c| Ok(()));
    let e = res[1].as_ref().expect_err("no secret");
    assert!(
        matches!(
            e,
            CommError::Rendezvous(RendezvousError::AuthRequired { .. })
        ),
        "{e}"
    );
    assert!(e.to_string().contains("FLOTILLA_SECRET"), "{e}");
    assert_refused_at_timeout(res[0].as_ref().expect_err("rank 0"), "did not authenticate");
    let procs = vec![
        insecure(base(Some(0), 2, 0).with_join_timeout(join)),
        base(Some(1), 2, 0)
            .with_join_timeout(join)
            .with_secret(secret("s")),
    ];
    let res = run_procs(procs, |_c| Ok(()));
    let e = res[1].as_ref().expect_err("rank 0 has none");
    assert!(
        matches!(
            e,
            CommError::Rendezvous(RendezvousError::AuthNotConfigured { .. })
        ),
        "{e}"
    );
}

/// Ranks sharing the secret form a job: the rendezvous and every mesh connection
/// authenticate, and collectives run.
#[test]
fn the_right_secret_forms_a_job() {
    let res = run_world(
        4,
        |c| c.with_secret(secret("shared")),
        |c| c.all_gather_u64(c.rank() as u64 * 10),
    );
    for r in res {
        assert_eq!(r.expect("job"), vec![0, 10, 20, 30]);
    }
}

/// A stranger with a wrong secret knocking at rank 0 first never breaks an authenticated
/// job; it fails, and the real rank joins.
#[test]
fn a_stranger_with_a_wrong_secret_never_breaks_a_job() {
    let (l, port) = master_listener();
    let cfg = base(Some(0), 2, port).with_secret(secret("right"));
    let master = thread::spawn(move || {
        TcpGroup::connect_with_listener(cfg, l).and_then(|c| c.all_gather_u64(1))
    });
    let stranger = TcpGroup::connect(base(None, 2, port).with_secret(secret("guess")));
    assert!(
        matches!(
            stranger,
            Err(CommError::Rendezvous(RendezvousError::AuthFailed { .. }))
        ),
        "{:?}",
        stranger.err()
    );
    let rank1 = TcpGroup::connect(base(Some(1), 2, port).with_secret(secret("right")))
        .and_then(|c| c.all_gather_u64(2));
    assert_eq!(rank1.expect("rank 1"), vec![1, 2]);
    assert_eq!(
        master.join().expect("no panic").expect("rank 0"),
        vec![1, 2]
    );
}

/// Copies one direction of a proxied connection, recording what passed.
fn pump(
    mut from: std::net::TcpStream,
    mut to: std::net::TcpStream,
    record: Option<Arc<std::sync::Mutex<Vec<u8>>>>,
) {
    use std::io::{Read, Write};
    let mut buf = [0u8; 4096];
    while let Ok(n) = from.read(&mut buf) {
        if n == 0 || to.write_all(&buf[..n]).is_err() {
            break;
        }
        if let Some(r) = &record {
            r.lock().expect("lock").extend_from_slice(&buf[..n]);
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Write);
}

/// An eavesdropper records everything rank 1 sent to rank 0 in a good job (through a
/// proxy), then replays it to a new rank 0 with the same secret: the fresh nonce of rank 0
/// makes the recorded proof worthless, so the replay is refused and named.
#[test]
fn a_replayed_handshake_is_refused() {
    use std::io::Write;
    let (l, port) = master_listener();
    let proxy = TcpListener::bind("127.0.0.1:0").expect("bind");
    let proxy_port = proxy.local_addr().expect("addr").port();
    let recorded = Arc::new(std::sync::Mutex::new(Vec::new()));
    let rec = recorded.clone();
    let relay = thread::spawn(move || {
        let (client, _) = proxy.accept().expect("accept");
        let server = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
        let (c2, s2) = (
            client.try_clone().expect("clone"),
            server.try_clone().expect("clone"),
        );
        let up = thread::spawn(move || pump(client, server, Some(rec)));
        pump(s2, c2, None);
        let _ = up.join();
    });
    let cfg = base(Some(0), 2, port).with_secret(secret("right"));
    let master = thread::spawn(move || {
        TcpGroup::connect_with_listener(cfg, l).and_then(|c| c.all_gather_u64(1))
    });
    let rank1 = TcpGroup::connect(base(Some(1), 2, proxy_port).with_secret(secret("right")))
        .and_then(|c| {
            let r = c.all_gather_u64(2);
            drop(c);
            r
        });
    assert_eq!(rank1.expect("rank 1 through the proxy"), vec![1, 2]);
    assert_eq!(
        master.join().expect("no panic").expect("rank 0"),
        vec![1, 2]
    );
    let _ = relay.join();
    let bytes = recorded.lock().expect("lock").clone();
    assert!(bytes.len() > 100, "recorded {} bytes", bytes.len());

    let (l, port) = master_listener();
    let cfg = base(Some(0), 2, port)
        .with_secret(secret("right"))
        .with_join_timeout(Duration::from_millis(1500));
    let master = thread::spawn(move || TcpGroup::connect_with_listener(cfg, l).map(|_| ()));
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    let _ = s.write_all(&bytes);
    let e = master
        .join()
        .expect("no panic")
        .expect_err("the replay must not join");
    assert_refused_at_timeout(&e, "does not share this job's secret");
    assert!(
        e.to_string()
            .contains(&s.local_addr().expect("addr").to_string()),
        "the refusal names the replaying connection: {e}"
    );
}

#[test]
fn duplicate_rank_is_refused() {
    let join = Duration::from_secs(2);
    let procs = vec![
        base(Some(0), 3, 0).with_join_timeout(join),
        base(Some(1), 3, 0).with_join_timeout(join),
        base(Some(1), 3, 0).with_join_timeout(join),
    ];
    let res = run_procs(procs, |_c| Ok(()));
    let duplicates = res
        .iter()
        .filter(|r| {
            matches!(
                r,
                Err(CommError::Rendezvous(RendezvousError::DuplicateRank { .. }))
            )
        })
        .count();
    assert_eq!(duplicates, 1, "{res:?}");
    let e0 = res[0]
        .as_ref()
        .expect_err("rank 0 times out waiting for rank 2");
    assert_refused_at_timeout(e0, "a join: rank 1 (127.0.0.1:");
    assert_refused_at_timeout(e0, ") claims a rank already taken by 127.0.0.1:");
}

/// Strangers at rank 0's port — random bytes, an HTTP request, a frame of an unknown wire
/// version, an oversized length, a silent connection — are logged and dropped; the real
/// ranks still form the job. With no real rank, rank 0's deadline names what it refused.
#[test]
fn strangers_at_the_rendezvous_never_break_a_job() {
    use flotilla_tcp::frame::FrameHeader;
    use std::io::Write;
    let header = |corrupt: Option<usize>| {
        let mut h = FrameHeader {
            channel: 0,
            flags: 0,
            op: 0,
            group: 0,
            seq: 0,
            tag: 0,
            len: 16,
        }
        .encode();
        match corrupt {
            Some(i) => h[i] = 7,
            None => h[28..32].copy_from_slice(&u32::MAX.to_le_bytes()),
        }
        h.to_vec()
    };
    let garbage: Vec<Vec<u8>> = vec![
        (0..200u32).map(|i| (i * 7919 % 251) as u8).collect(),
        b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
        header(Some(1)),
        header(None),
        Vec::new(),
    ];
    let (l, port) = master_listener();
    let cfg = base(Some(0), 2, port).with_join_timeout(Duration::from_secs(10));
    let master = thread::spawn(move || {
        TcpGroup::connect_with_listener(cfg, l).and_then(|c| c.all_gather_u64(7))
    });
    let mut strangers = Vec::new();
    for bytes in &garbage {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.write_all(bytes).unwrap();
        strangers.push(s); // kept open: a silent or half-talking peer must not block either
    }
    thread::sleep(Duration::from_millis(300));
    let rank1 = TcpGroup::connect(base(Some(1), 2, port)).and_then(|c| c.all_gather_u64(9));
    assert_eq!(
        rank1.expect("rank 1 joins despite the strangers"),
        vec![7, 9]
    );
    assert_eq!(
        master.join().expect("no panic").expect("rank 0"),
        vec![7, 9]
    );

    // Nobody real comes: the deadline names the refused connections and who they were.
    let (l, port) = master_listener();
    let cfg = base(Some(0), 2, port).with_join_timeout(Duration::from_millis(1500));
    let master = thread::spawn(move || TcpGroup::connect_with_listener(cfg, l).map(|_| ()));
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.write_all(&header(Some(1))).unwrap();
    let e = master.join().expect("no panic").expect_err("must time out");
    assert_refused_at_timeout(&e, "unsupported wire version");
    assert!(
        e.to_string().contains(&s.local_addr().unwrap().to_string()),
        "the refusal names the connection: {e}"
    );
}

#[test]
fn dead_peer_mid_collective_fails_others_naming_it() {
    let t = Instant::now();
    let res = run_world(
        3,
        |c| c.with_timeout(Duration::from_secs(8)),
        |c| {
            let mut buf = vec![1.0f32; 300_000];
            c.all_reduce_sum(&mut buf)?;
            if c.rank() == 2 {
                return Ok(()); // "dies": the communicator is dropped, sockets close
            }
            thread::sleep(Duration::from_millis(100));
            c.all_reduce_sum(&mut buf)?;
            Ok(())
        },
    );
    assert!(
        t.elapsed() < Duration::from_secs(6),
        "survivors must not wait for the timeout: {:?}",
        t.elapsed()
    );
    assert!(res[2].is_ok());
    for r in &res[..2] {
        let e = r.as_ref().expect_err("survivor must fail");
        assert!(e.to_string().contains("rank 2"), "{e}");
    }
}

#[test]
fn stuck_peer_times_out_naming_it_and_poisons() {
    let t = Instant::now();
    let res = run_world(
        2,
        |c| c.with_timeout(Duration::from_millis(700)),
        |c| {
            if c.rank() == 1 {
                thread::sleep(Duration::from_millis(1500));
            }
            let r1 = c.barrier();
            let r2 = c.barrier();
            Ok((r1, r2))
        },
    );
    assert!(t.elapsed() < Duration::from_secs(5));
    let (r1, r2) = res.into_iter().next().unwrap().unwrap();
    let e = r1.expect_err("rank 0 must time out");
    assert!(matches!(e, CommError::Timeout { peer: 1, .. }), "{e}");
    assert!(matches!(r2, Err(CommError::Poisoned(_))), "{r2:?}");
}

#[test]
fn mismatched_collectives_are_protocol_errors() {
    let res = run_world(
        2,
        |c| c,
        |c| {
            if c.rank() == 0 {
                c.barrier()
            } else {
                c.all_gather_u64(5).map(|_| ())
            }
        },
    );
    let errs: Vec<CommError> = res
        .into_iter()
        .map(|r| r.expect_err("mismatch must fail"))
        .collect();
    assert!(
        errs.iter().any(|e| matches!(e, CommError::Protocol { .. })),
        "{errs:?}"
    );
    // Different lengths in an all-reduce are caught as well.
    let res = run_world(
        2,
        |c| c,
        |c| {
            let mut buf = vec![1.0; 100 + c.rank()];
            c.all_reduce_sum(&mut buf)
        },
    );
    for r in res {
        let e = r.expect_err("length mismatch must fail");
        assert!(
            matches!(e, CommError::Protocol { .. } | CommError::Aborted { .. }),
            "{e}"
        );
    }
}

#[test]
fn broadcast_root_out_of_range_is_an_error() {
    let res = all_ok(run_world(
        1,
        |c| c,
        |c| {
            let mut v = vec![1.0f32];
            Ok(c.broadcast_f32(&mut v, 3).is_err())
        },
    ));
    assert!(res[0]);
}

#[test]
fn blocking_calls_inside_a_runtime_are_errors_not_panics() {
    let comm = TcpGroup::connect(CommConfig::new(Some(0), 1)).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(async {
        assert!(matches!(comm.barrier(), Err(CommError::InvalidArgument(_))));
        assert!(matches!(
            TcpGroup::connect(CommConfig::new(Some(0), 1)),
            Err(CommError::InvalidArgument(_))
        ));
    });
    // Still usable from a plain thread.
    let mut v = vec![2.0f32; 3];
    comm.all_reduce_sum(&mut v).unwrap();
    assert_eq!(v, vec![2.0; 3]);
}
