//! Ranks on inventory hosts, started with the system OpenSSH client.
//!
//! A job started by `flotilla launch --inventory` has a directory of its own on every host it
//! uses, `<remote_dir>/<job id>` (`remote_dir` defaults to `.flotilla/jobs`, relative to the
//! login directory). The launcher writes the job's effective config there (and with `--sync`
//! the binary and the model spec), then starts each rank as
//!
//! ```sh
//! cd <job dir> && echo $$ > rank-R.pid && env RANK=R … <flotilla> train config.yaml; rc=$?; rm -f rank-R.pid; exit $rc
//! ```
//!
//! sshd makes the remote shell the leader of a new session and process group, so the pid it
//! records is also the group of the rank: [`stop_script`] ends a rank with `kill -- -PID`,
//! after checking that the process with that pid still runs this job's command line (a pid
//! file left by a killed rank never hits a stranger whose pid was reused). Ranks write their
//! output under `<job dir>/output`; the launcher copies each host's back at the end.

use std::path::Path;
use std::process::{Command, Stdio};

#[cfg(test)]
use std::os::unix::process::CommandExt;

use anyhow::{Context, Result, bail};
use flotilla_cluster::ssh::{join, quote};
use flotilla_cluster::{Placement, SshTarget};
use flotilla_tcp::{SECRET_ENV, SECRET_FILE_ENV, TOKEN_ENV};

/// Default parent of the per-job directories on the hosts (relative: under the login
/// directory).
pub const DEFAULT_REMOTE_DIR: &str = ".flotilla/jobs";

/// The job's output directory, relative to its directory on a host.
pub const REMOTE_OUTPUT: &str = "output";

/// The job's config, relative to its directory on a host.
pub const REMOTE_CONFIG: &str = "config.yaml";

/// The cluster secret, relative to the job directory (mode 0600; never on a command line:
/// the ranks are told its path in `FLOTILLA_SECRET_FILE`).
pub const REMOTE_SECRET: &str = "secret";

/// The binary, relative to the job directory, when `--sync` copied it.
pub const REMOTE_EXE: &str = "flotilla";

/// The TLS CA certificate, relative to a job directory on a host (`crate::launch::tls`).
pub const REMOTE_TLS_CA: &str = "tls-ca.pem";
/// The host's TLS certificate, relative to its job directory.
pub const REMOTE_TLS_CERT: &str = "tls-cert.pem";
/// The host's TLS private key, relative to its job directory.
pub const REMOTE_TLS_KEY: &str = "tls-key.pem";

/// The job's credentials in its directory on a host: the secret and the TLS files, removed
/// when the job ends or is stopped.
pub const CREDENTIALS: [&str; 4] = [
    REMOTE_SECRET,
    REMOTE_TLS_CA,
    REMOTE_TLS_CERT,
    REMOTE_TLS_KEY,
];

/// Where a job lives on its hosts and how each rank is reached.
#[derive(Debug, Clone)]
pub struct RemoteJob {
    /// Unique id of the job (`<unix seconds>-<launcher pid>`).
    pub job_id: String,
    /// `<remote_dir>/<job id>` on every host.
    pub dir: String,
    /// The ssh target of each rank, in rank order.
    pub ranks: Vec<SshTarget>,
    /// The binary the ranks run (remote path).
    pub exe: String,
    /// Whether the job has a cluster secret (in [`REMOTE_SECRET`] in the job directory).
    pub secret: bool,
}

