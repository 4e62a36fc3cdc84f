//! Ranks of one machine that cannot share a memory segment, emulated with mount namespaces
//! (`unshare -m`; every rank a real process, this test binary's `child_rank`), under the
//! default `transport: auto`:
//!
//! * each rank with its own tmpfs at `/dev/shm` (containers on the host's network with
//!   private `/dev/shm`): different host keys, so the ranks reduce over TCP, with the right
//!   sums;
//! * both ranks on one `/dev/shm` too small for the segment, each with its own `/tmp`
//!   (where rank 0 then makes the segment): equal host keys, but rank 1 cannot open the
//!   segment, so both fall back to TCP together and get the right sums; under
//!   `transport: shm` both fail instead.
//!
//! Needs root and `unshare`; without them the tests are skipped, unless `CI` is set, where
//! that is a failure.

#[allow(dead_code)] // the world helpers are the in-process tests'
mod common;
use common::value;

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use flotilla_tcp::{CommError, ProcessGroup, TcpGroup};

/// The variable that makes `child_rank` a rank: the directory of its report.
const OUT: &str = "FLOTILLA_TEST_MNTNS_OUT";
/// The lengths a rank all-reduces: each TCP algorithm's sizes under the default thresholds.
const LENS: [usize; 4] = [3, 1001, 70_000, 300_001];
/// The length of the broadcast (from rank 1).
const BROADCAST: usize = 5000;
/// How long a pair of ranks may take before the test fails as hung.
const DEADLINE: Duration = Duration::from_secs(60);

/// The device and inode of `p` as the rank sees it.
fn identity(p: &str) -> String {
    std::fs::metadata(p).map_or("-".into(), |m| format!("{}:{}", m.dev(), m.ino()))
}

/// A rank's collectives: each case of [`LENS`] all-reduced, a broadcast from rank 1, a
/// barrier; the results' bits, one case a line, and the bytes that went through shared
/// memory.
fn collectives(comm: &TcpGroup) -> Result<String, CommError> {
    let r = comm.rank();
    let mut lines = Vec::new();
    for (case, &len) in LENS.iter().enumerate() {
        let mut buf: Vec<f32> = (0..len).map(|i| value(case, r, i)).collect();
        comm.all_reduce_sum(&mut buf)?;
        lines.push(bits_line(&buf));
    }
    let mut b: Vec<f32> = (0..BROADCAST)
        .map(|i| if r == 1 { value(9, 1, i) } else { 0.0 })
        .collect();
    comm.broadcast_f32(&mut b, 1)?;
    lines.push(bits_line(&b));
    comm.barrier()?;
    lines.push(format!("shm_bytes {}", comm.stats().shm_bytes));
    Ok(lines.join("\n"))
}

fn bits_line(v: &[f32]) -> String {
    let words: Vec<String> = v.iter().map(|x| x.to_bits().to_string()).collect();
    words.join(" ")
}

/// A rank (only when started by the tests below): connects as the environment says, runs
/// [`collectives`] and writes its report (what `/dev/shm` and `/tmp` it saw, then the
/// results or the error) to `OUT/rank{RANK}`.
#[test]
fn child_rank() {
    let Ok(out) = std::env::var(OUT) else {
        return;
    };
    let rank = std::env::var("RANK").expect("RANK");
    let c = common::child_config();
    let result = TcpGroup::connect(c).and_then(|comm| collectives(&comm));
    let body = match result {
        Ok(lines) => format!("ok\n{lines}"),
        Err(e) => format!("error {e}"),
    };
    let report = format!(
        "dev_shm {}\ntmp {}\n{body}\n",
        identity("/dev/shm"),
        identity("/tmp")
    );
    std::fs::write(Path::new(&out).join(format!("rank{rank}")), report).expect("report");
}

/// What a rank reported.
struct Report {
    dev_shm: String,
    tmp: String,
    /// The results' bits, case by case (the broadcast last), or the error.
    outcome: Result<(Vec<Vec<u32>>, u64), String>,
}

fn read_report(path: &Path) -> Report {
    let text = std::fs::read_to_string(path).expect("a rank's report");
    let mut lines = text.lines();
    let mut field = |name: &str| {
        let l = lines.next().expect("a report line");
        l.strip_prefix(name)
            .unwrap_or_else(|| panic!("{name} in {l}"))
            .trim()
            .to_string()
    };
    let (dev_shm, tmp, status) = (field("dev_shm"), field("tmp"), field(""));
    let outcome = match status.strip_prefix("error ") {
        Some(e) => Err(e.to_string()),
        None => {
            let rest: Vec<&str> = lines.collect();
            let (shm, cases) = rest.split_last().expect("results");
            let shm = shm.strip_prefix("shm_bytes ").expect("shm_bytes");
            let cases = cases
                .iter()
                .map(|l| {
                    l.split_whitespace()
                        .map(|w| w.parse().expect("bits"))
                        .collect()
                })
                .collect();
            Ok((cases, shm.parse().expect("shm_bytes")))
        }
    };
    Report {
        dev_shm,
        tmp,
        outcome,
    }
}

/// A process group (a shell and the ranks it starts), killed when dropped.
struct Group(Child);

impl Drop for Group {
    fn drop(&mut self) {
        let pgid = format!("-{}", self.0.id());
        let _ = Command::new("kill")
            .args(["-KILL", "--", &pgid])
            .stderr(Stdio::null())
            .status();
        let _ = self.0.wait();
    }
}

