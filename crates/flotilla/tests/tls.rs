//! TLS end to end: `flotilla certs`, then real `flotilla` processes whose every connection is
//! mutual TLS (or that are refused for lacking it).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;

const SHORT_RUN: &str = "train_limit: 2000\nepochs: 1\nwarmup_steps: 0\nbatch_size: 64\n";

/// `flotilla` without any TLS variable of the environment running the tests.
fn flotilla_plain() -> Command {
    let mut c = flotilla();
    for var in ["FLOTILLA_TLS_CA", "FLOTILLA_TLS_CERT", "FLOTILLA_TLS_KEY"] {
        c.env_remove(var);
    }
    c
}

/// `flotilla certs --out <dir>/<name> --hosts 127.0.0.1`; returns the directory.
fn certs(dir: &Path, name: &str) -> PathBuf {
    let out = dir.join(name);
    let mut c = flotilla_plain();
    c.args(["certs", "--hosts", "127.0.0.1", "--out"]).arg(&out);
    let o = run_with_deadline(c, Duration::from_secs(30));
    assert!(o.status.success(), "{}", text(&o));
    out
}

/// The environment that points a rank at the files of `certs` for 127.0.0.1.
fn tls_env(c: &mut Command, certs: &Path) {
    c.env("FLOTILLA_TLS_CA", certs.join("ca.pem"))
        .env("FLOTILLA_TLS_CERT", certs.join("127.0.0.1.pem"))
        .env("FLOTILLA_TLS_KEY", certs.join("127.0.0.1.key"));
}

/// `flotilla certs` writes a CA and a host pair (keys 0600) and says how to use them; a
/// 2-rank launch with TLS on every connection then ends with the same checkpoint, bit for
/// bit, as the same launch without TLS.
#[test]
fn certs_then_a_tls_launch_trains_as_a_plain_one() {
    let dir = tmp();
    let mut c = flotilla_plain();
    let certs_dir = dir.path().join("certs");
    c.args([
        "certs",
        "--hosts",
        "127.0.0.1,localhost",
        "--days",
        "30",
        "--out",
    ])
    .arg(&certs_dir);
    let o = run_with_deadline(c, Duration::from_secs(30));
    assert!(o.status.success(), "{}", text(&o));
    let said = String::from_utf8_lossy(&o.stdout);
    assert!(
        said.contains("wrote") && said.contains("tls: {ca:") && said.contains("FLOTILLA_TLS_CA="),
        "{said}"
    );
    for (file, mode) in [
        ("ca.pem", 0o644),
        ("ca.key", 0o600),
        ("127.0.0.1.pem", 0o644),
        ("127.0.0.1.key", 0o600),
        ("localhost.key", 0o600),
    ] {
        let meta = std::fs::metadata(certs_dir.join(file)).expect(file);
        let got = std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o777;
        assert_eq!(got, mode, "{file}");
    }
    let run = |tls: bool, out: &str| {
        let mut c = flotilla_plain();
        c.args(["launch", "examples/mnist-mlp.yaml", "--max-steps", "30"])
            .args(["--train-limit", "2000", "--output"])
            .arg(dir.path().join(out))
            .env("RUST_LOG", "info");
        if tls {
            tls_env(&mut c, &certs_dir);
        }
        run_with_deadline(c, Duration::from_secs(240))
    };
    let encrypted = run(true, "tls");
    assert!(encrypted.status.success(), "{}", text(&encrypted));
    let all = text(&encrypted);
    assert!(
        all.contains("[launcher] TLS on every connection")
            && all.contains("TLS on every connection (cluster CA"),
        "{all}"
    );
    let plain = run(false, "plain");
    assert!(plain.status.success(), "{}", text(&plain));
    assert!(!text(&plain).contains("TLS on every connection"));
    assert!(final_fields(&encrypted)["test_acc"] > 0.3, "{all}");
    assert!(
        !all.contains("not authenticated"),
        "certificates authenticate:\n{all}"
    );
    assert_bitwise(
        "TLS against plain",
        &checkpoint_tensors(&dir.path().join("tls")),
        &checkpoint_tensors(&dir.path().join("plain")),
    );
}

