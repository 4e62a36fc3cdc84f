//! `flotilla launch --inventory` over a real OpenSSH server on a loopback port.
//!
//! The test installs nothing: where `sshd` exists and the test runs as root (sshd refuses to
//! run its privilege separation otherwise), it starts `sshd -D` with a generated host key and a
//! generated user key on a free port of 127.0.0.1, writes an Ansible-style inventory of two
//! `127.0.0.1` entries that reach it, and launches real jobs through it. Otherwise it prints
//! why it is skipped — except with `CI` set, where it fails. `.ci/run` installs
//! `openssh-server` so CI runs it.

mod common;
#[path = "common/running.rs"]
mod running;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;

const SSHD: &str = "/usr/sbin/sshd";

/// An sshd on a loopback port, killed when dropped, and the inventory that reaches it.
struct Sshd {
    _proc: Proc,
    dir: tempfile::TempDir,
    inventory: PathBuf,
}

impl Drop for Sshd {
    /// Whatever a failed test left running on the "hosts" is ended through the same sshd.
    fn drop(&mut self) {
        let mut stop = flotilla();
        stop.args(["stop", "--inventory"])
            .arg(&self.inventory)
            .arg("--remote-dir")
            .arg(self.dir.path().join("jobs"))
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let _ = run_with_deadline(stop, Duration::from_secs(30));
    }
}

fn keygen(path: &Path) {
    let ok = Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-f"])
        .arg(path)
        .status()
        .expect("ssh-keygen runs")
        .success();
    assert!(ok, "ssh-keygen failed");
}

