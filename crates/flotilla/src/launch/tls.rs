//! TLS in `flotilla launch`. The launcher reads and checks the TLS files before any rank
//! starts (an unreadable or invalid file fails the launch naming it). Local ranks read the
//! same files: they inherit the launcher's environment (`FLOTILLA_TLS_*`) and config
//! (`comm.tls`). Ranks over ssh get theirs in one of three ways ([`RemoteTls::plan`]):
//!
//! * no TLS files given (and `comm.auto_tls`, the default): the launcher makes a CA and a
//!   pair for every host's inventory address, for this job alone, and copies each host its
//!   own as below (the job's connections cross a network: encrypted and authenticated by
//!   default); the local copies go with the launch's staging directory, the hosts' when the
//!   job ends;
//! * the CA file's directory was written by `flotilla certs` and holds `<address>.pem` and
//!   `<address>.key` for every host's inventory address: each host gets the CA and its own
//!   pair in its job directory (mode 0600, like the secret) and the ranks read them there;
//! * otherwise every host must hold its files at the configured paths (made absolute
//!   against the launcher's directory, as the data path is).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use flotilla_cluster::SshTarget;
use flotilla_tcp::TlsFiles;
use flotilla_train::TrainConfig;
use flotilla_train::config::TlsSetting;

use crate::launch::remote::{self, REMOTE_TLS_CA, REMOTE_TLS_CERT, REMOTE_TLS_KEY};

/// A local launch's TLS files, read and checked now (`None`: no TLS). An `--inventory`
/// launch checks its hosts' files in [`RemoteTls::plan`] instead.
pub fn check(config: &TrainConfig) -> Result<Option<TlsFiles>> {
    if config.topology.inventory.is_some() {
        return Ok(config.tls_files()?);
    }
    Ok(config.tls()?.map(|t| t.files().clone()))
}

/// How the ranks on inventory hosts get their TLS files.
#[derive(Debug, Clone, PartialEq)]
pub enum RemoteTls {
    /// No TLS.
    Off,
    /// Each host's files (by its address), copied into its job directory.
    Copy(Vec<(String, TlsFiles)>),
    /// The configured paths, which every host must hold.
    InPlace(TlsFiles),
}

impl RemoteTls {
    /// How the hosts of `targets` get their files: copies of `flotilla certs` files when
    /// the CA's directory has a pair for every host's address (each checked now), else the
    /// configured paths on the hosts; with no files given, a CA and pairs made for this job
    /// in `scratch` (a private directory that lives until the files are copied), unless
    /// `comm.auto_tls` is off or the job is `insecure`.
    /// `launcher`: the address of this host's service the ranks connect to (an elastic
    /// job's lighthouse), which a job-made CA makes a pair for too.
    pub fn plan(
        config: &TrainConfig,
        targets: &[&SshTarget],
        launcher: Option<&str>,
        scratch: &Path,
    ) -> Result<RemoteTls> {
        let files = match config.tls_files()? {
            Some(files) => files,
            None if config.comm.auto_tls && !config.comm.insecure => {
                job_files(targets, launcher, scratch)?
            }
            None => return Ok(RemoteTls::Off),
        };
        let dir = files
            .ca
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let pairs: Vec<(String, TlsFiles)> = targets
            .iter()
            .map(|t| {
                let host = TlsFiles {
                    ca: files.ca.clone(),
                    ..TlsFiles::in_dir(dir, &t.address)
                };
                (t.address.clone(), host)
            })
            .collect();
        if pairs
            .iter()
            .all(|(_, f)| f.cert.is_file() && f.key.is_file())
        {
            for (_, f) in &pairs {
                f.load()?;
            }
            return Ok(RemoteTls::Copy(pairs));
        }
        let missing: Vec<String> = pairs
            .iter()
            .filter(|(_, f)| !f.cert.is_file())
            .map(|(_, f)| f.cert.display().to_string())
            .collect();
        let abs = |p: &Path| -> Result<PathBuf> {
            std::path::absolute(p).with_context(|| format!("making {} absolute", p.display()))
        };
        let in_place = TlsFiles {
            ca: abs(&files.ca)?,
            cert: abs(&files.cert)?,
            key: abs(&files.key)?,
        };
        println!(
            "[launcher] TLS: no host certificate {} here (`flotilla certs --out {} --hosts ...`): every host must hold its own files at {}, {} and {}",
            missing.join(", "),
            dir.display(),
            in_place.ca.display(),
            in_place.cert.display(),
            in_place.key.display()
        );
        Ok(RemoteTls::InPlace(in_place))
    }

