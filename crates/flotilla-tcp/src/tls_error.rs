//! [`TlsError`]: why a rank's TLS files could not be used ([`crate::tls`]); a group's
//! operation carries it as its backend's setup error ([`CommError::Setup`]).

use std::io;
use std::path::PathBuf;
use std::sync::Arc;

use flotilla_group::CommError;

/// Why TLS files could not be used. Every variant names the file (or the setting) at fault.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// A file could not be read.
    #[error("cannot read the TLS {what} file {}: {source}", path.display())]
    Read {
        /// What the file should hold ("CA certificate", "certificate", "private key").
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: Arc<io::Error>,
    },
    /// A file was read but does not hold what it should, or does not fit the others.
    #[error("the TLS {what} file {} {detail}", path.display())]
    Invalid {
        /// What the file should hold.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        detail: String,
    },
    /// The settings are incomplete (e.g. a CA without a certificate and key).
    #[error("TLS settings: {0}")]
    Settings(String),
}

impl From<TlsError> for CommError {
    fn from(e: TlsError) -> Self {
        CommError::Setup(Arc::new(e))
    }
}