/// Starts sshd, or says why not.
fn start_sshd() -> Option<Sshd> {
    let root = std::fs::read_to_string("/proc/self/status")
        .map(|s| {
            s.lines()
                .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false);
    let have_ssh = Command::new("ssh").arg("-V").output().is_ok();
    if !Path::new(SSHD).exists() || !root || !have_ssh {
        // CI installs them (.ci/run): there a missing tool is a failure, never a skip.
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must run the ssh test: needs {SSHD}, the ssh client and root (found sshd: {}, \
             ssh: {have_ssh}, root: {root}); .ci/run installs openssh-server",
            Path::new(SSHD).exists()
        );
        eprintln!(
            "skipped: needs {SSHD} and the ssh client (openssh-server, openssh-client) and root \
             (found sshd: {}, ssh: {have_ssh}, root: {root}); .ci/run installs them",
            Path::new(SSHD).exists()
        );
        return None;
    }
    let dir = tmp();
    let d = dir.path();
    keygen(&d.join("hostkey"));
    keygen(&d.join("userkey"));
    std::fs::copy(d.join("userkey.pub"), d.join("authorized_keys")).expect("authorized_keys");
    let port = free_port();
    let config = format!(
        "Port {port}\nListenAddress 127.0.0.1\nHostKey {d}/hostkey\n\
         AuthorizedKeysFile {d}/authorized_keys\nPidFile {d}/sshd.pid\nStrictModes no\n\
         PermitRootLogin prohibit-password\nPasswordAuthentication no\n\
         KbdInteractiveAuthentication no\nUsePAM no\nMaxStartups 100\nMaxSessions 100\n",
        d = d.display()
    );
    std::fs::write(d.join("sshd_config"), config).expect("sshd_config");
    // sshd's privilege separation directory (created by the package's service normally).
    let _ = std::fs::create_dir_all("/run/sshd");
    let child = Command::new(SSHD)
        .arg("-D")
        .arg("-e")
        .arg("-f")
        .arg(d.join("sshd_config"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start sshd");
    let proc = Proc(child);
    let inventory = d.join("hosts.ini");
    // Ansible's syntax as users write it: quoted common args, group vars.
    let text = format!(
        "[pool]\n127.0.0.1 ansible_port={port}\n127.0.0.1 ansible_port={port}\n\
         [pool:vars]\nansible_user=root\nansible_ssh_private_key_file={d}/userkey\n\
         ansible_ssh_common_args='-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR'\n",
        d = d.display()
    );
    std::fs::write(&inventory, text).expect("inventory");
    let started = Instant::now();
    while std::net::TcpStream::connect(format!("127.0.0.1:{port}")).is_err() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "sshd did not listen"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    Some(Sshd {
        _proc: proc,
        dir,
        inventory,
    })
}

const CONFIG: &str = "model:\n  spec: lenet5\ntopology:\n  world_size: 2\ndata:\n  train_limit: 6000\n\
schedule:\n  epochs: 1\n";

/// Two ranks over ssh (`--sync`, with a cluster secret) train LeNet-5 exactly as a local
/// launch of the same config does; each rank's run.log comes back to the launcher's output
/// directory. The secret reached the ranks only through the job directory's 0600 file, which
/// is gone when the job ends.
#[test]
fn inventory_launch_over_ssh_trains_as_the_local_launch() {
    let Some(sshd) = start_sshd() else { return };
    let dir = tmp();
    let cfg = config_file(dir.path(), "job.yaml", CONFIG);
    let inv = sshd.inventory.to_str().expect("utf8");
    let jobs = sshd.dir.path().join("jobs");
    let (remote_out, local_out) = (dir.path().join("ssh"), dir.path().join("local"));
    let args = [
        cfg.as_str(),
        "--inventory",
        inv,
        "--sync",
        "--remote-dir",
        jobs.to_str().expect("utf8"),
        "--output",
        remote_out.to_str().expect("utf8"),
    ];
    let secret = format!("ssh-job-secret-{}", std::process::id());
    let mut c = flotilla();
    c.arg("launch").args(args).env("FLOTILLA_SECRET", &secret);
    let over_ssh = run_with_deadline(c, Duration::from_secs(240));
    assert!(over_ssh.status.success(), "{}", text(&over_ssh));
    assert!(!text(&over_ssh).contains(&secret));
    let local = launch(
        &[&cfg, "--output", local_out.to_str().expect("utf8")],
        Duration::from_secs(240),
    );
    let (a, b) = (final_fields(&over_ssh), final_fields(&local));
    assert!(a["test_acc"] > 0.25, "{}", text(&over_ssh));
    assert_eq!(a["test_acc"], b["test_acc"], "{}", text(&over_ssh));
    assert_eq!(a["loss"], b["loss"]);
    let out = String::from_utf8_lossy(&over_ssh.stdout);
    assert!(out.contains("[rank 1 @ 127.0.0.1] rank 1/2 up"), "{out}");
    assert!(out.contains("local_rank=1"), "{out}");
    for rank in 0..2 {
        assert!(run_log(&remote_out, rank).contains("final test_acc="));
    }
    assert!(remote_out.join("summary.json").is_file());
    // The binary was copied into the job's directory; the job left no rank running.
    let job: serde_json::Value =
        serde_json::from_slice(&std::fs::read(remote_out.join("job.json")).expect("job.json"))
            .expect("job.json is JSON");
    let job_dir = PathBuf::from(job["dir"].as_str().expect("dir"));
    assert!(job_dir.join("flotilla").is_file());
    // The job's credentials left the host with it.
    for file in ["secret", "tls-ca.pem", "tls-cert.pem", "tls-key.pem"] {
        assert!(
            !job_dir.join(file).exists(),
            "{file} left in {}",
            job_dir.display()
        );
    }
    let config = std::fs::read_to_string(job_dir.join("config.yaml")).expect("config");
    assert!(!config.contains(&secret));
    assert_none_left(job_dir.to_str().expect("utf8"), Duration::from_secs(5));
}

/// `flotilla launch --inventory ... -- PROGRAM`: a user's program (the `custom_model`
/// example, at the same path on the hosts) runs as the ranks over ssh, with the job's
/// secret, and trains bitwise as the same program launched locally.
#[test]
fn a_user_program_over_ssh_trains_as_the_local_launch() {
    let Some(sshd) = start_sshd() else { return };
    let dir = tmp();
    let exe = std::env::current_exe().expect("test path");
    let example = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("target")
        .join("examples/custom_model");
    assert!(
        example.is_file(),
        "{} is missing (cargo test --release --workspace builds it)",
        example.display()
    );
    let mnist = repo().join("data/mnist");
    let program = |out: &Path| -> Vec<String> {
        // The hosts get no environment but the job's: the program's settings are arguments.
        ["env", "STEPS=20", "BATCH=32"]
            .iter()
            .map(|s| s.to_string())
            .chain([
                format!("OUT={}", out.display()),
                format!("MNIST_DIR={}", mnist.display()),
                example.display().to_string(),
            ])
            .collect()
    };
    let jobs = sshd.dir.path().join("jobs");
    let (remote_out, local_out) = (
        dir.path().join("ssh.safetensors"),
        dir.path().join("local.safetensors"),
    );
    let mut c = flotilla();
    c.args([
        "launch",
        "-n",
        "2",
        "--inventory",
        sshd.inventory.to_str().expect("utf8"),
    ])
    .args(["--remote-dir", jobs.to_str().expect("utf8"), "--output"])
    .arg(dir.path().join("out"))
    .arg("--")
    .args(program(&remote_out))
    .env(
        "FLOTILLA_SECRET",
        format!("program-secret-{}", std::process::id()),
    );
    let over_ssh = run_with_deadline(c, Duration::from_secs(240));
    assert!(over_ssh.status.success(), "{}", text(&over_ssh));
    assert!(
        text(&over_ssh).contains("[rank 0 @ 127.0.0.1] test accuracy"),
        "{}",
        text(&over_ssh)
    );
    let mut c = flotilla();
    c.args(["launch", "-n", "2", "--"])
        .args(program(&local_out));
    let local = run_with_deadline(c, Duration::from_secs(240));
    assert!(local.status.success(), "{}", text(&local));
    assert_bitwise(
        "over ssh vs local",
        &safetensors_file(&remote_out),
        &safetensors_file(&local_out),
    );
}

/// The first rendezvous port the launcher has published, if any: on its `launching ... on
/// ADDR:PORT` line, or on its `rank 0 listens on port PORT` line.
fn published_port(job: &running::Running) -> Option<u16> {
    job.lines().iter().find_map(|l| {
        let t = l.text.as_str();
        if let Some(rest) = t.split("listens on port ").nth(1) {
            return rest
                .split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse()
                .ok();
        }
        let on = t.strip_prefix("launching ")?.rsplit(" on ").next()?;
        on.rsplit(':').next()?.trim().parse().ok()
    })
}

/// Over ssh no port is published before rank 0 holds it: rank 0 binds a port on its host
/// and says it, and only then does the launcher give it to the other ranks. Rank 0 here is
/// a program held at a gate: whatever the launcher published meanwhile must already be
/// taken (a port picked by the launcher and bound by rank 0 later could be taken by any
/// local process in between, which would then play rank 0). Then the job trains.
#[test]
fn over_ssh_no_port_is_published_before_rank_0_holds_it() {
    let Some(sshd) = start_sshd() else { return };
    let dir = tmp();
    let exe = std::env::current_exe().expect("test path");
    let example = exe.parent().and_then(|d| d.parent()).expect("target");
    let example = example.join("examples/custom_model");
    let gate = dir.path().join("gate");
    let script = format!(
        "if [ \"$RANK\" = 0 ]; then while [ ! -e '{}' ]; do sleep 0.05; done; fi; exec \"$0\" \"$@\"",
        gate.display()
    );
    let out = dir.path().join("model.safetensors");
    let mut c = flotilla();
    c.args(["launch", "-n", "2", "--inventory"])
        .arg(&sshd.inventory)
        .arg("--remote-dir")
        .arg(sshd.dir.path().join("jobs"))
        .arg("--output")
        .arg(dir.path().join("out"))
        .args(["--", "sh", "-c", &script, "env", "STEPS=5", "BATCH=32"])
        .arg(format!("OUT={}", out.display()))
        .arg(format!("MNIST_DIR={}", repo().join("data/mnist").display()))
        .arg(&example)
        .env(
            "FLOTILLA_SECRET",
            format!("port-job-secret-{}", std::process::id()),
        );
    let mut job = running::Running::start(c);
    job.wait_lines(1, Duration::from_secs(60), |l| l.starts_with("launching "))
        .unwrap_or_else(|| panic!("no launching line:\n{}", job.text()));
    // Both ranks' ssh sessions have had time to start; rank 0 waits at its gate.
    std::thread::sleep(Duration::from_secs(2));
    if let Some(port) = published_port(&job) {
        assert!(
            std::net::TcpListener::bind(("127.0.0.1", port)).is_err(),
            "port {port} was published while rank 0 (at its gate) did not hold it:\n{}",
            job.text()
        );
    }
    std::fs::write(&gate, "").expect("open the gate");
    job.wait_lines(1, Duration::from_secs(60), |l| {
        l.contains("listens on port")
    })
    .unwrap_or_else(|| panic!("rank 0 never said its port:\n{}", job.text()));
    published_port(&job).expect("a published port");
    let status = job.wait_exit(Duration::from_secs(240));
    assert!(status.is_some_and(|s| s.success()), "{}", job.text());
    assert!(out.is_file(), "{}", job.text());
}

/// Starts a long job over ssh and returns the launcher and its job directory once both
/// ranks train.
fn start_long_job(sshd: &Sshd, out: &Path, jobs: &Path) -> (Proc, mpsc::Receiver<String>) {
    let dir = out.parent().expect("parent");
    let cfg = config_file(
        dir,
        "long.yaml",
        "topology:\n  world_size: 2\nschedule:\n  epochs: 50\n",
    );
    let mut c = flotilla();
    c.args(["launch", &cfg, "--inventory"])
        .arg(&sshd.inventory)
        .arg("--remote-dir")
        .arg(jobs)
        .arg("--output")
        .arg(out)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut launcher = Proc(c.spawn().expect("launch"));
    let (tx, rx) = mpsc::channel();
    for stream in [
        launcher
            .0
            .stdout
            .take()
            .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
        launcher
            .0
            .stderr
            .take()
            .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
    ]
    .into_iter()
    .flatten()
    {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stream).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut training = 0;
    while training < 2 {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = rx
            .recv_timeout(left)
            .expect("both ranks start training within 60 s");
        if line.contains("] training: ") {
            training += 1;
        }
    }
    (launcher, rx)
}

fn wait_exit(launcher: &mut Proc, limit: Duration) -> std::process::ExitStatus {
    let started = Instant::now();
    loop {
        if let Some(s) = launcher.0.try_wait().expect("try_wait") {
            return s;
        }
        assert!(
            started.elapsed() < limit,
            "the launcher did not end within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `flotilla stop --inventory` ends every rank the launcher started over ssh (by recorded
/// pid), and the launcher reports it; Ctrl-C on the launcher does the same.
#[test]
fn stop_and_ctrl_c_end_every_remote_rank() {
    let Some(sshd) = start_sshd() else { return };
    let dir = tmp();
    let jobs = sshd.dir.path().join("jobs");
    let jobs_s = jobs.to_str().expect("utf8").to_owned();

    let (mut launcher, rx) = start_long_job(&sshd, &dir.path().join("a"), &jobs);
    let mut stop = flotilla();
    stop.args(["stop", "--inventory"])
        .arg(&sshd.inventory)
        .args(["--remote-dir", &jobs_s]);
    let o = run_with_deadline(stop, Duration::from_secs(30));
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("stopped 2 rank(s) on 1 host(s)"),
        "{}",
        text(&o)
    );
    assert!(!wait_exit(&mut launcher, Duration::from_secs(30)).success());
    let said: Vec<String> = rx.try_iter().collect();
    assert!(
        said.iter().any(|l| l.contains("ssh exit code 255")),
        "{said:#?}"
    );
    assert_none_left(&jobs_s, Duration::from_secs(10));

    let (mut launcher, rx) = start_long_job(&sshd, &dir.path().join("b"), &jobs);
    let ok = Command::new("kill")
        .args(["-INT", &launcher.0.id().to_string()])
        .status()
        .expect("kill")
        .success();
    assert!(ok);
    assert!(!wait_exit(&mut launcher, Duration::from_secs(30)).success());
    let said: Vec<String> = rx.try_iter().collect();
    assert!(said.iter().any(|l| l.contains("interrupted")), "{said:#?}");
    let stopped = said
        .iter()
        .filter(|l| l.contains("127.0.0.1: stopped "))
        .count();
    assert_eq!(stopped, 2, "{said:#?}");
    assert_none_left(&jobs_s, Duration::from_secs(10));
}

/// Two ranks over ssh with TLS: the launcher finds each host's `flotilla certs` pair (by its
/// inventory address) beside the CA and copies it into the job directory (mode 0600); the
/// ranks' config points at the copies, the job trains, and the copies are removed at its end.
#[test]
fn inventory_launch_over_ssh_copies_each_hosts_tls_files() {
    let Some(sshd) = start_sshd() else { return };
    let dir = tmp();
    let certs = dir.path().join("certs");
    let mut c = flotilla();
    c.args(["certs", "--hosts", "127.0.0.1", "--out"])
        .arg(&certs);
    let o = run_with_deadline(c, Duration::from_secs(30));
    assert!(o.status.success(), "{}", text(&o));
    let cfg = config_file(
        dir.path(),
        "tls.yaml",
        "topology:\n  world_size: 2\ndata:\n  train_limit: 2000\nschedule:\n  max_steps: 20\n",
    );
    let (jobs, out) = (sshd.dir.path().join("jobs"), dir.path().join("out"));
    let mut c = flotilla();
    c.args(["launch", &cfg, "--inventory"])
        .arg(&sshd.inventory)
        .arg("--remote-dir")
        .arg(&jobs)
        .arg("--output")
        .arg(&out)
        .env("FLOTILLA_TLS_CA", certs.join("ca.pem"))
        .env("FLOTILLA_TLS_CERT", certs.join("127.0.0.1.pem"))
        .env("FLOTILLA_TLS_KEY", certs.join("127.0.0.1.key"));
    let o = run_with_deadline(c, Duration::from_secs(240));
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("[launcher] TLS on every connection"),
        "{}",
        text(&o)
    );
    let job: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("job.json")).expect("job.json"))
            .expect("job.json is JSON");
    let job_dir = PathBuf::from(job["dir"].as_str().expect("dir"));
    // The ranks trained with TLS from the copies (a wrong CA, certificate or key fails the
    // handshake), and the copies, credentials, are gone with the job.
    for copy in ["tls-ca.pem", "tls-cert.pem", "tls-key.pem"] {
        assert!(
            !job_dir.join(copy).exists(),
            "{copy} left in {}",
            job_dir.display()
        );
    }
    let config = std::fs::read_to_string(job_dir.join("config.yaml")).expect("config");
    assert!(
        config.contains("ca: tls-ca.pem") && config.contains("key: tls-key.pem"),
        "{config}"
    );
    assert_none_left(job_dir.to_str().expect("utf8"), Duration::from_secs(5));
}

/// The pid of the process of an elastic job's slot `slot` that runs in a directory under
/// `jobs` (its `FLOTILLA_SLOT` and its working directory: the job's, on the "host").
fn slot_pid(jobs: &Path, slot: u64) -> Option<u32> {
    pid_with(jobs, &format!("FLOTILLA_SLOT={slot}"))
}

/// The pid of a process that runs in a directory under `jobs` (on the "host") with the
/// environment variable `kv` (`NAME=value`).
fn pid_with(jobs: &Path, kv: &str) -> Option<u32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let cwd = std::fs::read_link(format!("/proc/{pid}/cwd")).ok()?;
        let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
        (cwd.starts_with(jobs) && env.split(|&b| b == 0).any(|v| v == kv.as_bytes())).then_some(pid)
    })
}

