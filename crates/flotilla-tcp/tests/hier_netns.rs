//! The hierarchical all-reduce between real hosts, emulated: network namespaces joined by
//! veth pairs to a bridge, created by the test, each with a segment directory of its own
//! (`CHILD_SHM_DIR`: its own host key at the rendezvous, which is the identity of
//! that directory); every rank a real process (this test binary, `child_rank`) started in
//! its namespace.
//!
//! * 2 hosts x 2 ranks: every rank bit-identical, bitwise the serial reference of the
//!   documented order (each host's left-to-right sum, then the two hosts' added); the
//!   inter-host bytes (`CommStats::bytes_sent_inter_host`, every rank's summed) half of the
//!   flat run's (`CHILD_HIERARCHICAL=off`, Rabenseifner's at 4 MiB), both measured.
//! * Uneven hosts (2 + 1): flat, bit for bit and byte for byte the `off` run.
//! * A rank killed on the other host is named by every survivor well within the deadline.
//!
//! Needs root and `ip` (iproute2); without them the tests are skipped, unless `CI` is set,
//! where that is a failure. Namespaces and the bridge are removed on every exit path.

#[allow(dead_code)] // the world helpers are the in-process tests'
mod common;
use common::value;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard, mpsc};
use std::thread;
use std::time::{Duration, Instant};

use flotilla_tcp::{ProcessGroup, TcpGroup};

/// The variable that makes `child_rank` a rank: its mode (`sums` or `loop`).
const CHILD: &str = "FLOTILLA_TEST_HIER_CHILD";
/// Where a `sums` rank writes its results.
const OUT: &str = "FLOTILLA_TEST_HIER_OUT";
/// The lengths a `sums` rank all-reduces; the last (4 MiB) is the one whose bytes count.
const LENS: [usize; 4] = [3, 1001, 200_003, 1 << 20];
/// How long a world of ranks may take before the test fails as hung.
const DEADLINE: Duration = Duration::from_secs(60);

/// Network namespaces `{prefix}0..` on a bridge, removed when dropped, and each one's
/// segment directory (`host{i}` in `dirs`).
struct Hosts {
    prefix: String,
    count: usize,
    dirs: tempfile::TempDir,
    _turn: MutexGuard<'static, ()>,
}

/// The tests' worlds run one at a time (4 ranks each on a small machine: the kill test
/// measures how fast the survivors fail).
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

impl Hosts {
    /// `count` namespaces `fh{pid}{tag}0..` with addresses 10.88.0.(i+1) (each test its own
    /// bridge, so the subnets never meet); `None` (skip) without root or `ip`, a panic
    /// instead when `CI` is set. Holds [`ONE_AT_A_TIME`] until dropped.
    fn new(count: usize, tag: char) -> Option<Hosts> {
        let turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
        let prefix = format!("fh{}{tag}", std::process::id() % 100_000);
        let hosts = Hosts {
            prefix,
            count,
            dirs: tempfile::tempdir().expect("segment directories"),
            _turn: turn,
        };
        match hosts.build() {
            Ok(()) => Some(hosts),
            Err(e) if std::env::var_os("CI").is_some() => {
                panic!("cannot create network namespaces (CI needs root and ip): {e}")
            }
            Err(e) => {
                eprintln!("skipped: cannot create network namespaces ({e})");
                None
            }
        }
    }

    fn ns(&self, i: usize) -> String {
        format!("{}{i}", self.prefix)
    }

    /// Host `i`'s segment directory.
    fn dir(&self, i: usize) -> std::path::PathBuf {
        self.dirs.path().join(format!("host{i}"))
    }

    fn addr(i: usize) -> String {
        format!("10.88.0.{}", i + 1)
    }

    fn build(&self) -> Result<(), String> {
        let br = format!("{}-br", self.prefix);
        ip(&["link", "add", &br, "type", "bridge"])?;
        ip(&["link", "set", &br, "up"])?;
        for i in 0..self.count {
            let (ns, veth) = (self.ns(i), format!("{}-v{i}", self.prefix));
            ip(&["netns", "add", &ns])?;
            ip(&[
                "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &ns,
            ])?;
            ip(&["link", "set", &veth, "master", &br, "up"])?;
            let cidr = format!("{}/24", Self::addr(i));
            ip(&["-n", &ns, "addr", "add", &cidr, "dev", "eth0"])?;
            ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            std::fs::create_dir(self.dir(i)).map_err(|e| format!("segment directory: {e}"))?;
        }
        Ok(())
    }

