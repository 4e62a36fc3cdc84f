//! `flotilla bench step` and `flotilla bench allreduce --bind`, run for real on tiny cases:
//! the step benchmark's figures are measured (its CPU time per step accounts for what the
//! process spends on the steps it claims, its rate is no faster than its CPU time allows, its
//! ratios are the quotients of its columns), and `--bind core` puts each all-reduce rank on
//! the core it names.

mod common;

use std::collections::BTreeMap;
use std::io::Read;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::{cores_of, flotilla, run_with_deadline, text};

/// The tests of this file one at a time: the step benchmark reads the CPU time of this
/// process's children, which another test's children would add to.
static SERIAL: Mutex<()> = Mutex::new(());

/// The secret of the jobs the tests below start.
const SECRET: &str = "test-secret-0123456789";

/// User + system CPU seconds of this process's children that have been waited for.
fn children_cpu_seconds() -> f64 {
    // SAFETY: `getrusage` only writes the `rusage` handed to it, zeroed first.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above; RUSAGE_CHILDREN is always valid.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &raw mut usage) };
    assert_eq!(rc, 0, "getrusage");
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    secs(usage.ru_utime) + secs(usage.ru_stime)
}

/// One row of `bench step` by column name (`n/a` as NaN).
fn step_row(stdout: &str) -> BTreeMap<&'static str, f64> {
    const COLUMNS: [&str; 9] = [
        "model",
        "batch",
        "threads",
        "flotilla/s",
        "pytorch/s",
        "ratio",
        "cpu_ms",
        "torch_cpu_ms",
        "cpu_ratio",
    ];
    let rows: Vec<&str> = stdout
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim_start().starts_with("model"))
        .collect();
    assert_eq!(rows.len(), 1, "one case, one row:\n{stdout}");
    let words: Vec<&str> = rows[0].split_whitespace().collect();
    assert_eq!(words.len(), COLUMNS.len(), "{stdout}");
    assert_eq!(words[0], "lenet5", "{stdout}");
    COLUMNS
        .iter()
        .zip(&words)
        .skip(1)
        .map(|(c, w)| (*c, w.parse().unwrap_or(f64::NAN)))
        .collect()
}

/// `bench step` of LeNet-5, batch 32, 1 thread, `steps` timed steps (each side runs `rounds`
/// times, after 5 warm-up steps); its row and the CPU seconds the command took, children
/// included.
fn bench_step(steps: usize, rounds: u32, python: &str) -> (BTreeMap<&'static str, f64>, f64) {
    let mut c = flotilla();
    c.args(["bench", "step", "--models", "lenet5", "--batches", "32"])
        .args(["--threads", "1", "--steps", &steps.to_string()])
        .args(["--rounds", &rounds.to_string(), "--python", python]);
    let before = children_cpu_seconds();
    let o = run_with_deadline(c, Duration::from_secs(600));
    let cpu = children_cpu_seconds() - before;
    assert!(o.status.success(), "{}", text(&o));
    (step_row(&String::from_utf8_lossy(&o.stdout)), cpu)
}

/// The Python with torch that CI names (`FLOTILLA_TORCH_PYTHON`), else one that cannot run
/// the reference (its columns are then `n/a`).
fn reference_python() -> (String, bool) {
    match std::env::var("FLOTILLA_TORCH_PYTHON") {
        Ok(p) => (p, true),
        Err(_) => {
            assert!(
                std::env::var("CI").is_err(),
                "CI runs bench step against PyTorch: FLOTILLA_TORCH_PYTHON is not set"
            );
            ("/nonexistent/python3".to_string(), false)
        }
    }
}

/// `bench step` on a tiny case prints one row of measured figures. Its CPU time per step is
/// real, and `--rounds` makes that many runs: without the reference (its Python missing),
/// three runs of 45 timed steps against two of 5 cost the command 130 steps' worth of its
/// `cpu_ms` more (each run 5 warm-up steps), within a third. Its rate is no faster
/// than its CPU time allows on one thread (a step's wall time at least its CPU time). With
/// the reference, the ratios are the quotients of the columns.
#[test]
fn bench_step_reports_measured_figures_and_their_ratios() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (python, torch) = reference_python();
    let alone = "/nonexistent/python3";
    let (short, cpu_short) = bench_step(5, 2, alone);
    let (long, cpu_long) = bench_step(45, 3, alone);
    let (with_torch, _) = bench_step(5, 2, &python);
    for row in [&short, &long, &with_torch] {
        assert_eq!((row["batch"], row["threads"]), (32.0, 1.0), "{row:?}");
        assert!(row["flotilla/s"] > 0.0 && row["cpu_ms"] > 0.0, "{row:?}");
        let wall_ms = 32.0 * 1e3 / row["flotilla/s"];
        assert!(
            wall_ms >= 0.9 * row["cpu_ms"],
            "a step in {wall_ms:.3} ms of wall time but {} ms of CPU on one thread: {row:?}",
            row["cpu_ms"]
        );
    }
    for row in [&short, &long] {
        assert!(
            row["pytorch/s"].is_nan() && row["ratio"].is_nan(),
            "{row:?}"
        );
    }
    if torch {
        let row = &with_torch;
        let (ratio, cpu_ratio) = (
            row["flotilla/s"] / row["pytorch/s"],
            row["torch_cpu_ms"] / row["cpu_ms"],
        );
        // Printed with 2 decimals, of figures printed rounded.
        assert!(
            (row["ratio"] - ratio).abs() <= 0.01 + 0.01 * ratio,
            "{row:?}"
        );
        assert!(
            (row["cpu_ratio"] - cpu_ratio).abs() <= 0.01 + 0.01 * cpu_ratio,
            "{row:?}"
        );
    }
    // Three runs of 5 + 45 steps against two of 5 + 5: 130 steps more (80 if the third
    // run were not made).
    let claimed = 130.0 * (short["cpu_ms"] + long["cpu_ms"]) / 2.0 / 1e3;
    let spent = cpu_long - cpu_short;
    assert!(
        (0.67..=1.5).contains(&(spent / claimed)),
        "130 more steps cost {spent:.3} s of CPU; the rows claim {claimed:.3} s: {short:?} {long:?}"
    );
}

