//! The cluster secret of a job that `flotilla launch` starts. A job is authenticated by
//! default: the user's secret (`FLOTILLA_SECRET`, `FLOTILLA_SECRET_FILE`, `comm.secret_file`)
//! when there is one, else a fresh random one the launcher makes for this job alone, in a
//! 0600 file of a private (0700) directory that is removed when the launcher ends (also after
//! a failure or Ctrl-C), and if the launcher was killed, by the user's next launch on the host
//! ([`sweep_stale`]). Only the user's `insecure` opt-out runs a job without one.
//!
//! The ranks are told the file's path (`FLOTILLA_SECRET_FILE`), never the secret: local ranks
//! in their environment, ranks over ssh in a copy in their job directory
//! ([`crate::launch::inventory`], removed there when the job ends).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use flotilla_tcp::{SECRET_FILE_ENV, Secret};
use flotilla_train::TrainConfig;

/// A job's secret, and the private directory of the one the launcher made (removed on drop).
pub struct JobSecret {
    secret: Option<Secret>,
    made: Option<(tempfile::TempDir, PathBuf)>,
}

impl JobSecret {
    /// The secret of a job of `config`: the user's, else (unless `comm.insecure`) a new one.
    /// Says on stdout which, once per launch.
    pub fn for_job(config: &TrainConfig) -> Result<JobSecret> {
        if let Some(secret) = config.secret()? {
            return Ok(JobSecret {
                secret: Some(secret),
                made: None,
            });
        }
        if config.comm.insecure {
            println!(
                "[launcher] insecure: no cluster secret and no TLS asked for; any process that \
                 reaches this job's ports can join it"
            );
            return Ok(JobSecret {
                secret: None,
                made: None,
            });
        }
        let job = JobSecret::fresh()?;
        if let Some(file) = job.made_file() {
            println!(
                "[launcher] made a fresh cluster secret for this job ({}, removed when the job \
                 ends); every connection between its ranks proves it",
                file.display()
            );
        }
        Ok(job)
    }

    /// A fresh random secret in a new 0600 file of a new private directory (a benchmark's
    /// job, or a job with no secret of the user's).
    pub fn fresh() -> Result<JobSecret> {
        use std::os::unix::fs::PermissionsExt;
        sweep_stale(&std::env::temp_dir());
        // 0700 from its creation: no other local user may list or open what it holds. Its
        // name holds the launcher's pid and pid namespace, so that a later launch removes it
        // if this one was killed before it could ([`sweep_stale`]).
        let dir = tempfile::Builder::new()
            .prefix(&format!(
                "{PREFIX}{}-{}-",
                std::process::id(),
                pid_namespace()
            ))
            .permissions(std::fs::Permissions::from_mode(0o700))
            .tempdir()
            .context("creating a private directory for the job's secret")?;
        let file = dir.path().join("secret");
        let secret = Secret::generate();
        secret.write_private(&file)?;
        Ok(JobSecret {
            secret: Some(secret),
            made: Some((dir, file)),
        })
    }

    /// The secret, when the job has one.
    pub fn secret(&self) -> Option<&Secret> {
        self.secret.as_ref()
    }

    /// What a local rank's environment needs for it: `FLOTILLA_SECRET_FILE` naming the made
    /// secret's file (a user's secret reaches the ranks as it reached the launcher: they
    /// inherit its environment and read the same config).
    pub fn rank_env(&self) -> Option<(String, String)> {
        self.made_file()
            .map(|f| (SECRET_FILE_ENV.to_string(), f.display().to_string()))
    }

    /// The file of the secret the launcher made.
    pub fn made_file(&self) -> Option<&Path> {
        self.made.as_ref().map(|(_, f)| f.as_path())
    }
}

/// The start of the name of a job's private directory, before its launcher's pid.
const PREFIX: &str = "flotilla-job-";

