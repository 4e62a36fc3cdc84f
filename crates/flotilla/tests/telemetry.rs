//! Telemetry of real jobs: the merged Chrome timeline, the Prometheus `/metrics` endpoint of
//! a running rank (read by a real Prometheus text parser), and the launcher's summary.

mod common;

use common::*;

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

const LIMIT: Duration = Duration::from_secs(300);

/// Names of the complete spans of process `pid`.
fn span_names(events: &[Value], pid: u64) -> Vec<String> {
    events
        .iter()
        .filter(|e| e["ph"] == "X" && e["pid"] == pid)
        .filter_map(|e| e["name"].as_str().map(String::from))
        .collect()
}

fn assert_spans(events: &[Value], pid: u64, names: &[&str]) {
    let have = span_names(events, pid);
    for n in names {
        assert!(
            have.iter().any(|h| h == n),
            "rank {pid} has no `{n}` span; it has {:?}",
            {
                let mut u = have.clone();
                u.sort();
                u.dedup();
                u
            }
        );
    }
}

/// Rank `pid` all-reduced exactly buckets `0..buckets` in each of its `steps` steps, in that
/// order (each span with its bucket and bytes), and counted its bytes at least once per step.
fn assert_bucketed_all_reduces(events: &[Value], pid: u64, steps: usize, buckets: u64) {
    let span = |e: &&Value| e["ph"] == "X" && e["pid"] == pid;
    let at = |e: &Value| {
        let ts = e["ts"].as_f64().expect("ts");
        (ts, ts + e["dur"].as_f64().expect("dur"))
    };
    let mut per_step: Vec<(f64, Vec<u64>)> = events
        .iter()
        .filter(span)
        .filter(|e| e["name"] == "step")
        .map(|step| {
            let (start, end) = at(step);
            let mut reduces: Vec<(f64, u64)> = events
                .iter()
                .filter(span)
                .filter(|e| e["name"] == "all_reduce" && e["args"].get("bucket").is_some())
                .filter(|e| (start..=end).contains(&at(e).0))
                .inspect(|e| assert!(e["args"]["bytes"].as_u64() > Some(0), "{e}"))
                .map(|e| (at(e).0, e["args"]["bucket"].as_u64().expect("bucket")))
                .collect();
            reduces.sort_by(|a, b| a.0.total_cmp(&b.0));
            (start, reduces.into_iter().map(|r| r.1).collect())
        })
        .collect();
    per_step.sort_by(|a, b| a.0.total_cmp(&b.0));
    let want: Vec<u64> = (0..buckets).collect();
    assert_eq!(per_step.len(), steps, "rank {pid}: steps");
    for (i, (_, got)) in per_step.iter().enumerate() {
        assert_eq!(got, &want, "rank {pid}, step {}: bucket all-reduces", i + 1);
    }
    let counters = events
        .iter()
        .filter(|e| e["ph"] == "C" && e["pid"] == pid && e["name"] == "bytes")
        .count();
    assert!(counters >= steps, "rank {pid}: {counters} byte counters");
}

#[test]
fn the_timeline_of_a_two_rank_job_has_every_span_from_both_ranks() {
    timeline_of_two_ranks(&[]);
}

/// The same of a program: LeNet-5 written in burn, trained by `flotilla_burn::train`.
#[test]
fn the_timeline_of_a_programs_two_ranks_has_every_span_from_both() {
    let program = example("lenet5_program");
    timeline_of_two_ranks(&["--", program.to_str().expect("utf8")]);
}