/// The sshd's inventory with a third entry for a third process (one process per entry), in
/// `dir`.
fn three_entries(sshd: &Sshd, dir: &Path) -> PathBuf {
    let three = dir.join("three.ini");
    let hosts = std::fs::read_to_string(&sshd.inventory).expect("inventory");
    let first = hosts.lines().nth(1).expect("a host line");
    std::fs::write(
        &three,
        hosts.replacen(first, &format!("{first}\n{first}"), 1),
    )
    .expect("inventory");
    three
}

/// Runs the elastic launch `c` whose processes run under `jobs`, SIGKILLing slot 1's once it
/// has run a while; the launcher must say the lighthouse keeps the membership, replace the
/// process and end at 0. Its output.
fn run_losing_slot_1(c: Command, jobs: &Path) -> String {
    let killer = kill_slot_later(jobs, 1);
    let o = run_with_deadline(c, Duration::from_secs(300));
    let killed = killer.join().expect("killer");
    let all = text(&o);
    assert!(killed.is_some(), "slot 1's process was never found:\n{all}");
    assert!(o.status.success(), "{all}");
    assert!(all.contains("the launcher keeps the membership"), "{all}");
    assert!(
        // ssh says a remote SIGKILL as exit code 137.
        all.contains("restart 1/1 after: rank 1 failed (exit code 137)"),
        "{all}"
    );
    all
}