/// The cores process `pid` may run on, from `/proc`.
fn cores_of_pid(pid: &str) -> Option<Vec<usize>> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .map(cores_of)
}

/// The rank (`RANK` of its environment) and cores of every `bench allreduce-worker` process
/// whose parent is `parent`, as `/proc` shows them now.
fn workers_of(parent: u32) -> Vec<(usize, Vec<usize>)> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for entry in dir.flatten() {
        let pid = entry.file_name().to_string_lossy().to_string();
        if !pid.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // The parent is the second field after the command's closing parenthesis.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if ppid != Some(parent) || !String::from_utf8_lossy(&cmdline).contains("allreduce-worker") {
            continue;
        }
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        let rank = environ
            .split(|&b| b == 0)
            .find_map(|kv| kv.strip_prefix(b"RANK="))
            .and_then(|r| std::str::from_utf8(r).ok()?.parse().ok());
        if let (Some(rank), Some(cores)) = (rank, cores_of_pid(&pid)) {
            found.push((rank, cores));
        }
    }
    found
}

/// `bench allreduce --bind core` with one rank more than this process has cores: each rank
/// runs on the one core the binding gives it (round-robin over this process's cores), as
/// `/proc/<pid>/status` of every worker shows while the benchmark runs; `--bind none` leaves
/// every rank on all of them. Both print their measured rows.
#[test]
fn bench_allreduce_bind_core_puts_each_rank_on_its_core() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let mine = cores_of_pid("self").expect("this process's cores");
    let n = mine.len() + 1;
    let run = |bind: &str| -> Vec<Vec<usize>> {
        let mut c = flotilla();
        c.args(["bench", "allreduce", "-n", &n.to_string(), "--bind", bind])
            .args(["--sizes", "4M", "--iters", "20", "--transport", "tcp"])
            .env("FLOTILLA_SECRET", SECRET)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        let mut child = common::Proc(c.spawn().expect("flotilla bench"));
        let pipe = |mut r: Box<dyn Read + Send>| {
            std::thread::spawn(move || {
                let mut v = Vec::new();
                let _ = r.read_to_end(&mut v);
                v
            })
        };
        let out = pipe(Box::new(child.0.stdout.take().expect("stdout")));
        let err = pipe(Box::new(child.0.stderr.take().expect("stderr")));
        let started = Instant::now();
        let mut seen: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        let status = loop {
            if seen.len() < n {
                seen.extend(workers_of(child.0.id()));
            }
            if let Some(status) = child.0.try_wait().expect("try_wait") {
                break status;
            }
            assert!(
                started.elapsed() < Duration::from_secs(300),
                "--bind {bind}: the benchmark did not finish"
            );
            std::thread::sleep(Duration::from_millis(5));
        };
        let o = std::process::Output {
            status,
            stdout: out.join().expect("stdout"),
            stderr: err.join().expect("stderr"),
        };
        assert!(o.status.success(), "--bind {bind}: {}", text(&o));
        let rows = String::from_utf8_lossy(&o.stdout)
            .lines()
            .filter(|l| l.trim_end().ends_with("tcp") && l.contains("4 MiB"))
            .count();
        assert_eq!(rows, 1, "--bind {bind}: one row of 4 MiB:\n{}", text(&o));
        assert_eq!(seen.len(), n, "--bind {bind}: every worker seen: {seen:?}");
        seen.into_values().collect()
    };
    let bound = run("core");
    let expected: Vec<Vec<usize>> = (0..n).map(|r| vec![mine[r % mine.len()]]).collect();
    assert_eq!(bound, expected, "--bind core, {n} ranks on cores {mine:?}");
    assert_eq!(run("none"), vec![mine.clone(); n], "--bind none");
}
