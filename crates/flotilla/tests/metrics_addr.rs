//! Where a rank's `/metrics` can be reached from: by default this machine only (loopback), the
//! network once `telemetry.metrics_addr` says so.
//!
//! The "network" is a network namespace the test makes (`ip netns`) whose `lo` also holds an
//! address of the benchmarking range (198.18.0.1): ranks run in it, and probes
//! connect from inside it, to its loopback and to that address. No traffic leaves the
//! namespace. Needs root (CI runs as root); elsewhere the test says why it is skipped.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// The namespace's non-loopback address.
const ADDRESS: &str = "198.18.0.1";

/// A network namespace with `lo` up holding [`ADDRESS`] too; deleted when dropped.
struct Netns(String);

impl Netns {
    fn make() -> Result<Netns, String> {
        let ns = Netns(format!("flotilla-metrics-{}", std::process::id()));
        let name = ns.0.as_str();
        // The address goes on the namespace's `lo` (not a dummy interface: kernels without
        // the dummy module refuse that); a socket bound to 127.0.0.1 still does not accept
        // connections to it.
        let steps: [&[&str]; 3] = [
            &["netns", "add", name],
            &["-n", name, "link", "set", "lo", "up"],
            &[
                "-n",
                name,
                "addr",
                "add",
                &format!("{ADDRESS}/32"),
                "dev",
                "lo",
            ],
        ];
        for args in steps {
            let out = Command::new("ip").args(args).output();
            match out {
                Ok(o) if o.status.success() => {}
                Ok(o) => {
                    return Err(format!(
                        "ip {}: {}",
                        args.join(" "),
                        String::from_utf8_lossy(&o.stderr).trim()
                    ));
                }
                Err(e) => return Err(format!("ip: {e}")),
            }
        }
        Ok(ns)
    }

    /// `cmd` run inside the namespace (same program, arguments, environment and directory).
    fn wrap(&self, cmd: &Command) -> Command {
        let mut inside = Command::new("ip");
        inside
            .args(["netns", "exec", &self.0])
            .arg(cmd.get_program())
            .args(cmd.get_args());
        for (k, v) in cmd.get_envs() {
            match v {
                Some(v) => inside.env(k, v),
                None => inside.env_remove(k),
            };
        }
        if let Some(dir) = cmd.get_current_dir() {
            inside.current_dir(dir);
        }
        inside
    }

    /// Whether a TCP connection to `addr:port`, from inside the namespace, is accepted.
    fn reachable(&self, addr: &str, port: u16) -> bool {
        let mut probe = Command::new("bash");
        probe.args(["-c", &format!("exec 3<>/dev/tcp/{addr}/{port}")]);
        self.wrap(&probe)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

/// A one-rank training run inside `ns` serving `/metrics` on `port`, with `extra` flags.
fn rank(ns: &Netns, port: u16, extra: &[&str]) -> Proc {
    let dir = tmp();
    let mut c = flotilla();
    c.args([
        "train",
        "-n",
        "1",
        "--batch-size",
        "16",
        "--train-limit",
        "640",
    ])
    .args(["--epochs", "200", "--metrics-port", &port.to_string()])
    .args(extra)
    .args(["--output", dir.path().join("run").to_str().expect("utf8")])
    .env("FLOTILLA_SECRET", "test-secret-0123456789");
    let child = ns
        .wrap(&c)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    // The output directory lives as long as the test process (the rank is killed first).
    std::mem::forget(dir);
    Proc(child)
}

/// Waits (at most 120 s) until `/metrics` on `port` accepts connections on the namespace's
/// loopback: the rank is up and serving.
fn wait_serving(ns: &Netns, port: u16) {
    let started = Instant::now();
    while !ns.reachable("127.0.0.1", port) {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "/metrics on port {port} never served on loopback"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

#[test]
fn metrics_listen_on_loopback_unless_metrics_addr_widens_them() {
    let ns = match Netns::make() {
        Ok(ns) => ns,
        Err(why) => {
            assert!(
                std::env::var_os("CI").is_none(),
                "CI must run the network-namespace test (as root): {why}"
            );
            eprintln!("SKIPPED: cannot make a network namespace: {why}");
            return;
        }
    };
    let (local, wide) = (9461, 9471);
    let _default = rank(&ns, local, &[]);
    let _widened = rank(&ns, wide, &["--metrics-addr", "0.0.0.0"]);
    wait_serving(&ns, local);
    wait_serving(&ns, wide);
    assert!(
        !ns.reachable(ADDRESS, local),
        "/metrics answered on {ADDRESS} by default: it must listen on loopback only"
    );
    assert!(
        ns.reachable(ADDRESS, wide),
        "/metrics with metrics_addr 0.0.0.0 is not reachable on {ADDRESS}"
    );
}
