//! What the all-reduce tests share: a world of ranks as threads (in-memory or over
//! 127.0.0.1, every wait bounded), deterministic values whose sums show the order of
//! additions, and the f32 rounding bound of a sum.

use std::net::TcpListener;
use std::sync::Arc;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use flotilla_tcp::{CommConfig, CommError, ProcessGroup, TcpGroup};

/// How long a test world may take before the test fails as hung.
pub const TEST_DEADLINE: Duration = Duration::from_secs(30);

/// Runs `body` on every rank of an `n`-rank world built from `c` (with its rank), each rank
/// a thread; `tcp` picks sockets over loopback, else in-memory links.
pub fn world<T, F>(n: usize, tcp: bool, c: CommConfig, body: F) -> Vec<Result<T, CommError>>
where
    T: Send + 'static,
    F: Fn(TcpGroup) -> Result<T, CommError> + Send + Sync + 'static,
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
            if c.secret.is_none() && c.tls.is_none() && !c.insecure {
                c.secret = Some(test_secret());
            }
            let (tx, body, l) = (tx.clone(), body.clone(), l.take().filter(|_| r == 0));
            thread::spawn(move || {
                let comm = match l {
                    Some(l) => TcpGroup::connect_with_listener(c, l),
                    None => TcpGroup::connect(c),
                };
                let _ = tx.send((r, comm.and_then(|c| body(c))));
            });
        }
    } else {
        let comms = TcpGroup::in_memory(n, c).expect("in-memory world");
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

/// The secret of the tests' TCP worlds (every rank the same; a TCP rank refuses without one).
pub fn test_secret() -> flotilla_tcp::Secret {
    flotilla_tcp::Secret::new(b"flotilla-test-secret-0123456789".to_vec()).expect("secret")
}

/// Every rank's result, or a panic naming the first rank that failed.
pub fn ok<T>(v: Vec<Result<T, CommError>>) -> Vec<T> {
    v.into_iter()
        .enumerate()
        .map(|(r, x)| x.unwrap_or_else(|e| panic!("rank {r}: {e}")))
        .collect()
}

/// SplitMix64: deterministic pseudo-random bits.
pub fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Rank `r`'s element `i` of case `case`: in [-4, 4), with bits below f32's precision in
/// any sum, so the order of additions shows in the result's last bits.
pub fn value(case: usize, r: usize, i: usize) -> f32 {
    let bits = mix(((case as u64) << 40) ^ ((r as u64) << 24) ^ i as u64);
    (bits >> 40) as f32 / (1u64 << 24) as f32 * 8.0 - 4.0
}

/// f32 rounding of `n - 1` additions: at most `(n - 1) * 2^-24` of the magnitudes' sum.
pub fn f32_tolerance(n: usize) -> f64 {
    (n.max(2) - 1) as f64 * 2f64.powi(-24)
}

/// A rank (`dead` of `n`, configured by `c`) that leaves after one all-reduce of `len`
/// values is named by every survivor of the next one, which fail within 6 s rather than at
/// the deadline.
pub fn dead_peer_is_named(n: usize, dead: usize, c: CommConfig, len: usize) {
    let t = Instant::now();
    let res = world(n, true, c, move |c| {
        let mut buf = vec![1.0f32; len];
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
    });
    assert!(t.elapsed() < Duration::from_secs(6), "{:?}", t.elapsed());
    for (r, out) in res.iter().enumerate().filter(|&(r, _)| r != dead) {
        let e = out.as_ref().expect_err("a survivor must fail");
        assert!(
            e.to_string().contains(&format!("rank {dead}")),
            "n {n}, rank {r}: {e}"
        );
    }
}

/// Asserts that `got`, rank `r`'s result of all-reducing case `case`'s values over `n` ranks,
/// is within `tolerance` (relative to the sum of magnitudes) of the exact serial sum.
pub fn assert_near_serial_sum(n: usize, case: usize, r: usize, got: &[f32], tolerance: f64) {
    for (i, &g) in got.iter().enumerate() {
        let exact: f64 = (0..n).map(|q| value(case, q, i) as f64).sum();
        let mag: f64 = (0..n).map(|q| (value(case, q, i) as f64).abs()).sum();
        let bound = tolerance * mag + 1e-30;
        assert!(
            (g as f64 - exact).abs() <= bound,
            "n {n} len {} rank {r} element {i}: {g} vs {exact} (bound {bound})",
            got.len()
        );
    }
}

/// The config of a rank this test binary started as a child process: `RANK` (unset: assigned),
/// `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT` as a launcher sets them, the environment's
/// secret, and the test's own settings of the transport (`CHILD_TIMEOUT_SECS`,
/// `CHILD_TRANSPORT`, `CHILD_HIERARCHICAL`, `CHILD_SHM_DIR`, `CHILD_SHM_CHUNK_BYTES`). A
/// program's settings are Flotilla's schema, read by `flotilla_train::program`, which this
/// crate's tests do not depend on.
#[allow(dead_code)] // the child-process tests'
pub fn child_config() -> CommConfig {
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let number = |k: &str| var(k).map(|v| v.parse::<u64>().unwrap_or_else(|_| panic!("{k}={v}")));
    let world = number("WORLD_SIZE").expect("WORLD_SIZE") as usize;
    let mut c = CommConfig::new(number("RANK").map(|r| r as usize), world)
        .with_master(
            var("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into()),
            number("MASTER_PORT").expect("MASTER_PORT") as u16,
        )
        .with_secret(flotilla_tcp::Secret::from_env().expect("the secret"));
    if let Some(s) = number("CHILD_TIMEOUT_SECS") {
        c.timeout = Duration::from_secs(s);
    }
    if let Some(t) = var("CHILD_TRANSPORT") {
        c.transport = t.parse().expect("CHILD_TRANSPORT");
    }
    if let Some(h) = var("CHILD_HIERARCHICAL") {
        c.hierarchical = h.parse().expect("CHILD_HIERARCHICAL");
    }
    c.shm_dir = var("CHILD_SHM_DIR").map(Into::into);
    if let Some(b) = number("CHILD_SHM_CHUNK_BYTES") {
        c.shm_chunk_bytes = b as usize;
    }
    c
}