    /// Starts rank `rank` of `n` in namespace `host`, in `mode`, with `env` added.
    fn spawn(&self, host: usize, rank: usize, n: usize, mode: &str, env: &[(&str, &str)]) -> Kid {
        let exe = std::env::current_exe().expect("test binary");
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns(host)])
            .arg(exe)
            .args(["--exact", "child_rank", "--nocapture", "--test-threads=1"])
            .env(CHILD, mode)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("FLOTILLA_SECRET", "flotilla-test-secret-0123456789")
            .env("MASTER_ADDR", Self::addr(0))
            .env("MASTER_PORT", "29511")
            .env("CHILD_TIMEOUT_SECS", "10")
            .env("CHILD_SHM_DIR", self.dir(host))
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        for (k, v) in env {
            c.env(k, v);
        }
        Kid(c.spawn().expect("spawn a rank"))
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for i in 0..self.count {
            let _ = ip(&["netns", "del", &self.ns(i)]);
        }
        let _ = ip(&["link", "del", &format!("{}-br", self.prefix)]);
    }
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// A rank's process, killed and reaped when dropped.
struct Kid(Child);

impl Drop for Kid {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A rank (only when started by the tests below): `sums` all-reduces [`LENS`] and writes
/// each result's bits, then the last one's inter-host and shared-memory bytes, to `OUT`;
/// `loop` all-reduces until it fails, printing `READY` after three and `ERR: ...` at the end.
#[test]
fn child_rank() {
    let Ok(mode) = std::env::var(CHILD) else {
        return;
    };
    let c = common::child_config();
    let comm = TcpGroup::connect(c).expect("child connects");
    let r = comm.rank();
    if mode == "loop" {
        let mut buf = vec![1.0f32; 300_000];
        for i in 0..1_000_000u64 {
            if i == 3 {
                println!("READY");
            }
            if let Err(e) = comm.all_reduce_sum(&mut buf) {
                println!("ERR: {e}");
                return;
            }
        }
        return;
    }
    let mut out = Vec::new();
    let mut traffic = (0, 0);
    for (case, &len) in LENS.iter().enumerate() {
        let mut buf: Vec<f32> = (0..len).map(|i| value(case, r, i)).collect();
        let before = comm.stats();
        comm.all_reduce_sum(&mut buf).expect("all-reduce");
        let after = comm.stats();
        traffic = (
            after.bytes_sent_inter_host - before.bytes_sent_inter_host,
            after.shm_bytes - before.shm_bytes,
        );
        out.extend(buf.iter().flat_map(|x| x.to_le_bytes()));
    }
    out.extend(traffic.0.to_le_bytes());
    out.extend(traffic.1.to_le_bytes());
    let path = std::env::var(OUT).expect("output path");
    std::fs::write(path, out).expect("write the results");
    println!("DONE");
}

/// What a `sums` rank wrote: each case's bits, and the last case's inter-host and
/// shared-memory bytes.
struct Sums {
    bits: Vec<Vec<u32>>,
    inter_host: u64,
    shm: u64,
}

fn read_sums(path: &Path) -> Sums {
    let b = std::fs::read(path).expect("a rank's results");
    let mut at = 0;
    let bits = LENS
        .iter()
        .map(|&len| {
            let v = b[at..at + 4 * len]
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            at += 4 * len;
            v
        })
        .collect();
    let word = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
    Sums {
        bits,
        inter_host: word(at),
        shm: word(at + 8),
    }
}

/// Runs a `sums` world with rank `r` on host `hosts_of[r]` and `hierarchical` (`auto` or
/// `off`); every rank's results.
fn sums(net: &Hosts, hosts_of: &[usize], hierarchical: &str) -> Vec<Sums> {
    let dir = tempfile::tempdir().expect("output directory");
    let n = hosts_of.len();
    let outs: Vec<_> = (0..n)
        .map(|r| dir.path().join(format!("rank{r}")))
        .collect();
    let mut kids: Vec<Kid> = (0..n)
        .map(|r| {
            let out = outs[r].to_string_lossy().into_owned();
            let env = [(OUT, out.as_str()), ("CHILD_HIERARCHICAL", hierarchical)];
            net.spawn(hosts_of[r], r, n, "sums", &env)
        })
        .collect();
    let deadline = Instant::now() + DEADLINE;
    for (r, k) in kids.iter_mut().enumerate() {
        loop {
            match k.0.try_wait().expect("wait") {
                Some(s) => {
                    assert!(s.success(), "rank {r} ({hierarchical}) failed: {s}");
                    break;
                }
                None if Instant::now() > deadline => panic!("rank {r} ({hierarchical}) hung"),
                None => thread::sleep(Duration::from_millis(20)),
            }
        }
    }
    outs.iter().map(|p| read_sums(p)).collect()
}

/// Every rank's results are rank 0's, bit for bit.
fn agreed(s: &[Sums]) -> &Vec<Vec<u32>> {
    for (r, x) in s.iter().enumerate() {
        assert!(x.bits == s[0].bits, "rank {r} differs from rank 0");
    }
    &s[0].bits
}

fn total_inter_host(s: &[Sums]) -> u64 {
    s.iter().map(|x| x.inter_host).sum()
}

#[test]
fn two_namespaces_of_two_ranks_sum_hierarchically_on_half_the_inter_host_bytes() {
    let Some(net) = Hosts::new(2, 'a') else {
        return;
    };
    let hosts_of = [0, 0, 1, 1];
    let hier = sums(&net, &hosts_of, "auto");
    let flat = sums(&net, &hosts_of, "off");
    let got = agreed(&hier);
    for (case, bits) in got.iter().enumerate() {
        assert_eq!(bits.len(), LENS[case]);
        for (i, &x) in bits.iter().enumerate() {
            let v = |r| value(case, r, i);
            let want = (v(0) + v(1)) + (v(2) + v(3));
            assert_eq!(x, want.to_bits(), "case {case} element {i}");
        }
    }
    agreed(&flat);
    // 4 MiB: each rank sends S/2 to the other host hierarchically (2 (H-1)/H S/k), S flat
    // (Rabenseifner's halving and doubling each cross once, on half the buffer).
    let s = (LENS[3] * 4) as f64;
    let (h, f) = (
        total_inter_host(&hier) as f64,
        total_inter_host(&flat) as f64,
    );
    assert!(h >= 2.0 * s && h <= 2.0 * s * 1.01, "hierarchical: {h} B");
    assert!(f >= 4.0 * s && f <= 4.0 * s * 1.01, "flat: {f} B");
    assert!(
        (h / f - 0.5).abs() < 0.01,
        "hierarchical / flat = {h} / {f}"
    );
    assert!(
        hier.iter().all(|x| x.shm > 0),
        "every rank used its host's segment"
    );
    assert!(flat.iter().all(|x| x.shm == 0), "flat used no segment");
}

#[test]
fn uneven_namespaces_stay_flat_bit_for_bit() {
    let Some(net) = Hosts::new(2, 'b') else {
        return;
    };
    let hosts_of = [0, 0, 1];
    let on = sums(&net, &hosts_of, "auto");
    let off = sums(&net, &hosts_of, "off");
    assert_eq!(agreed(&on), agreed(&off));
    let bytes = |s: &[Sums]| s.iter().map(|x| x.inter_host).collect::<Vec<_>>();
    assert_eq!(bytes(&on), bytes(&off));
    assert!(total_inter_host(&on) > 0);
    for (case, bits) in agreed(&on).iter().enumerate() {
        for (i, &x) in bits.iter().enumerate() {
            let exact: f64 = (0..3).map(|r| f64::from(value(case, r, i))).sum();
            let mag: f64 = (0..3).map(|r| f64::from(value(case, r, i)).abs()).sum();
            let x = f64::from(f32::from_bits(x));
            assert!(
                (x - exact).abs() <= 2.0 * 2f64.powi(-24) * mag,
                "{case}/{i}"
            );
        }
    }
}

#[test]
fn a_rank_killed_on_the_other_host_is_named_by_every_survivor() {
    let Some(net) = Hosts::new(2, 'c') else {
        return;
    };
    let hosts_of = [0, 0, 1, 1];
    let mut kids: Vec<Kid> = (0..4)
        .map(|r| net.spawn(hosts_of[r], r, 4, "loop", &[]))
        .collect();
    let (tx, rx) = mpsc::channel();
    for (r, k) in kids.iter_mut().enumerate() {
        let out = BufReader::new(k.0.stdout.take().expect("stdout"));
        let tx = tx.clone();
        thread::spawn(move || {
            // The test harness may print its own words before ours on a line.
            for line in out.lines().map_while(Result::ok) {
                if let Some(at) = ["READY", "ERR"].iter().find_map(|m| line.find(m)) {
                    let _ = tx.send((r, line[at..].to_string(), Instant::now()));
                }
            }
        });
    }
    let deadline = Instant::now() + DEADLINE;
    let (mut ready, mut killed_at) = (0, None);
    let mut outcomes: Vec<Option<(String, Duration)>> = vec![None; 3];
    while outcomes.iter().any(Option::is_none) {
        let left = deadline.saturating_duration_since(Instant::now());
        let (r, line, at) = rx.recv_timeout(left).expect("the survivors never failed");
        if line == "READY" {
            ready += 1;
            if ready == 4 {
                let _ = kids[3].0.kill();
                killed_at = Some(Instant::now());
            }
        } else if r < 3 {
            let after = at.saturating_duration_since(killed_at.expect("killed before any error"));
            outcomes[r] = Some((line, after));
        }
    }
    for (r, o) in outcomes.into_iter().enumerate() {
        let (line, after) = o.expect("every survivor");
        assert!(line.contains("rank 3"), "rank {r}: {line}");
        // The deadline is 10 s: the loss itself, not a timeout, names the rank.
        assert!(
            after < Duration::from_secs(5),
            "rank {r} took {after:?}: {line}"
        );
    }
}