/// SIGKILLs the process of slot `slot` under `jobs` once it has run for 3 s (within 120 s);
/// its pid, or `None` if it never ran.
fn kill_slot_later(jobs: &Path, slot: u64) -> std::thread::JoinHandle<Option<u32>> {
    kill_later(jobs, format!("FLOTILLA_SLOT={slot}"))
}

/// SIGKILLs the process under `jobs` with the environment variable `kv` once it has run for
/// 3 s (within 120 s); its pid, or `None` if it never ran.
fn kill_later(jobs: &Path, kv: String) -> std::thread::JoinHandle<Option<u32>> {
    let at = jobs.to_path_buf();
    std::thread::spawn(move || {
        let started = Instant::now();
        let mut seen = None;
        while started.elapsed() < Duration::from_secs(120) {
            if let Some(pid) = pid_with(&at, &kv)
                && seen.get_or_insert_with(Instant::now).elapsed() > Duration::from_secs(3)
            {
                // SAFETY: kill(2) on a pid of this test's own job; no memory is involved.
                assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
                return Some(pid);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    })
}

/// Slots 0 and 2 of the job in `out` trained on in a later generation without exiting, and
/// slot 3 (the replacement) joined; each finished.
fn assert_trained_on(out: &Path, all: &str) {
    for slot in [0, 2, 3] {
        let log = std::fs::read_to_string(out.join(format!("slot-{slot}/run.log")))
            .unwrap_or_else(|e| panic!("slot {slot}'s run.log: {e}\n{all}"));
        let generations: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("] generation "))
            .collect();
        assert!(
            generations.iter().any(|l| !l.contains("] generation 1:")),
            "slot {slot} trained in a later generation:\n{log}"
        );
        let pids: std::collections::BTreeSet<&str> = generations
            .iter()
            .filter_map(|l| l.split("(pid ").nth(1)?.split(')').next())
            .collect();
        assert_eq!(pids.len(), 1, "slot {slot} is one process:\n{log}");
        assert!(log.contains("final test_acc="), "slot {slot}:\n{log}");
    }
}

/// `flotilla launch -n 2:3 --inventory ... --max-restarts 1`: an elastic job over ssh, its
/// membership kept by the launcher here (the lighthouse on this host's address toward the
/// hosts). A process SIGKILLed on its host is left out, the others train on in a new
/// generation without exiting, a replacement started over ssh joins them, the job ends at 0,
/// and every process's run.log comes back with one line per generation it trained in.
#[test]
fn an_elastic_job_over_ssh_trains_on_when_a_rank_is_lost_and_replaced() {
    let Some(sshd) = start_sshd() else { return };
    let dir = tmp();
    let cfg = config_file(
        dir.path(),
        "job.yaml",
        "model:\n  spec: lenet5\ndata:\n  train_limit: 12000\nschedule:\n  epochs: 8\n\
         comm:\n  timeout_s: 10\n",
    );
    let three = three_entries(&sshd, dir.path());
    let inv = three.to_str().expect("utf8");
    let jobs = sshd.dir.path().join("jobs");
    let out = dir.path().join("out");
    let mut c = flotilla();
    c.args([
        "launch",
        &cfg,
        "-n",
        "2:3",
        "--max-restarts",
        "1",
        "--inventory",
        inv,
    ])
    .arg("--remote-dir")
    .arg(&jobs)
    .arg("--output")
    .arg(&out)
    .env(
        "FLOTILLA_SECRET",
        format!("elastic-ssh-job-secret-{}", std::process::id()),
    );
    let all = run_losing_slot_1(c, &jobs);
    assert_trained_on(&out, &all);
    // Nothing left running on the "hosts", and the job's credentials left with it.
    let job: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("job.json")).expect("job.json"))
            .expect("job.json is JSON");
    let job_dir = PathBuf::from(job["dir"].as_str().expect("dir"));
    for file in ["secret", "tls-ca.pem", "tls-cert.pem", "tls-key.pem"] {
        assert!(
            !job_dir.join(file).exists(),
            "{file} left in {}",
            job_dir.display()
        );
    }
    assert!(slot_pid(&jobs, 0).is_none() && slot_pid(&jobs, 2).is_none());
}