impl RemoteJob {
    /// The job of `placement` under `remote_dir`; `exe` is the binary's path on the hosts.
    pub fn new(placement: &Placement, remote_dir: &str, exe: String) -> Result<RemoteJob> {
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let job_id = format!("{secs}-{}", std::process::id());
        let n = placement.topology().world_size();
        let ranks = (0..n)
            .map(|r| match placement.host(r) {
                Some(h) => Ok(SshTarget::from_host(h)?),
                None => bail!("placement has no host for rank {r}"),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(RemoteJob {
            dir: format!("{}/{job_id}", remote_dir.trim_end_matches('/')),
            job_id,
            ranks,
            exe,
            secret: false,
        })
    }

    /// One target per distinct login, in rank order of first use.
    pub fn hosts(&self) -> Vec<&SshTarget> {
        let mut seen = std::collections::HashSet::new();
        self.ranks
            .iter()
            .filter(|t| seen.insert(t.login_key()))
            .collect()
    }

    /// Rank `rank`'s index among the ranks on its host (its `LOCAL_RANK`).
    pub fn local_rank(&self, rank: usize) -> usize {
        let key = self.ranks[rank].login_key();
        self.ranks[..rank]
            .iter()
            .filter(|t| t.login_key() == key)
            .count()
    }

    /// `ssh … <remote command>` that runs rank `rank` with `env` (its pid recorded, its
    /// exit code passed through). The host's own secret variables are cleared; with a
    /// secret, the rank reads it from the job directory's [`REMOTE_SECRET`] file (its path,
    /// not the secret, is on the command line).
    pub fn rank_command(&self, rank: usize, env: &[(String, String)]) -> Result<Command> {
        let train = [self.exe.clone(), "train".into(), REMOTE_CONFIG.into()];
        self.program_command(rank, env, &train)
    }

    /// As [`RemoteJob::rank_command`], running `program` (its path on the host, then its
    /// arguments) instead of `flotilla train`.
    pub fn program_command(
        &self,
        rank: usize,
        env: &[(String, String)],
        program: &[String],
    ) -> Result<Command> {
        let target = self
            .ranks
            .get(rank)
            .with_context(|| format!("no host for rank {rank}"))?;
        let mut words: Vec<String> = vec!["env".into()];
        for var in [SECRET_ENV, SECRET_FILE_ENV, TOKEN_ENV] {
            words.extend(["-u".into(), var.into()]);
        }
        if self.secret {
            words.push(format!("{SECRET_FILE_ENV}={REMOTE_SECRET}"));
        }
        words.extend(env.iter().map(|(k, v)| format!("{k}={v}")));
        words.extend(program.iter().cloned());
        let words: Vec<&str> = words.iter().map(String::as_str).collect();
        let pid = format!("rank-{rank}.pid");
        let script = format!(
            "cd {dir} && echo $$ > {pid} && {run}; rc=$?; rm -f {pid}; exit $rc",
            dir = quote(&self.dir)?,
            run = join(&words)?,
        );
        Ok(ssh(target, &script))
    }
}

/// `ssh <target's arguments> <script>` with no stdin.
pub fn ssh(target: &SshTarget, script: &str) -> Command {
    let mut cmd = Command::new("ssh");
    cmd.args(target.args()).arg(script).stdin(Stdio::null());
    cmd
}

/// Runs `cmd` to its end (its output captured); an error shows what the host said.
pub fn run_checked(mut cmd: Command, target: &SshTarget, what: &str) -> Result<String> {
    let out = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .with_context(|| {
            format!(
                "running ssh to {} ({what}); is OpenSSH installed?",
                target.name
            )
        })?;
    if !out.status.success() {
        bail!(
            "{what} on host {} ({}) failed ({}): {}",
            target.name,
            target.destination(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Copies local file `src` to `<dir>/<name>` on `target` with `mode` (through ssh's stdin:
/// needs nothing on the host but a POSIX shell; written under a temporary name, then renamed).
pub fn copy_file(target: &SshTarget, src: &Path, dir: &str, name: &str, mode: &str) -> Result<()> {
    let file = std::fs::File::open(src).with_context(|| format!("opening {}", src.display()))?;
    let part = format!("{name}.part");
    let script = format!(
        "umask 077 && mkdir -p {d} && cd {d} && cat > {p} && chmod {mode} {p} && mv -f {p} {n}",
        d = quote(dir)?,
        p = quote(&part)?,
        n = quote(name)?,
        mode = quote(mode)?,
    );
    let mut cmd = ssh(target, &script);
    cmd.stdin(Stdio::from(file));
    run_checked(
        cmd,
        target,
        &format!("copying {} to {dir}/{name}", src.display()),
    )?;
    Ok(())
}

/// Removes the [`CREDENTIALS`] from job directory `dir` on `target`.
pub fn remove_credentials(target: &SshTarget, dir: &str) -> Result<()> {
    let script = format!(
        "cd {} 2>/dev/null && rm -f {} || true",
        quote(dir)?,
        CREDENTIALS.join(" ")
    );
    run_checked(
        ssh(target, &script),
        target,
        "removing the job's credentials",
    )?;
    Ok(())
}

/// Copies `<dir>/<REMOTE_OUTPUT>` of `target` into local `dest` (tar over ssh; nothing when
/// the host has no output, e.g. its ranks never started).
pub fn fetch_output(target: &SshTarget, dir: &str, dest: &Path) -> Result<()> {
    std::fs::create_dir_all(dest).with_context(|| format!("creating {}", dest.display()))?;
    let script = format!(
        "if cd {} 2>/dev/null; then tar -cf - .; else tar -cf - -T /dev/null; fi",
        quote(&format!("{dir}/{REMOTE_OUTPUT}"))?
    );
    let mut remote = ssh(target, &script)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("running ssh to {}", target.name))?;
    let Some(tar_in) = remote.stdout.take() else {
        bail!("no pipe from ssh to {}", target.name);
    };
    let local = Command::new("tar")
        .arg("-xf")
        .arg("-")
        .arg("-C")
        .arg(dest)
        .stdin(Stdio::from(tar_in))
        .output()
        .context("running tar to unpack a host's output")?;
    let remote_out = remote.wait_with_output()?;
    if !remote_out.status.success() || !local.status.success() {
        bail!(
            "copying the output of host {} back failed: {} {}",
            target.name,
            String::from_utf8_lossy(&remote_out.stderr).trim(),
            String::from_utf8_lossy(&local.stderr).trim()
        );
    }
    Ok(())
}

/// The job directories to stop, as shell words: `<remote_dir>/<job>`, or every job under
/// `remote_dir` (`<remote_dir>/*`).
pub fn job_pattern(remote_dir: &str, job: Option<&str>) -> Result<String> {
    let base = quote(remote_dir.trim_end_matches('/'))?;
    Ok(match job {
        Some(id) => format!("{base}/{}", quote(id)?),
        None => format!("{base}/*"),
    })
}

/// A shell script that ends every rank recorded under the job directories `dirs` (a shell
/// pattern such as `.flotilla/jobs/*` is allowed): `TERM` to each rank's process group, `KILL`
/// after 5 s to what is left. A pid is signalled only if `/proc/<pid>/cmdline` still holds the
/// job's directory. Every rank is found before any is signalled: a rank that ends because
/// a peer was stopped removes its pid file, and would otherwise be missed (and reported as
/// not stopped) when it ends first. Prints `stopped <dir> rank-R.pid <pid>` per rank. The
/// jobs' [`CREDENTIALS`] are removed.
pub fn stop_script(dirs: &str) -> String {
    let credentials = CREDENTIALS.map(|c| format!("\"$d\"/{c}")).join(" ");
    format!(
        r#"found=""
nl='
'
for d in {dirs}; do
  [ -d "$d" ] && rm -f {credentials}
  for f in "$d"/rank-*.pid; do
    [ -f "$f" ] || continue
    p=$(cat "$f" 2>/dev/null)
    case "$p" in ''|*[!0-9]*) rm -f "$f"; continue;; esac
    job=$(basename "$d")
    if tr '\0' ' ' < /proc/"$p"/cmdline 2>/dev/null | grep -qF -- "$job"; then
      found="$found$p:$f$nl"
    else
      rm -f "$f"
    fi
  done
done
pids=""
while IFS= read -r e; do
  [ -n "$e" ] || continue
  p=${{e%%:*}}; f=${{e#*:}}
  kill -TERM -- "-$p" 2>/dev/null || kill -TERM "$p" 2>/dev/null
  pids="$pids $p"
  echo "stopped $f pid $p"
  rm -f "$f"
done <<EOF
$found
EOF
i=0
while [ $i -lt 50 ]; do
  alive=""
  for p in $pids; do kill -0 "$p" 2>/dev/null && alive="$alive $p"; done
  [ -z "$alive" ] && exit 0
  sleep 0.1
  i=$((i+1))
done
for p in $alive; do kill -KILL -- "-$p" 2>/dev/null || kill -KILL "$p" 2>/dev/null; echo "killed pid $p"; done
exit 0
"#
    )
}

/// Ends every rank of the job directories `dirs` on every host of `targets` (each host in
/// turn; a host that cannot be reached is reported and the others are still stopped).
/// Returns the lines the hosts printed, prefixed with the host, and the hosts' failures.
pub fn stop_on_hosts(targets: &[&SshTarget], dirs: &str) -> (Vec<String>, Vec<String>) {
    let script = stop_script(dirs);
    let (mut lines, mut failures) = (Vec::new(), Vec::new());
    for t in targets {
        match run_checked(ssh(t, &script), t, "stopping ranks") {
            Ok(out) => lines.extend(out.lines().map(|l| format!("{}: {l}", t.name))),
            Err(e) => failures.push(format!("{e:#}")),
        }
    }
    (lines, failures)
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_cluster::{Inventory, Topology, place};

    fn job() -> Result<RemoteJob> {
        let inv = Inventory::parse(
            "[pool]\nh1 ansible_port=2222\nh2\nh1 ansible_port=2222\n",
            "hosts.ini",
        )?;
        let topo = Topology::allreduce(3)?;
        RemoteJob::new(&place(&topo, &inv)?, "/jobs/", "/opt/flotilla".into())
    }

    #[test]
    fn ranks_sharing_a_host_are_one_login_with_local_ranks() -> Result<()> {
        let j = job()?;
        assert!(j.dir.starts_with("/jobs/"));
        assert_eq!(j.hosts().len(), 2);
        assert_eq!(
            (0..3).map(|r| j.local_rank(r)).collect::<Vec<_>>(),
            [0, 0, 1]
        );
        Ok(())
    }

    #[test]
    fn a_rank_command_records_its_pid_and_passes_its_exit_code() -> Result<()> {
        let j = job()?;
        let cmd = j.rank_command(2, &[("RANK".into(), "2".into())])?;
        let args: Vec<String> = cmd
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        let script = args.last().cloned().unwrap_or_default();
        assert!(args.contains(&"2222".to_owned()));
        assert!(script.starts_with(&format!("cd {} && echo $$ > rank-2.pid", j.dir)));
        // The host's own secret variables never reach the rank.
        let clear = "env -u FLOTILLA_SECRET -u FLOTILLA_SECRET_FILE -u FLOTILLA_TOKEN";
        assert!(
            script.ends_with(&format!(
                "{clear} 'RANK=2' /opt/flotilla train config.yaml; rc=$?; rm -f rank-2.pid; exit $rc"
            )),
            "{script}"
        );
        // With a secret, the rank is told the secret file's path (never the secret).
        let mut j = j;
        j.secret = true;
        let cmd = j.rank_command(2, &[("RANK".into(), "2".into())])?;
        let script = cmd
            .get_args()
            .last()
            .map(|a| a.to_string_lossy().into_owned());
        let script = script.unwrap_or_default();
        assert!(
            script.contains(&format!("{clear} 'FLOTILLA_SECRET_FILE=secret' 'RANK=2' ")),
            "{script}"
        );
        Ok(())
    }

    /// The stop script, run by a local shell on a fake job: the recorded process (whose
    /// command line names the job) is stopped, a pid file of a stranger is only removed.
    #[test]
    fn the_stop_script_ends_recorded_ranks_and_spares_strangers() -> Result<()> {
        let tmp = tempfile::tempdir()?;
        let dir = tmp.path().join("1234-5");
        std::fs::create_dir_all(&dir)?;
        let rank = Command::new("sh")
            .arg("-c")
            .arg(format!("sleep 30; echo {}", dir.display()))
            .process_group(0)
            .spawn()?;
        let mut stranger = Command::new("sleep").arg("30").spawn()?;
        std::fs::write(dir.join("rank-0.pid"), rank.id().to_string())?;
        // Reaped as soon as it ends, as sshd reaps a remote rank's shell.
        let mut rank = rank;
        let reaper = std::thread::spawn(move || rank.wait());
        std::fs::write(dir.join("rank-1.pid"), stranger.id().to_string())?;
        let out = Command::new("sh")
            .arg("-c")
            .arg(stop_script(&format!("{}/*", tmp.path().display())))
            .output()?;
        let status = reaper
            .join()
            .map_err(|_| anyhow::anyhow!("reaper panicked"))??;
        let stranger_alive = stranger.try_wait()?.is_none();
        let _ = stranger.kill();
        let _ = stranger.wait();
        assert!(out.status.success(), "{out:?}");
        assert!(!status.success(), "the rank was not stopped");
        assert!(stranger_alive, "the stranger was killed");
        assert!(!dir.join("rank-0.pid").exists() && !dir.join("rank-1.pid").exists());
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).lines().count(),
            1,
            "{out:?}"
        );
        Ok(())
    }

    /// A rank that ends the moment its peer is signalled (and removes its pid file, as the
    /// remote wrapper does) is still stopped and reported: every rank is found first.
    #[test]
    fn the_stop_script_reports_a_rank_that_ends_when_its_peer_is_stopped() -> Result<()> {
        let tmp = tempfile::tempdir()?;
        let dir = tmp.path().join("job-7");
        std::fs::create_dir(&dir)?;
        let second = dir.join("rank-1.pid");
        let spawn = |script: String| {
            Command::new("sh")
                .arg("-c")
                .arg(script)
                .arg(dir.display().to_string())
                .process_group(0)
                .spawn()
        };
        // Rank 0 empties and removes rank 1's pid file when it is stopped (as rank 1's
        // wrapper does when rank 1 fails on losing rank 0). It spins on builtins, so that the
        // trap runs at once, and empties the file with a builtin: faster than the script can
        // go on to the next file.
        let first = spawn(format!(
            "trap ': > {0}; rm -f {0}; exit 1' TERM; while :; do :; done",
            second.display()
        ))?;
        let other = spawn("trap 'exit 1' TERM; while :; do sleep 0.02; done".into())?;
        std::fs::write(dir.join("rank-0.pid"), first.id().to_string())?;
        std::fs::write(&second, other.id().to_string())?;
        let groups = [first.id(), other.id()];
        // Reaped as soon as they end, as sshd reaps a remote rank's shell.
        let (tx, ended) = std::sync::mpsc::channel();
        for mut c in [first, other] {
            let tx = tx.clone();
            std::thread::spawn(move || tx.send(c.wait()));
        }
        let out = Command::new("sh")
            .arg("-c")
            .arg(stop_script(&format!("{}/*", tmp.path().display())))
            .output()?;
        let mut stopped = 0;
        while let Ok(status) = ended.recv_timeout(std::time::Duration::from_secs(10)) {
            assert!(!status?.success(), "a rank ended by itself");
            stopped += 1;
            if stopped == groups.len() {
                break;
            }
        }
        for g in groups {
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{g}")])
                .status();
        }
        assert_eq!(stopped, 2, "rank(s) left running: {out:?}");
        let said = String::from_utf8_lossy(&out.stdout);
        assert_eq!(said.matches("stopped ").count(), 2, "{out:?}");
        Ok(())
    }
}
