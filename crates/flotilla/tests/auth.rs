//! Authentication end to end: real `flotilla` processes sharing (or not) a cluster secret.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use common::*;

const SHORT_RUN: &str = "train_limit: 2000\nepochs: 1\nwarmup_steps: 0\nbatch_size: 64\n";

/// Every file under `dir` whose content contains `needle`.
fn files_containing(dir: &std::path::Path, needle: &str) -> Vec<std::path::PathBuf> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return found;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            found.extend(files_containing(&p, needle));
        } else if std::fs::read(&p)
            .map(|b| String::from_utf8_lossy(&b).contains(needle))
            .unwrap_or(false)
        {
            found.push(p);
        }
    }
    found
}

/// A 2-rank `flotilla launch` with `FLOTILLA_SECRET` trains (its ranks authenticate every
/// connection); the secret is in no file of the job and no output.
#[test]
fn a_launch_with_a_secret_trains_and_keeps_the_secret_to_itself() {
    let dir = tmp();
    let cfg = config_file(dir.path(), "short.yaml", SHORT_RUN);
    let out = dir.path().join("out");
    let secret = format!("launch-job-secret-{}", std::process::id());
    let mut c = flotilla();
    c.args(["launch", &cfg, "--output", out.to_str().expect("utf8")])
        .env("FLOTILLA_SECRET", &secret)
        .env("RUST_LOG", "info");
    let o = run_with_deadline(c, Duration::from_secs(180));
    assert!(o.status.success(), "{}", text(&o));
    let all = text(&o);
    assert!(final_fields(&o).contains_key("test_acc"), "{all}");
    assert!(!all.contains(&secret), "the secret leaked into the output");
    assert!(
        !all.contains("not authenticated"),
        "the job must be authenticated:\n{all}"
    );
    assert!(
        files_containing(&out, &secret).is_empty(),
        "the secret leaked into a file: {:?}",
        files_containing(&out, &secret)
    );
}

/// A secret file readable by others is refused before any rank starts, naming the file and
/// the fix.
#[test]
fn a_secret_file_readable_by_others_is_refused_at_once() {
    let dir = tmp();
    let cfg = config_file(dir.path(), "short.yaml", SHORT_RUN);
    let file = dir.path().join("secret");
    std::fs::write(&file, "file-secret-value\n").expect("write");
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let mut c = flotilla();
    c.args(["launch", &cfg, "--output"])
        .arg(dir.path().join("out"))
        .env("FLOTILLA_SECRET_FILE", &file);
    let o = run_with_deadline(c, Duration::from_secs(30));
    assert!(!o.status.success());
    let all = text(&o);
    assert!(
        all.contains("chmod 600") && all.contains(file.to_str().expect("utf8")),
        "{all}"
    );
    assert!(!all.contains("file-secret-value"), "{all}");
    assert!(!all.contains("launching"), "no rank may start:\n{all}");
}

/// Ranks started by hand: a rank 1 with another secret is refused by rank 0 and told so
/// (naming rank 0), rank 0 logs the refusal naming the address and keeps waiting, and the
/// real rank 1 (the right secret) then trains with it: its checkpoint is bit for bit the one
/// of the same job launched without the intruder.
#[test]
fn a_rank_with_another_secret_is_refused_and_named() {
    let dir = tmp();
    let cfg = config_file(dir.path(), "short.yaml", SHORT_RUN);
    let out = dir.path().join("out");
    let port = free_port();
    let rank = |rank: &str, secret: &str, output: &str| {
        let mut c = flotilla();
        c.args(["train", &cfg, "--rank", rank, "--master-port", &port])
            .args(["--output", output])
            .env("FLOTILLA_SECRET", secret);
        c
    };
    let out0 = out.to_str().expect("utf8").to_string();
    let r0 = rank("0", "the-right-secret", &out0);
    let rank0 = std::thread::spawn(move || run_with_deadline(r0, Duration::from_secs(180)));
    let intruder_out = dir.path().join("intruder");
    let intruder = rank(
        "1",
        "a-guessed-secret",
        intruder_out.to_str().expect("utf8"),
    );
    let o = run_with_deadline(intruder, Duration::from_secs(60));
    assert!(!o.status.success(), "the intruder must fail:\n{}", text(&o));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.contains(&format!(
            "authentication failed: rank 0 (127.0.0.1:{port}) does not share this job's secret"
        )),
        "{}",
        text(&o)
    );
    let real = run_with_deadline(
        rank("1", "the-right-secret", &out0),
        Duration::from_secs(180),
    );
    assert!(real.status.success(), "{}", text(&real));
    let o0 = rank0.join().expect("rank 0");
    assert!(o0.status.success(), "{}", text(&o0));
    let log0 = String::from_utf8_lossy(&o0.stderr);
    assert!(
        log0.contains(
            "refused a connection (authentication failed: unranked process at 127.0.0.1:"
        ) && log0.contains("does not share this job's secret"),
        "rank 0 logs the refusal naming the address:\n{log0}"
    );
    for text in [&log0.to_string(), &text(&o)] {
        assert!(!text.contains("the-right-secret") && !text.contains("a-guessed-secret"));
    }
    // The same job undisturbed.
    let undisturbed = dir.path().join("undisturbed");
    let mut c = flotilla();
    c.args([
        "launch",
        &cfg,
        "--output",
        undisturbed.to_str().expect("utf8"),
    ])
    .env("FLOTILLA_SECRET", "the-right-secret");
    let o = run_with_deadline(c, Duration::from_secs(180));
    assert!(o.status.success(), "{}", text(&o));
    assert_bitwise(
        "the job the intruder tried to join against the same job undisturbed",
        &checkpoint_tensors(&out),
        &checkpoint_tensors(&undisturbed),
    );
}