/// A two-rank job's timeline (of the ranks `program` names after `--`, if any) has every
/// span of both ranks on one clock, and rank 0's summary every rank's figures.
fn timeline_of_two_ranks(program: &[&str]) {
    let dir = tmp();
    let out = dir.path().join("ar");
    let trace = dir.path().join("trace.json");
    let mut args = vec![
        "-n",
        "2",
        "--batch-size",
        "16",
        "--max-steps",
        "12",
        "--bucket-mb",
        "0.05",
        "--checkpoint-every",
        "6",
        "--output",
        out.to_str().expect("utf8"),
        "--timeline",
        trace.to_str().expect("utf8"),
    ];
    args.extend_from_slice(program);
    let o = launch(&args, LIMIT);
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("timeline: "),
        "{}",
        text(&o)
    );
    let events = trace_events(&trace);
    assert_eq!(process_name(&events, 0), "rank 0 (peer)");
    assert_eq!(process_name(&events, 1), "rank 1 (peer)");
    for pid in [0, 1] {
        assert_spans(
            &events,
            pid,
            &[
                "step",
                "data",
                "forward",
                "backward",
                "all_reduce",
                "optimizer_step",
                "eval",
            ],
        );
        // 0.05 MB buckets from LeNet-5's last layer back: fc3 and fc2 (44 056 bytes), fc1
        // alone (192 480 bytes: larger than a bucket), conv2 and conv1 (10 288 bytes).
        assert_bucketed_all_reduces(&events, pid, 12, 3);
    }
    assert_spans(&events, 0, &["checkpoint"]);
    // One clock: both ranks' steps interleave within the same second of wall time.
    let first = |pid| {
        events
            .iter()
            .filter(|e| e["ph"] == "X" && e["pid"] == pid && e["name"] == "step")
            .filter_map(|e| e["ts"].as_f64())
            .fold(f64::INFINITY, f64::min)
    };
    assert!(
        (first(0) - first(1)).abs() < 5e6,
        "{} vs {}",
        first(0),
        first(1)
    );

    // The launcher's summary carries rank 0's figures, machine-readable.
    let summary: Value =
        serde_json::from_slice(&std::fs::read(out.join("summary.json")).expect("summary.json"))
            .expect("json");
    let ranks = summary["ranks"].as_array().expect("ranks");
    assert_eq!(ranks.len(), 2);
    assert_eq!(ranks[0]["figures"]["steps"], 12.0);
}

#[test]
fn parameter_server_spans_and_figures() {
    let dir = tmp();
    let cfg = config_file(
        dir.path(),
        "ps.yaml",
        "arch: flat\nparameter_server: {aggr_type: sync, num_workers: 2}\nnum_server_rounds: 10\n",
    );
    let out = dir.path().join("ps");
    let (_, events) = launch_traced(&cfg, &out, LIMIT);
    assert_eq!(process_name(&events, 0), "rank 0 (root)");
    assert_eq!(process_name(&events, 2), "rank 2 (worker)");
    assert_spans(&events, 0, &["ps_round", "optimizer_step", "eval"]);
    for pid in [1, 2] {
        assert_spans(&events, pid, &["ps_pull", "ps_push", "forward", "backward"]);
    }
    let summary: Value =
        serde_json::from_slice(&std::fs::read(out.join("summary.json")).expect("summary.json"))
            .expect("json");
    let root = &summary["ranks"][0];
    assert_eq!(root["role"], "root");
    assert!(
        root["figures"]["updates_per_s"].as_f64() > Some(0.0),
        "{summary}"
    );
    assert!(
        root["figures"]["bytes_per_round"].as_f64() > Some(0.0),
        "{summary}"
    );
}

/// `GET /metrics` on 127.0.0.1:`port`, if it answers.
fn scrape(port: u16) -> Option<String> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .ok()?;
    let mut reply = String::new();
    s.read_to_string(&mut reply).ok()?;
    let (head, body) = reply.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.").then_some(())?;
    head.contains(" 200 ").then(|| body.to_string())
}

const PARSER: &str = r#"
import sys
from prometheus_client.parser import text_string_to_metric_families
names = {}
for family in text_string_to_metric_families(sys.stdin.read()):
    for s in family.samples:
        names.setdefault(s.name, []).append(s.labels)
for n in sorted(names):
    print(n, sorted({k for labels in names[n] for k in labels}))
"#;

