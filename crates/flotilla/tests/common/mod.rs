//! Helpers shared by the end-to-end tests: real `flotilla` processes over 127.0.0.1.
//!
//! Every child runs with a deadline and is killed when the test ends (see [`Proc`]).
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_flotilla");

pub fn repo() -> PathBuf {
    // Read at run time: a test binary reused from a build in another checkout must not
    // read that checkout's files.
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
        .join("../..")
}

/// The secret of the ranks the tests start by hand (a TCP rank refuses to start without one;
/// `flotilla launch` makes its own).
pub const TEST_SECRET: &str = "flotilla-test-secret-0123456789";

/// `flotilla` as a rank started by hand (with [`TEST_SECRET`]).
pub fn flotilla_rank() -> Command {
    let mut c = flotilla();
    c.env("FLOTILLA_SECRET", TEST_SECRET);
    c
}

pub fn flotilla() -> Command {
    let mut c = Command::new(BIN);
    c.current_dir(repo())
        .env("RAYON_NUM_THREADS", "1")
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env_remove("MASTER_ADDR")
        .env_remove("MASTER_PORT")
        .env_remove("FLOTILLA_FAULT")
        .env_remove("FLOTILLA_SECRET")
        .env_remove("FLOTILLA_SECRET_FILE")
        .env_remove("FLOTILLA_TOKEN");
    c
}

/// A child process that is killed if still running when dropped.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs a command to completion within `limit`, killing it past that.
pub fn run_with_deadline(mut cmd: Command, limit: Duration) -> Output {
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = Proc(cmd.spawn().expect("spawn flotilla"));
    let mut out = child.0.stdout.take().expect("stdout");
    let mut err = child.0.stderr.take().expect("stderr");
    let t_out = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = out.read_to_end(&mut s);
        s
    });
    let t_err = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = err.read_to_end(&mut s);
        s
    });
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.0.try_wait().expect("try_wait") {
            break status;
        }
        if started.elapsed() > limit {
            let _ = child.0.kill();
            let _ = child.0.wait();
            panic!("command did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Output {
        status,
        stdout: t_out.join().unwrap_or_default(),
        stderr: t_err.join().unwrap_or_default(),
    }
}

pub fn text(o: &Output) -> String {
    format!(
        "--- stdout ---\n{}\n--- stderr ---\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Runs `flotilla launch` and returns its output, asserting success.
pub fn launch(args: &[&str], limit: Duration) -> Output {
    let mut c = flotilla();
    c.arg("launch").args(args);
    let o = run_with_deadline(c, limit);
    assert!(o.status.success(), "launch {args:?} failed\n{}", text(&o));
    o
}

/// Parses `final test_acc=... loss=... steps=... wall_s=...` from the last stdout line.
pub fn final_fields(o: &Output) -> BTreeMap<String, f64> {
    let stdout = String::from_utf8_lossy(&o.stdout);
    let last = stdout.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("final "),
        "last line is not the final line: {last:?}\n{}",
        text(o)
    );
    last["final ".len()..]
        .split_whitespace()
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.parse().expect("number")))
        .collect()
}

/// The fields of the last `final test_acc=...` line of `stdout`: the launcher's own, or a
/// rank's relayed one (`[rank 0] final ...`: a program's job, an elastic job's).
pub fn final_fields_in(stdout: &str) -> BTreeMap<String, f64> {
    let line = stdout
        .lines()
        .rfind(|l| l.contains("final test_acc="))
        .unwrap_or_else(|| panic!("no final line in:\n{stdout}"));
    line[line.find("final ").unwrap_or(0)..]
        .split_whitespace()
        .skip(1)
        .filter_map(|kv| kv.split_once('='))
        .filter_map(|(k, v)| Some((k.to_string(), v.parse().ok()?)))
        .collect()
}

/// Reads every tensor of the newest checkpoint under `output`.
pub fn checkpoint_tensors(output: &Path) -> BTreeMap<String, Vec<f32>> {
    let root = output.join("checkpoints");
    let name = std::fs::read_to_string(root.join("latest")).expect("latest");
    safetensors_file(&root.join(name.trim()).join("model.safetensors"))
}

/// Reads every tensor of a safetensors file (all `f32`).
pub fn safetensors_file(path: &Path) -> BTreeMap<String, Vec<f32>> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    st.tensors()
        .into_iter()
        .map(|(name, view)| {
            assert_eq!(view.dtype(), safetensors::Dtype::F32);
            let v = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            (name, v)
        })
        .collect()
}

/// `|a - b| / |b|` over every tensor (names and lengths must agree).
pub fn relative_error(a: &BTreeMap<String, Vec<f32>>, b: &BTreeMap<String, Vec<f32>>) -> f64 {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (k, va) in a {
        let vb = &b[k];
        assert_eq!(va.len(), vb.len(), "{k}");
        for (x, y) in va.iter().zip(vb) {
            diff += ((x - y) as f64).powi(2);
            norm += (*y as f64).powi(2);
        }
    }
    (diff / norm).sqrt()
}