/// Whether this machine lets a test mount a tmpfs in a mount namespace of its own; a
/// panic instead of `false` when `CI` is set.
fn namespaces_available() -> bool {
    let ok = Command::new("unshare")
        .args(["-m", "sh", "-c", "mount -t tmpfs tmpfs /dev/shm"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok && std::env::var_os("CI").is_some() {
        panic!("cannot mount a tmpfs in a mount namespace (CI needs root and unshare)");
    }
    if !ok {
        eprintln!("skipped: cannot mount a tmpfs in a mount namespace (needs root and unshare)");
    }
    ok
}

/// Starts two ranks over 127.0.0.1, from one mount namespace in which `outer` ran (a shell
/// command), each rank in a namespace of its own in which `inner` ran; `env` added to both.
/// Waits for both, then returns their reports.
fn pair(outer: &str, inner: &str, env: &[(&str, &str)]) -> Vec<Report> {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("report directory");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port();
    // `$@`: this binary and its arguments, which each rank's shell execs once mounted.
    let script = format!(
        "{outer} || exit 97\n\
         RANK=0 unshare -m sh -c '{inner} && exec \"$@\"' rank \"$@\" & p0=$!\n\
         RANK=1 unshare -m sh -c '{inner} && exec \"$@\"' rank \"$@\" & p1=$!\n\
         wait $p0; a=$?; wait $p1; b=$?; exit $((a | b))"
    );
    let log = File::create(dir.path().join("stderr")).expect("log");
    let mut c = Command::new("unshare");
    c.args(["-m", "sh", "-c", &script, "sh"])
        .arg(std::env::current_exe().expect("test binary"))
        .args(["--exact", "child_rank", "--nocapture", "--test-threads=1"])
        .env(OUT, dir.path())
        .env("WORLD_SIZE", "2")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("FLOTILLA_SECRET", "test-secret-0123456789")
        .env("CHILD_TIMEOUT_SECS", "10")
        .env_remove("TMPDIR")
        .env_remove("CHILD_SHM_DIR")
        .env_remove("CHILD_TRANSPORT")
        .stdout(Stdio::null())
        .stderr(log)
        .process_group(0);
    for (k, v) in env {
        c.env(k, v);
    }
    let mut group = Group(c.spawn().expect("spawn the ranks"));
    let deadline = Instant::now() + DEADLINE;
    let status = loop {
        if let Some(s) = group.0.try_wait().expect("wait") {
            break s;
        }
        if Instant::now() > deadline {
            drop(group);
            panic!("the ranks hung; stderr: {}", logs(dir.path()));
        }
        thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status}; stderr: {}", logs(dir.path()));
    (0..2)
        .map(|r| read_report(&dir.path().join(format!("rank{r}"))))
        .collect()
}

fn logs(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("stderr")).unwrap_or_default()
}

/// Both ranks succeeded with the sums (and the broadcast) of two ranks, bit for bit,
/// nothing through shared memory.
fn assert_right_over_tcp(reports: &[Report]) {
    for (r, rep) in reports.iter().enumerate() {
        let (cases, shm) = rep
            .outcome
            .as_ref()
            .unwrap_or_else(|e| panic!("rank {r} failed: {e}"));
        assert_eq!(cases.len(), LENS.len() + 1, "rank {r}: results");
        for (case, &len) in LENS.iter().enumerate() {
            let want: Vec<u32> = (0..len)
                .map(|i| (value(case, 0, i) + value(case, 1, i)).to_bits())
                .collect();
            assert!(cases[case] == want, "rank {r}: the sums of case {case}");
        }
        let sent: Vec<u32> = (0..BROADCAST).map(|i| value(9, 1, i).to_bits()).collect();
        assert!(cases[LENS.len()] == sent, "rank {r}: the broadcast");
        assert_eq!(*shm, 0, "rank {r}: bytes through shared memory");
    }
}

/// The case: containers on one network with private `/dev/shm` train together
/// over TCP under `transport: auto` (once the job failed: the ranks' host keys matched, the
/// segment rank 0 made was not in rank 1's `/dev/shm`).
#[test]
fn ranks_with_their_own_dev_shm_reduce_together_over_tcp() {
    if !namespaces_available() {
        return;
    }
    let reports = pair("true", "mount -t tmpfs tmpfs /dev/shm", &[]);
    let host = identity("/dev/shm");
    assert_ne!(reports[0].dev_shm, reports[1].dev_shm, "one /dev/shm");
    assert!(
        reports.iter().all(|r| r.dev_shm != host),
        "the host's /dev/shm"
    );
    assert_right_over_tcp(&reports);
}

/// Equal host keys (one `/dev/shm`), yet rank 0's segment is out of rank 1's reach
/// (`/dev/shm` has no room: rank 0 makes it in its own `/tmp`): the members agree to fall
/// back to TCP under `transport: auto`, and both fail under `transport: shm`.
#[test]
fn a_segment_one_member_cannot_open_falls_back_to_tcp_on_every_member() {
    if !namespaces_available() {
        return;
    }
    let (outer, inner) = (
        "mount -t tmpfs -o size=4k tmpfs /dev/shm",
        "mount -t tmpfs tmpfs /tmp",
    );
    let reports = pair(outer, inner, &[]);
    assert_eq!(reports[0].dev_shm, reports[1].dev_shm, "one /dev/shm");
    assert_ne!(reports[0].tmp, reports[1].tmp, "one /tmp");
    assert_right_over_tcp(&reports);
    let reports = pair(outer, inner, &[("CHILD_TRANSPORT", "shm")]);
    for (r, rep) in reports.iter().enumerate() {
        match &rep.outcome {
            Err(e) => assert!(e.contains("transport shm"), "rank {r}: {e}"),
            Ok(_) => panic!("rank {r} succeeded under transport shm"),
        }
    }
}