/// `flotilla launch -n 2:3 --inventory ... --max-restarts 1 -- PROGRAM`: a program's own
/// loop under `flotilla_burn::elastic::run` (`examples/custom_model.rs`) as an elastic job
/// over ssh. A process SIGKILLed on its host is left out, the others roll back to their
/// commit and train on, a replacement started over ssh joins with their state, and the job
/// ends at 0 with one test accuracy.
#[test]
fn an_elastic_program_over_ssh_trains_on_when_a_rank_is_lost_and_replaced() {
    let Some(sshd) = start_sshd() else { return };
    let dir = tmp();
    let example = std::env::current_exe()
        .expect("test path")
        .parent()
        .and_then(|d| d.parent())
        .expect("target")
        .join("examples/custom_model");
    assert!(example.is_file(), "{} is missing", example.display());
    let three = three_entries(&sshd, dir.path());
    let jobs = sshd.dir.path().join("jobs");
    let mut c = flotilla();
    c.args([
        "launch",
        "-n",
        "2:3",
        "--max-restarts",
        "1",
        "--timeout-s",
        "10",
    ])
    .arg("--inventory")
    .arg(&three)
    .arg("--remote-dir")
    .arg(&jobs)
    .arg("--output")
    .arg(dir.path().join("out"))
    .arg("--")
    .args(["env", "STEPS=200"])
    .arg(format!(
        "OUT={}",
        dir.path().join("model.safetensors").display()
    ))
    .arg(format!("MNIST_DIR={}", repo().join("data/mnist").display()))
    .arg(&example)
    .env(
        "FLOTILLA_SECRET",
        format!("elastic-program-{}", std::process::id()),
    );
    let all = run_losing_slot_1(c, &jobs);
    // The survivors and the replacement trained together in a later generation.
    let slots = |l: &str| -> Option<std::collections::BTreeSet<u64>> {
        let list = l.split("(slots [").nth(1)?.split(']').next()?;
        list.split(", ").map(|s| s.parse().ok()).collect()
    };
    assert!(
        all.lines()
            .filter(|l| l.contains("] generation "))
            .any(|l| slots(l) == Some([0, 2, 3].into())),
        "{all}"
    );
    assert_eq!(all.matches("] test accuracy ").count(), 1, "{all}");
}