pub fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().expect("tempdir")
}

pub fn config_file(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write config");
    path.to_str().expect("utf8").to_string()
}

pub fn run_log(output: &Path, rank: usize) -> String {
    std::fs::read_to_string(output.join(format!("rank-{rank}/run.log"))).expect("run.log")
}

/// The pid of rank `rank` of the job writing to `out`: its `RANK`, and `out` in its command
/// line (a config's rank: its config there) or its environment (a program's: its settings).
pub fn rank_pid(out: &Path, rank: usize) -> Option<u32> {
    let out = out.to_str().expect("utf8").as_bytes();
    let mentions = |raw: &[u8]| raw.windows(out.len()).any(|w| w == out);
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        let ranked = env
            .split(|&b| b == 0)
            .any(|kv| kv == format!("RANK={rank}").as_bytes());
        (pid != std::process::id() && ranked && (mentions(&cmdline) || mentions(&env)))
            .then_some(pid)
    })
}

/// Worker `rank` of the job writing to `out` was replaced once and rejoined: its server
/// (rank 0) took the replacement back past version 0 and accepted its pushes.
pub fn assert_rejoined(out: &Path, rank: usize) {
    let server = run_log(out, 0);
    assert!(
        first_rejoin(&server, rank).is_some_and(|(version, accepted)| version > 0 && accepted > 0),
        "the server took rank {rank} back past version 0 and accepted its pushes:\n{server}"
    );
}

/// What a parameter server's `log` says of the first replacement of worker `rank`: the
/// version it took it back at, and how many of its pushes it accepted (`None` if it never
/// took it back).
pub fn first_rejoin(log: &str, rank: usize) -> Option<(u64, u64)> {
    let back = log
        .lines()
        .find_map(|l| {
            l.split(&format!(
                "rank {rank} rejoined (a replaced worker) at round "
            ))
            .nth(1)
        })
        .and_then(|r| r.split(" version ").nth(1)?.split(';').next()?.parse().ok())?;
    let accepted = log
        .lines()
        .find_map(|l| l.split(&format!(" of rank {rank} at version ")).nth(1))
        .and_then(|r| r.split(": ").nth(1)?.split(' ').next()?.parse().ok())?;
    Some((back, accepted))
}