/// Ranks started by hand against a TLS job (rank 0 reads `comm.tls` from its config): a
/// rank of another cluster CA fails naming rank 0 and the CA, a rank without TLS is told
/// that the job requires it; rank 0 logs both refusals with their addresses, keeps waiting,
/// and trains with the real rank 1 to the checkpoint, bit for bit, of the same job launched
/// without the intruders.
#[test]
fn a_rank_of_another_ca_or_without_tls_is_refused_and_the_job_finishes() {
    let dir = tmp();
    let (job, other) = (certs(dir.path(), "job"), certs(dir.path(), "other"));
    let tls_cfg = config_file(
        dir.path(),
        "tls.yaml",
        &format!(
            "{SHORT_RUN}comm:\n  tls:\n    ca: {}\n    cert: {}\n    key: {}\n",
            job.join("ca.pem").display(),
            job.join("127.0.0.1.pem").display(),
            job.join("127.0.0.1.key").display()
        ),
    );
    let plain_cfg = config_file(dir.path(), "plain.yaml", SHORT_RUN);
    let port = free_port();
    let rank = |cfg: &str, rank: &str, output: &Path| {
        let mut c = flotilla_plain();
        c.args(["train", cfg, "--rank", rank, "--master-port", &port])
            .arg("--output")
            .arg(output);
        c
    };
    let out = dir.path().join("out");
    let r0 = rank(&tls_cfg, "0", &out);
    let rank0 = std::thread::spawn(move || run_with_deadline(r0, Duration::from_secs(180)));
    // Another cluster's files (the environment wins over the config's `comm.tls`).
    let mut stranger = rank(&tls_cfg, "1", &dir.path().join("stranger"));
    tls_env(&mut stranger, &other);
    let o = run_with_deadline(stranger, Duration::from_secs(60));
    assert!(!o.status.success(), "the stranger must fail:\n{}", text(&o));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.contains(&format!(
            "TLS handshake with rank 0 (127.0.0.1:{port}) failed: its certificate is not signed by this job's CA"
        )) && e.contains("other/ca.pem"),
        "{}",
        text(&o)
    );
    // No TLS at all (and no secret: it says `--insecure`, or it would refuse to connect).
    let mut plain = rank(&plain_cfg, "1", &dir.path().join("plain"));
    plain.arg("--insecure");
    let o = run_with_deadline(plain, Duration::from_secs(60));
    assert!(
        !o.status.success(),
        "the plain rank must fail:\n{}",
        text(&o)
    );
    assert!(
        String::from_utf8_lossy(&o.stderr)
            .contains("did not start TLS, but this job requires TLS on every connection"),
        "{}",
        text(&o)
    );
    let real = run_with_deadline(rank(&tls_cfg, "1", &out), Duration::from_secs(180));
    assert!(real.status.success(), "{}", text(&real));
    let o0 = rank0.join().expect("rank 0");
    assert!(o0.status.success(), "{}", text(&o0));
    assert!(final_fields(&o0).contains_key("test_acc"), "{}", text(&o0));
    let log0 = String::from_utf8_lossy(&o0.stderr);
    assert!(
        log0.contains("refused a connection (TLS handshake with unranked process at 127.0.0.1:")
            && log0.contains("did not start TLS, but this job requires TLS on every connection"),
        "rank 0 logs both refusals naming the address:\n{log0}"
    );
    let undisturbed = dir.path().join("undisturbed");
    let mut c = flotilla_plain();
    c.args(["launch", &tls_cfg, "--output"]).arg(&undisturbed);
    let o = run_with_deadline(c, Duration::from_secs(180));
    assert!(o.status.success(), "{}", text(&o));
    assert_bitwise(
        "the job the intruders tried to join against the same job undisturbed",
        &checkpoint_tensors(&out),
        &checkpoint_tensors(&undisturbed),
    );
}

/// A key file that cannot be read fails the launch at once, naming the file, before any
/// rank starts.
#[test]
fn a_missing_key_file_fails_at_once_naming_it() {
    let dir = tmp();
    let certs_dir = certs(dir.path(), "certs");
    let missing = certs_dir.join("nowhere.key");
    let cfg = config_file(dir.path(), "short.yaml", SHORT_RUN);
    let mut c = flotilla_plain();
    c.args(["launch", &cfg, "--output"])
        .arg(dir.path().join("out"));
    tls_env(&mut c, &certs_dir);
    c.env("FLOTILLA_TLS_KEY", &missing);
    let started = std::time::Instant::now();
    let o = run_with_deadline(c, Duration::from_secs(30));
    assert!(!o.status.success());
    let all = text(&o);
    assert!(
        all.contains(&format!(
            "cannot read the TLS private key file {}",
            missing.display()
        )),
        "{all}"
    );
    assert!(!all.contains("launching"), "no rank may start:\n{all}");
    assert!(started.elapsed() < Duration::from_secs(20));
}
