//! The `comm.tls` setting: where this rank's TLS files are (the cluster CA, this host's
//! certificate and key, as `flotilla certs` writes them). The environment's
//! `FLOTILLA_TLS_CA`, `FLOTILLA_TLS_CERT` and `FLOTILLA_TLS_KEY` (all three together) take
//! precedence, as the secret's variables do over `comm.secret_file`. The paths are per
//! rank (each host has its own certificate) and never enter the cluster hash.

use std::path::PathBuf;

use flotilla_tcp::{CommError, TlsConfig, TlsFiles};
use serde::{Deserialize, Serialize};

use super::TrainConfig;
use crate::error::Result;

/// `comm.tls: {ca: PATH, cert: PATH, key: PATH}`: mutual TLS on every connection of the job
/// (relative paths are relative to the rank's working directory).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsSetting {
    /// The cluster CA's certificate (PEM).
    pub ca: PathBuf,
    /// This host's certificate, signed by the CA (PEM).
    pub cert: PathBuf,
    /// This host's private key (PEM, mode 0600).
    pub key: PathBuf,
}

impl From<&TlsSetting> for TlsFiles {
    fn from(s: &TlsSetting) -> TlsFiles {
        TlsFiles {
            ca: s.ca.clone(),
            cert: s.cert.clone(),
            key: s.key.clone(),
        }
    }
}

impl TrainConfig {
    /// Where this rank's TLS files are: the environment's (`FLOTILLA_TLS_CA`,
    /// `FLOTILLA_TLS_CERT`, `FLOTILLA_TLS_KEY`), else `comm.tls`; `None`: no TLS.
    pub fn tls_files(&self) -> Result<Option<TlsFiles>> {
        if let Some(files) = TlsFiles::from_env().map_err(CommError::from)? {
            return Ok(Some(files));
        }
        Ok(self.comm.tls.as_ref().map(TlsFiles::from))
    }

    /// This rank's TLS configuration, its files read and checked ([`TlsFiles::load`]: an
    /// unreadable or invalid file is an error naming it); `None`: no TLS.
    pub fn tls(&self) -> Result<Option<TlsConfig>> {
        match self.tls_files()? {
            Some(files) => Ok(Some(files.load().map_err(CommError::from)?)),
            None => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comm_tls_is_read_from_a_file_and_checked() {
        let c = TrainConfig::from_yaml(
            "comm:\n  tls: {ca: certs/ca.pem, cert: certs/n1.pem, key: certs/n1.key}\n",
            "t.yaml",
        )
        .expect("parse");
        let tls = c.comm.tls.as_ref().expect("tls");
        assert_eq!(tls.key, PathBuf::from("certs/n1.key"));
        let e = TrainConfig::from_yaml("comm:\n  tls: {ca: a, cert: b}\n", "t.yaml")
            .expect_err("key missing")
            .to_string();
        assert!(e.contains("key"), "{e}");
        // Files that do not exist fail naming the file (unless the environment sets others).
        if std::env::var_os(flotilla_tcp::TLS_CA_ENV).is_none() {
            let e = c.tls().expect_err("no such files").to_string();
            assert!(e.contains("certs/ca.pem"), "{e}");
        }
    }
}