/// SIGKILLs rank `rank` of the job writing to `out` once its rank 0's run.log has reached
/// round `round` (within 120 s); whether it did.
pub fn kill_rank_at_round(out: &Path, rank: usize, round: u64) -> std::thread::JoinHandle<bool> {
    let out = out.to_path_buf();
    std::thread::spawn(move || {
        let (log, needle) = (out.join("rank-0/run.log"), format!("] round {round} "));
        let started = std::time::Instant::now();
        while started.elapsed() < Duration::from_secs(120) {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            if text.contains(&needle)
                && let Some(pid) = rank_pid(&out, rank)
            {
                // SAFETY: kill(2) on a pid of this test's own job; no memory is involved.
                return unsafe { libc::kill(pid as i32, libc::SIGKILL) } == 0;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    })
}

/// Processes (other than this one) whose command line mentions `needle`: pid and command line.
pub fn processes_mentioning(needle: &str) -> Vec<(u32, String)> {
    let me = std::process::id();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| *pid != me)
        .filter_map(|pid| {
            let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let cmd = String::from_utf8_lossy(&raw).replace('\0', " ");
            cmd.contains(needle).then_some((pid, cmd))
        })
        .collect()
}

/// Asserts that within `limit` no process mentioning `needle` is left (zombies count as gone).
pub fn assert_none_left(needle: &str, limit: Duration) {
    let started = Instant::now();
    loop {
        let left: Vec<_> = processes_mentioning(needle)
            .into_iter()
            .filter(|(pid, _)| {
                std::fs::read_to_string(format!("/proc/{pid}/stat"))
                    .map(|s| !s.contains(") Z "))
                    .unwrap_or(false)
            })
            .collect();
        if left.is_empty() {
            return;
        }
        assert!(
            started.elapsed() < limit,
            "processes left running after the job: {left:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The merged trace's events.
pub fn trace_events(path: &std::path::Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(path).expect("timeline written");
    let v: serde_json::Value = serde_json::from_str(&text).expect("the timeline is valid JSON");
    v["traceEvents"].as_array().expect("traceEvents").clone()
}

/// A complete span of the trace: name, start and end in microseconds, and its arguments.
pub struct Span<'a> {
    pub name: &'a str,
    pub start: f64,
    pub end: f64,
    pub args: &'a serde_json::Value,
}

/// Rank `pid`'s complete spans.
pub fn spans(events: &[serde_json::Value], pid: u64) -> Vec<Span<'_>> {
    events
        .iter()
        .filter(|e| e["ph"] == "X" && e["pid"] == pid)
        .filter_map(|e| {
            let (ts, dur) = (e["ts"].as_f64()?, e["dur"].as_f64()?);
            Some(Span {
                name: e["name"].as_str()?,
                start: ts,
                end: ts + dur,
                args: &e["args"],
            })
        })
        .collect()
}

/// The name a merged trace gives process `pid` (`rank 0 (peer)`).
pub fn process_name(events: &[serde_json::Value], pid: u64) -> String {
    events
        .iter()
        .find(|e| e["ph"] == "M" && e["name"] == "process_name" && e["pid"] == pid)
        .and_then(|e| e["args"]["name"].as_str().map(String::from))
        .unwrap_or_else(|| panic!("no process_name for pid {pid}"))
}

/// A free TCP port on 127.0.0.1, for a rendezvous.
pub fn free_port() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port().to_string()
}

/// Starts `n` ranks of `flotilla train CONFIG` by hand (as mpirun or Slurm would, so that no
/// launcher stops the others before they report what they saw), with `FLOTILLA_FAULT=fault`,
/// writing to `out`; waits for every rank, each within `limit`.
pub fn train_by_hand(cfg: &str, n: usize, out: &Path, fault: &str, limit: Duration) -> Vec<Output> {
    let port = free_port();
    let ranks: Vec<_> = (0..n)
        .map(|rank| {
            let mut c = flotilla_rank();
            c.args(["train", cfg, "--rank", &rank.to_string()])
                .args([
                    "--master-port",
                    &port,
                    "--output",
                    out.to_str().expect("utf8"),
                ])
                .env("FLOTILLA_FAULT", fault);
            std::thread::spawn(move || run_with_deadline(c, limit))
        })
        .collect();
    ranks
        .into_iter()
        .map(|h| h.join().expect("rank thread"))
        .collect()
}

/// Runs `flotilla launch CONFIG --output OUT --timeline OUT.trace.json` (asserting success)
/// and returns its output and the merged trace's events.
pub fn launch_traced(cfg: &str, out: &Path, limit: Duration) -> (Output, Vec<serde_json::Value>) {
    let trace = out.with_extension("trace.json");
    let o = launch(
        &[
            cfg,
            "--output",
            out.to_str().expect("utf8"),
            "--timeline",
            trace.to_str().expect("utf8"),
        ],
        limit,
    );
    (o, trace_events(&trace))
}

/// Asserts two checkpoints hold the same tensors (names, lengths and values), bit for bit.
pub fn assert_bitwise(name: &str, a: &BTreeMap<String, Vec<f32>>, b: &BTreeMap<String, Vec<f32>>) {
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "{name}: tensor names"
    );
    for (k, va) in a {
        let vb = &b[k];
        assert_eq!(va.len(), vb.len(), "{name}: lengths of {k}");
        let differing = va
            .iter()
            .zip(vb)
            .filter(|(x, y)| x.to_bits() != y.to_bits())
            .count();
        assert_eq!(differing, 0, "{name}: {differing} values of {k} differ");
    }
}

/// The cores a `Cpus_allowed_list` value names (`0-2,5` is 0, 1, 2, 5).
pub fn cores_of(list: &str) -> Vec<usize> {
    let mut cores = Vec::new();
    for part in list.trim().split(',') {
        let (lo, hi) = part.split_once('-').unwrap_or((part, part));
        let (lo, hi): (usize, usize) = (lo.parse().expect("core"), hi.parse().expect("core"));
        cores.extend(lo..=hi);
    }
    cores
}

/// Example `name`'s binary beside the test's (`target/release/examples/NAME`), which
/// `cargo test --release --workspace` builds.
pub fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test path");
    let release = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target dir");
    let path = release.join("examples").join(name);
    assert!(
        path.is_file(),
        "{} is missing: build it with `cargo build --release -p flotilla-burn --example \
         {name}` (`cargo test --release --workspace` builds it)",
        path.display()
    );
    path
}

/// Whether `python` runs and imports `module`.
pub fn python_has(python: &str, module: &str) -> bool {
    Command::new(python)
        .args(["-c", &format!("import {module}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Sends `sig` (`-9`, `-STOP`, `-CONT`) to process `pid` with `kill`, which must succeed.
pub fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .expect("kill")
        .success();
    assert!(ok, "kill {sig} {pid}");
}

/// The accuracy of the last `test accuracy: X` line of `text` (what
/// `examples/mnist_learner.rs` prints at its end).
pub fn learner_test_accuracy(text: &str) -> f64 {
    let l = text
        .lines()
        .rfind(|l| l.contains("test accuracy: "))
        .expect("accuracy");
    l.split("test accuracy: ")
        .nth(1)
        .and_then(|v| v.trim().parse().ok())
        .expect("a number")
}