/// An elastic flat parameter server over ssh (`min_world_size: 2`, 3 inventory entries: the
/// server and two workers): worker 2 SIGKILLed on its host is started again there over ssh
/// as a replacement, which rejoins the running job: the server takes it back into its rounds
/// at a version past 0, accepts its pushes, and the job ends at 0 with nothing left running.
#[test]
fn an_elastic_parameter_server_over_ssh_takes_back_a_replaced_worker() {
    let Some(sshd) = start_sshd() else { return };
    let dir = tmp();
    let cfg = config_file(
        dir.path(),
        "ps.yaml",
        "arch: flat\nworld_size: 3\nmin_world_size: 2\n\
         parameter_server: {aggr_type: sync, num_workers: 2}\nmodel: mlp\nbatch_size: 32\n\
         num_server_rounds: 1500\neval_every: 1000\noptimizer: {name: sgd, lr: 0.05}\n\
         timeout_s: 10\n",
    );
    let three = three_entries(&sshd, dir.path());
    let jobs = sshd.dir.path().join("jobs");
    let out = dir.path().join("out");
    let mut c = flotilla();
    c.args(["launch", &cfg, "--max-restarts", "1", "--inventory"])
        .arg(&three)
        .arg("--remote-dir")
        .arg(&jobs)
        .arg("--output")
        .arg(&out)
        .env(
            "FLOTILLA_SECRET",
            format!("elastic-ps-ssh-job-secret-{}", std::process::id()),
        );
    let killer = kill_later(&jobs, "RANK=2".into());
    let o = run_with_deadline(c, Duration::from_secs(300));
    let killed = killer.join().expect("killer");
    let all = text(&o);
    assert!(killed.is_some(), "worker 2 was never found:\n{all}");
    assert!(o.status.success(), "{all}");
    assert!(
        all.contains("restart 1/1 after: rank 2 failed (exit code 137); it rejoins"),
        "{all}"
    );
    assert_rejoined(&out, 2);
    assert!(pid_with(&jobs, "RANK=0").is_none() && pid_with(&jobs, "RANK=1").is_none());
}
