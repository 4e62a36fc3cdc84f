//! The cluster secret of a job that `flotilla launch` starts. A job is authenticated by
//! default: the user's secret (`FLOTILLA_SECRET`, `FLOTILLA_SECRET_FILE`, `comm.secret_file`)
//! when there is one, else a fresh random one the launcher makes for this job alone, in a
//! 0600 file of a private (0700) directory that is removed when the launcher ends (also after
//! a failure or Ctrl-C). Only the user's `insecure` opt-out runs a job without one.
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
        // 0700 from its creation: no other local user may list or open what it holds.
        let dir = tempfile::Builder::new()
            .prefix("flotilla-job-")
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
        drop(job);
        assert!(!file.exists() && !dir.exists());
        let mut insecure = TrainConfig::default();
        insecure.comm.insecure = true;
        let none = JobSecret::for_job(&insecure)?;
        assert!(none.secret().is_none() && none.rank_env().is_none());
        Ok(())
    }
}