    /// What the ranks' config says (`comm.tls`): the job directory's copies, or the paths
    /// on the hosts.
    pub fn ranks_setting(&self) -> Option<TlsSetting> {
        match self {
            RemoteTls::Off => None,
            RemoteTls::Copy(_) => Some(TlsSetting {
                ca: REMOTE_TLS_CA.into(),
                cert: REMOTE_TLS_CERT.into(),
                key: REMOTE_TLS_KEY.into(),
            }),
            RemoteTls::InPlace(f) => Some(TlsSetting {
                ca: f.ca.clone(),
                cert: f.cert.clone(),
                key: f.key.clone(),
            }),
        }
    }

    /// The files of `address` on this host (an elastic job's lighthouse): its pair beside
    /// the CA (copies), or the configured paths; `None` without TLS.
    pub fn files_for(&self, address: &str) -> Option<TlsFiles> {
        match self {
            RemoteTls::Off => None,
            RemoteTls::Copy(pairs) => {
                let ca = pairs.first()?.1.ca.clone();
                let dir = ca.parent().unwrap_or(Path::new(".")).to_path_buf();
                Some(TlsFiles {
                    ca,
                    ..TlsFiles::in_dir(&dir, address)
                })
            }
            RemoteTls::InPlace(f) => Some(f.clone()),
        }
    }

    /// Copies `target`'s files into its job directory `dir` (with [`RemoteTls::Copy`]).
    pub fn copy_to(&self, target: &SshTarget, dir: &str) -> Result<()> {
        let RemoteTls::Copy(pairs) = self else {
            return Ok(());
        };
        let Some((_, f)) = pairs.iter().find(|(a, _)| *a == target.address) else {
            return Ok(());
        };
        remote::copy_file(target, &f.ca, dir, REMOTE_TLS_CA, "600")?;
        remote::copy_file(target, &f.cert, dir, REMOTE_TLS_CERT, "600")?;
        remote::copy_file(target, &f.key, dir, REMOTE_TLS_KEY, "600")
    }
}

/// A CA and a pair per host (by inventory address) made for one job in `scratch/tls`
/// (mode 0700), as `flotilla certs` makes them: the files of the first host, with the CA.
fn job_files(targets: &[&SshTarget], launcher: Option<&str>, scratch: &Path) -> Result<TlsFiles> {
    let dir = scratch.join("tls");
    let mut b = std::fs::DirBuilder::new();
    std::os::unix::fs::DirBuilderExt::mode(&mut b, 0o700);
    b.create(&dir)
        .with_context(|| format!("creating {}", dir.display()))?;
    // One pair per address (several logins of one host share it).
    let mut seen = std::collections::HashSet::new();
    let addresses: Vec<String> = (targets.iter().map(|t| t.address.as_str()))
        .chain(launcher)
        .filter(|a| seen.insert(*a))
        .map(str::to_string)
        .collect();
    // Valid for a year: the files live as long as the job, and a long job's late
    // connections (a worker rejoining) must still pass.
    let ca = crate::certs::job_certs(&dir, &addresses, 365)?;
    let first = addresses.first().context("an inventory job has hosts")?;
    println!(
        "[launcher] TLS on every connection between the hosts: a CA made for this job \
         (removed when it ends; --no-tls turns it off on a trusted network)"
    );
    Ok(TlsFiles {
        ca,
        ..TlsFiles::in_dir(&dir, first)
    })
}
