//! Secure by default, end to end: a job `flotilla launch` starts with no secret of the user's
//! gets one of its own (and refuses a stranger), a rank started with no secret refuses at
//! once, and no other local process can take the rendezvous port before rank 0 does.
//!
//! The ranks are a user's program (`examples/custom_model.rs`) behind a shell gate: the gated
//! rank waits for a file the test creates, so the test acts (a stranger joins, a process
//! grabs the port) while that rank has provably not started, whatever the machine's speed.

mod common;
#[path = "common/running.rs"]
mod running;

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{TEST_SECRET, example, flotilla, safetensors_file, text, tmp};
use flotilla_tcp::{CommConfig, CommError, RendezvousError, TcpGroup};
use running::Running;

/// `flotilla launch -n 2 -- sh -c GATE custom_model` where rank `gated` waits for `gate` to
/// exist before it runs; the model is written to `out`.
fn gated_launch(gated: usize, gate: &Path, out: &Path) -> Running {
    let script = format!(
        "if [ \"$RANK\" = {gated} ]; then while [ ! -e '{}' ]; do sleep 0.05; done; fi; exec \"$0\"",
        gate.display()
    );
    let mut c = flotilla();
    c.args(["launch", "-n", "2", "--", "sh", "-c", &script])
        .arg(example("custom_model"))
        .env("STEPS", "20")
        .env("BATCH", "32")
        .env("OUT", out);
    Running::start(c)
}

/// The rendezvous port the launcher published (`launching 2 ranks of ... on ADDR:PORT`).
fn published_port(job: &Running) -> u16 {
    job.wait_lines(1, Duration::from_secs(30), |l| l.starts_with("launching "))
        .unwrap_or_else(|| panic!("no launching line:\n{}", job.text()));
    let line = job.find(|l| l.starts_with("launching ")).expect("line");
    let port = line.text.rsplit(':').next().expect("port");
    port.trim()
        .parse()
        .unwrap_or_else(|_| panic!("{}", line.text))
}

/// Runs the job to its end (the gate opened) and returns the model it wrote.
fn finish(mut job: Running, gate: &Path, out: &Path) -> BTreeMap<String, Vec<f32>> {
    std::fs::write(gate, "").expect("open the gate");
    let status = job.wait_exit(Duration::from_secs(240));
    assert!(
        status.is_some_and(|s| s.success()),
        "the job must train:\n{}",
        job.text()
    );
    safetensors_file(out)
}

/// A default launch (no secret anywhere) makes a secret, says so, refuses a process that
/// joins without it as rank 1 while the real rank 1 has not started, trains bit for bit as
/// the same job undisturbed, and removes its secret at the end.
#[test]
fn a_default_launch_makes_a_secret_and_a_stranger_without_it_is_refused() {
    let dir = tmp();
    let (gate, out) = (dir.path().join("gate"), dir.path().join("job.safetensors"));
    let job = gated_launch(1, &gate, &out);
    let port = published_port(&job);
    job.wait_lines(1, Duration::from_secs(30), |l| {
        l.contains("made a fresh cluster secret")
    })
    .unwrap_or_else(|| panic!("the launcher must say it made a secret:\n{}", job.text()));
    // The stranger claims rank 1 with no secret (it opted out of authentication itself).
    let stranger = CommConfig::new(Some(1), 2)
        .with_master("127.0.0.1", port)
        .with_insecure(true)
        .with_join_timeout(Duration::from_secs(20));
    let t = Instant::now();
    let refused = TcpGroup::connect(stranger).err();
    assert!(
        matches!(
            refused,
            Some(CommError::Rendezvous(RendezvousError::AuthRequired { .. }))
        ),
        "the stranger must be refused for lacking the secret, got {refused:?} after {:?}",
        t.elapsed()
    );
    let secret_file = job
        .find(|l| l.contains("made a fresh cluster secret"))
        .and_then(|l| {
            let start = l.text.find('(')? + 1;
            let end = l.text[start..].find(',')? + start;
            Some(PathBuf::from(&l.text[start..end]))
        })
        .expect("the secret's file is named");
    let disturbed = finish(job, &gate, &out);
    assert!(
        !secret_file.exists(),
        "{} must be removed with the job",
        secret_file.display()
    );
    let undisturbed_out = dir.path().join("undisturbed.safetensors");
    let undisturbed = finish(
        gated_launch(1, &gate, &undisturbed_out),
        &gate,
        &undisturbed_out,
    );
    assert_eq!(disturbed, undisturbed, "the stranger changed the training");
}

/// A process that tries to take the published port while rank 0 has not started cannot: the
/// launcher holds it from before it is published and hands the socket to rank 0, which then
/// trains the job.
#[test]
fn a_process_that_grabs_the_port_cannot_become_rank_0() {
    let dir = tmp();
    let (gate, out) = (dir.path().join("gate"), dir.path().join("job.safetensors"));
    let job = gated_launch(0, &gate, &out);
    let port = published_port(&job);
    let grab = TcpListener::bind(("127.0.0.1", port));
    assert!(
        grab.is_err(),
        "another process took the job's port {port} before rank 0 started"
    );
    let model = finish(job, &gate, &out);
    assert!(!model.is_empty());
}

/// A rank with no secret (by hand, torchrun-style variables) refuses at once, saying how to
/// make one and how to opt out; it never waits for rank 0.
#[test]
fn a_rank_with_no_secret_refuses_in_under_10_s() {
    let dir = tmp();
    let mut c = flotilla();
    c.args(["train", "--max-steps", "1", "--output"])
        .arg(dir.path().join("out"))
        .env("RANK", "1")
        .env("WORLD_SIZE", "2")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", common::free_port());
    let t = Instant::now();
    let o = common::run_with_deadline(c, Duration::from_secs(60));
    assert!(!o.status.success(), "{}", text(&o));
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    let all = text(&o);
    for needle in [
        "no cluster secret",
        "flotilla secret",
        "--insecure",
        "FLOTILLA_INSECURE=1",
    ] {
        assert!(all.contains(needle), "`{needle}` missing:\n{all}");
    }
}

/// `flotilla secret` prints a fresh secret each time; `--out` writes a private file that a
/// rank accepts and never overwrites one.
#[test]
fn flotilla_secret_makes_fresh_private_secrets() {
    use std::os::unix::fs::PermissionsExt;
    let run = |args: &[&str]| {
        let mut c = flotilla();
        c.arg("secret").args(args);
        common::run_with_deadline(c, Duration::from_secs(30))
    };
    let (a, b) = (run(&[]), run(&[]));
    let out = |o: &std::process::Output| String::from_utf8_lossy(&o.stdout).into_owned();
    let (a, b) = (out(&a), out(&b));
    assert_eq!(a.trim().len(), 64, "{a}");
    assert_ne!(a, b);
    let dir = tmp();
    let file = dir.path().join("s");
    let o = run(&["--out", file.to_str().expect("utf8")]);
    assert!(o.status.success(), "{}", text(&o));
    let mode = std::fs::metadata(&file).expect("file").permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    flotilla_tcp::Secret::from_file(&file).expect("a rank accepts it");
    assert!(
        !run(&["--out", file.to_str().expect("utf8")])
            .status
            .success()
    );
    assert_ne!(TEST_SECRET, a.trim());
}