/// The metric families and label names of `text` as Prometheus' own Python parser reads it
/// (failing the test if it rejects the text).
fn parse_with_prometheus_client(text: &str) -> String {
    let mut py = Command::new("python3")
        .args(["-c", PARSER])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3");
    py.stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("write");
    let o = py.wait_with_output().expect("parser");
    assert!(
        o.status.success(),
        "prometheus_client rejects the text:\n{}\n{text}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn a_running_rank_serves_prometheus_metrics() {
    serves_prometheus_metrics(&[]);
}

/// The same of a program's rank (`flotilla_burn::train`).
#[test]
fn a_programs_running_rank_serves_prometheus_metrics() {
    let program = example("lenet5_program");
    serves_prometheus_metrics(&["--", program.to_str().expect("utf8")]);
}

/// A port that is free with the next one (rank `r` serves on `base + r`), below Linux's
/// ephemeral range (32768 and up), where the job's own connections take their local ports
/// (a port picked there, free when picked, may be such a connection's before rank 1 binds
/// it: once, in CI, rank 1 of the program's job served nothing for 120 s).
fn free_base() -> u16 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    let salt = u64::from(std::process::id()) ^ now.map_or(0, |d| u64::from(d.subsec_nanos()));
    (0..1000u64)
        .map(|i| 20_000 + ((salt + i * 7_919) % 10_000) as u16)
        .find(|&p| {
            let a = std::net::TcpListener::bind(("127.0.0.1", p));
            let b = std::net::TcpListener::bind(("127.0.0.1", p + 1));
            a.is_ok() && b.is_ok()
        })
        .expect("two free ports in 20000..30000")
}

/// Rank 1 of a running job (of the program after `--`, if any) serves `/metrics` that the
/// Prometheus client parses, with every family of a training rank.
fn serves_prometheus_metrics(program: &[&str]) {
    let probe = Command::new("python3")
        .args(["-c", "import prometheus_client"])
        .output();
    if !probe.is_ok_and(|o| o.status.success()) {
        assert!(
            std::env::var("CI").is_err(),
            "CI must have python3 with prometheus_client (see .ci/run)"
        );
        eprintln!(
            "SKIPPED: python3 with prometheus_client not installed (pip install prometheus_client)"
        );
        return;
    }
    let dir = tmp();
    let base = free_base();
    let mut c = flotilla();
    c.args([
        "launch",
        "-n",
        "2",
        "--batch-size",
        "16",
        "--train-limit",
        "640",
    ])
    .args(["--epochs", "50", "--metrics-port", &base.to_string()])
    .args(["--output", dir.path().join("run").to_str().expect("utf8")])
    .args(program)
    .stdout(Stdio::null())
    .stderr(Stdio::null());
    let _job = Proc(c.spawn().expect("spawn"));
    // Rank 1 serves on base + 1; wait until it has finished an epoch (accuracy is known).
    let started = Instant::now();
    let text = loop {
        if let Some(t) = scrape(base + 1)
            && t.contains("flotilla_test_accuracy")
        {
            break t;
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "no metrics with a test accuracy on port {} within 120 s",
            base + 1
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    let parsed = parse_with_prometheus_client(&text);
    for family in [
        "flotilla_step_seconds_bucket",
        "flotilla_step_seconds_count",
        "flotilla_data_wait_seconds_count",
        "flotilla_samples_per_second",
        "flotilla_train_loss",
        "flotilla_test_accuracy",
        "flotilla_all_reduce_seconds_sum",
        "flotilla_steps_total",
    ] {
        assert!(
            parsed.lines().any(|l| l.starts_with(&format!("{family} "))),
            "no {family} in the parsed metrics:\n{parsed}"
        );
    }
    for family in ["flotilla_bytes_sent_total", "flotilla_bytes_received_total"] {
        assert!(
            parsed
                .lines()
                .any(|l| l.starts_with(&format!("{family} ")) && l.contains("'peer'")),
            "no per-peer {family}:\n{parsed}"
        );
    }
}