/// Removes the private directories under `base` that launchers of this user made and could
/// not remove: their launcher is gone (killed by SIGKILL or the OOM killer, where no cleanup
/// runs), by the pid in the name, in this process's pid namespace (another container's
/// pids mean nothing here). A directory of a live process or of another namespace, another
/// user's, a symbolic link, or one named otherwise is left alone; what fails to go is left
/// too (best effort: a launch never fails for another job's leftovers).
fn sweep_stale(base: &Path) {
    use std::os::unix::fs::MetadataExt;
    let namespace = pid_namespace();
    if namespace == 0 {
        return; // unknown here: no pid in a name can be told dead
    }
    let Ok(entries) = std::fs::read_dir(base) else {
        return;
    };
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = (name.to_str().and_then(launcher_of)).filter(|l| l.1 == namespace) else {
            continue;
        };
        let pid = pid.0;
        let Ok(meta) = std::fs::symlink_metadata(entry.path()) else {
            continue;
        };
        if meta.is_dir() && meta.uid() == me && !process_exists(pid) {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// The launcher's pid and pid namespace in a private directory's name
/// (`flotilla-job-<pid>-<namespace>-<random>`).
fn launcher_of(name: &str) -> Option<(i32, u64)> {
    let mut parts = name.strip_prefix(PREFIX)?.splitn(3, '-');
    let pid = parts.next()?.parse().ok().filter(|&p: &i32| p > 0)?;
    let namespace = parts.next()?.parse().ok()?;
    parts.next()?;
    Some((pid, namespace))
}

/// This process's pid namespace (the inode `/proc/self/ns/pid` names), 0 where unknown.
fn pid_namespace() -> u64 {
    let link = std::fs::read_link("/proc/self/ns/pid").unwrap_or_default();
    let text = link.to_string_lossy();
    let digits = text.trim_start_matches("pid:[").trim_end_matches(']');
    digits.parse().unwrap_or(0)
}

/// Whether a process `pid` exists (`kill(pid, 0)`: only "no such process" says it does not).
fn process_exists(pid: i32) -> bool {
    // SAFETY: signal 0 sends nothing; it only checks that `pid` exists.
    let gone = unsafe { libc::kill(pid, 0) } == -1
        && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
    !gone
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_made_secret_is_private_and_removed_with_the_job() -> Result<()> {
        use std::os::unix::fs::PermissionsExt;
        let config = TrainConfig::default();
        if config.secret()?.is_some() {
            return Ok(()); // the environment of this test run holds a secret already
        }
        let job = JobSecret::for_job(&config)?;
        let file = job.made_file().context("made")?.to_path_buf();
        let dir = file.parent().context("dir")?.to_path_buf();
        assert_eq!(
            std::fs::metadata(&file)?.permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(std::fs::metadata(&dir)?.permissions().mode() & 0o777, 0o700);
        let read = Secret::from_file(&file)?;
        assert_eq!(read.bytes(), job.secret().context("secret")?.bytes());
        assert_eq!(
            job.rank_env(),
            Some((SECRET_FILE_ENV.into(), file.display().to_string()))
        );
        let name = dir.file_name().and_then(|n| n.to_str()).context("name")?;
        let mine = (std::process::id() as i32, pid_namespace());
        assert_eq!(launcher_of(name), Some(mine));
        drop(job);
        assert!(!file.exists() && !dir.exists());
        let mut insecure = TrainConfig::default();
        insecure.comm.insecure = true;
        let none = JobSecret::for_job(&insecure)?;
        assert!(none.secret().is_none() && none.rank_env().is_none());
        Ok(())
    }

    #[test]
    fn a_launch_removes_the_directories_of_killed_launchers_only() -> Result<()> {
        let base = tempfile::tempdir()?;
        // A process that has ended: its pid names no process now.
        let mut child = std::process::Command::new("true").spawn()?;
        let dead = child.id() as i32;
        child.wait()?;
        let (mine, ns) = (std::process::id() as i32, pid_namespace());
        assert_ne!(ns, 0, "/proc/self/ns/pid");
        let make = |name: String| -> Result<PathBuf> {
            let dir = base.path().join(name);
            std::fs::create_dir(&dir)?;
            std::fs::write(dir.join("secret"), b"x")?;
            Ok(dir)
        };
        let stale = make(format!("{PREFIX}{dead}-{ns}-abc"))?;
        let live = make(format!("{PREFIX}{mine}-{ns}-abc"))?;
        let elsewhere = make(format!("{PREFIX}{dead}-{}-abc", ns + 1))?;
        let unnamed = make(format!("{PREFIX}abcdef"))?;
        let other = make(format!("other-{dead}-{ns}-abc"))?;
        let link = base.path().join(format!("{PREFIX}{dead}-{ns}-link"));
        std::os::unix::fs::symlink(&live, &link)?;
        sweep_stale(base.path());
        assert!(!stale.exists(), "the killed launcher's directory stays");
        for kept in [&live, &elsewhere, &unnamed, &other] {
            assert!(
                kept.join("secret").exists(),
                "{} was removed",
                kept.display()
            );
        }
        assert!(
            std::fs::symlink_metadata(&link).is_ok(),
            "the link was followed or removed"
        );
        assert_eq!(launcher_of("flotilla-job-12-34-x"), Some((12, 34)));
        assert_eq!(launcher_of("flotilla-job-12-x-34"), None);
        assert_eq!(launcher_of("flotilla-job-12-34"), None);
        Ok(())
    }
}
