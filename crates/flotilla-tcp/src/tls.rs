//! Optional mutual TLS of every connection of a job: where a rank's files are
//! ([`TlsFiles`]: the cluster CA, this host's certificate and its private key), and the
//! rustls configurations loaded from them ([`TlsConfig`]).
//!
//! With TLS, both ends of every connection present a certificate signed by the cluster CA
//! and check the other's (TLS 1.3 only, `ring` crypto). The accepting side is the TLS server
//! and requires a client certificate ([`WebPkiClientVerifier`]); the connecting side checks
//! the server's certificate against the CA and the name or IP address it connected to. The
//! handshake itself is in the rendezvous (`rendezvous/secure.rs`); `flotilla certs` makes the
//! files.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::Resumption;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};

pub use crate::tls_error::TlsError;

/// The environment variable naming the cluster CA certificate (PEM).
pub const TLS_CA_ENV: &str = "FLOTILLA_TLS_CA";

/// The environment variable naming this host's certificate (PEM; its chain may follow it).
pub const TLS_CERT_ENV: &str = "FLOTILLA_TLS_CERT";

/// The environment variable naming this host's private key (PEM; mode 0600).
pub const TLS_KEY_ENV: &str = "FLOTILLA_TLS_KEY";

/// The largest PEM file read (certificates and keys are a few KiB; anything larger is a
/// mistake).
pub const MAX_PEM_FILE_BYTES: u64 = 1 << 20;

/// Where one rank's TLS files are. Every rank of a job has the same CA and its own host's
/// certificate and key (`flotilla certs` writes `ca.pem`, `<host>.pem` and `<host>.key`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The cluster CA's certificate: peers' certificates must be signed by it.
    pub ca: PathBuf,
    /// This host's certificate, signed by the CA (intermediates may follow it).
    pub cert: PathBuf,
    /// This host's private key (must not be accessible to group or others).
    pub key: PathBuf,
}

impl TlsFiles {
    /// The files of `host` in a directory written by `flotilla certs`: `DIR/ca.pem`,
    /// `DIR/<host>.pem`, `DIR/<host>.key`.
    pub fn in_dir(dir: &Path, host: &str) -> TlsFiles {
        TlsFiles {
            ca: dir.join("ca.pem"),
            cert: dir.join(format!("{host}.pem")),
            key: dir.join(format!("{host}.key")),
        }
    }

    /// The files named by [`TLS_CA_ENV`], [`TLS_CERT_ENV`] and [`TLS_KEY_ENV`]: all three
    /// or none (`None`; some but not all is an error naming the missing ones).
    pub fn from_env() -> Result<Option<TlsFiles>, TlsError> {
        let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
        Self::from_vars(var(TLS_CA_ENV), var(TLS_CERT_ENV), var(TLS_KEY_ENV))
    }

    fn from_vars(
        ca: Option<std::ffi::OsString>,
        cert: Option<std::ffi::OsString>,
        key: Option<std::ffi::OsString>,
    ) -> Result<Option<TlsFiles>, TlsError> {
        match (ca, cert, key) {
            (None, None, None) => Ok(None),
            (Some(ca), Some(cert), Some(key)) => Ok(Some(TlsFiles {
                ca: ca.into(),
                cert: cert.into(),
                key: key.into(),
            })),
            (ca, cert, key) => {
                let missing: Vec<&str> = [
                    (TLS_CA_ENV, &ca),
                    (TLS_CERT_ENV, &cert),
                    (TLS_KEY_ENV, &key),
                ]
                .into_iter()
                .filter(|(_, v)| v.is_none())
                .map(|(name, _)| name)
                .collect();
                Err(TlsError::Settings(format!(
                    "{} not set: set {TLS_CA_ENV}, {TLS_CERT_ENV} and {TLS_KEY_ENV} together (or none)",
                    missing.join(" and ")
                )))
            }
        }
    }

    /// Reads and checks the three files and builds this rank's TLS configuration: the CA
    /// must be a certificate, the certificate must be signed by it and match the key.
    pub fn load(&self) -> Result<TlsConfig, TlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let ca = read_pem(&self.ca, "CA certificate", false)?;
        let mut roots = RootCertStore::empty();
        for der in certs(&self.ca, "CA certificate", &ca)? {
            roots.add(der).map_err(|e| TlsError::Invalid {
                what: "CA certificate",
                path: self.ca.clone(),
                detail: format!("holds a certificate that cannot be a trust anchor: {e}"),
            })?;
        }
        let roots = Arc::new(roots);
        let cert_pem = read_pem(&self.cert, "certificate", false)?;
        let chain = certs(&self.cert, "certificate", &cert_pem)?;
        let key_pem = read_pem(&self.key, "private key", true)?;
        let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| TlsError::Invalid {
            what: "private key",
            path: self.key.clone(),
            detail: format!("holds no PEM private key ({e})"),
        })?;
        let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
            .build()
            .map_err(|e| TlsError::Invalid {
                what: "CA certificate",
                path: self.ca.clone(),
                detail: format!("cannot verify certificates: {e}"),
            })?;
        // This host's own certificate must pass the check its peers will make.
        if let Some((end, intermediates)) = chain.split_first() {
            verifier
                .verify_client_cert(end, intermediates, UnixTime::now())
                .map_err(|e| TlsError::Invalid {
                    what: "certificate",
                    path: self.cert.clone(),
                    detail: format!(
                        "is not accepted by the CA of {} ({e}): make it with `flotilla certs` from that CA",
                        self.ca.display()
                    ),
                })?;
        }
        let key_err = |e: rustls::Error| TlsError::Invalid {
            what: "private key",
            path: self.key.clone(),
            detail: format!("does not fit the certificate {}: {e}", self.cert.display()),
        };
        let mut server = ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| TlsError::Settings(e.to_string()))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain.clone(), key.clone_key())
            .map_err(key_err)?;
        let mut client = ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| TlsError::Settings(e.to_string()))?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)
            .map_err(key_err)?;
        // A job's connections are few and long-lived: no session tickets, no resumption
        // (every connection checks both certificates in full).
        client.resumption = Resumption::disabled();
        server.send_tls13_tickets = 0;
        Ok(TlsConfig {
            files: self.clone(),
            server: Arc::new(server),
            client: Arc::new(client),
        })
    }
}

/// A rank's loaded TLS configuration (cheap to clone): the rustls server side (for the
/// connections it accepts) and client side (for those it opens), both with its certificate
/// and the cluster CA.
#[derive(Clone)]
pub struct TlsConfig {
    files: TlsFiles,
    server: Arc<ServerConfig>,
    client: Arc<ClientConfig>,
}

impl fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsConfig")
            .field("ca", &self.files.ca)
            .field("cert", &self.files.cert)
            .field("key", &self.files.key)
            .finish()
    }
}

impl TlsConfig {
    /// The files it was loaded from.
    pub fn files(&self) -> &TlsFiles {
        &self.files
    }

    /// The TLS server side, for accepted connections.
    pub(crate) fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(self.server.clone())
    }

    /// The TLS client side, for opened connections.
    pub(crate) fn connector(&self) -> tokio_rustls::TlsConnector {
        tokio_rustls::TlsConnector::from(self.client.clone())
    }
}

/// The bytes of a PEM file, at most [`MAX_PEM_FILE_BYTES`]; a `private` one must not be
/// accessible to group or others.
fn read_pem(path: &Path, what: &'static str, private: bool) -> Result<Vec<u8>, TlsError> {
    let read_err = |e: io::Error| TlsError::Read {
        what,
        path: path.to_path_buf(),
        source: Arc::new(e),
    };
    let invalid = |detail: String| TlsError::Invalid {
        what,
        path: path.to_path_buf(),
        detail,
    };
    let meta = std::fs::metadata(path).map_err(read_err)?;
    if !meta.is_file() {
        return Err(invalid("is not a regular file".into()));
    }
    if meta.len() > MAX_PEM_FILE_BYTES {
        return Err(invalid(format!(
            "has {} bytes, more than the limit of {MAX_PEM_FILE_BYTES}",
            meta.len()
        )));
    }
    #[cfg(unix)]
    if private {
        use std::os::unix::fs::PermissionsExt;
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(invalid(format!(
                "is accessible to group or others (mode {mode:04o}); run `chmod 600 {}`",
                path.display()
            )));
        }
    }
    #[cfg(not(unix))]
    let _ = private;
    std::fs::read(path).map_err(read_err)
}

/// The certificates of a PEM file (at least one).
fn certs(
    path: &Path,
    what: &'static str,
    pem: &[u8],
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let invalid = |detail: String| TlsError::Invalid {
        what,
        path: path.to_path_buf(),
        detail,
    };
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid(format!("is not valid PEM ({e})")))?;
    if certs.is_empty() {
        return Err(invalid("holds no PEM certificate".into()));
    }
    Ok(certs)
}

#[cfg(test)]
pub(crate) mod testing {
    //! Certificates for tests: a CA and host certificates, as `flotilla certs` makes them.

    use std::path::{Path, PathBuf};

    use super::TlsFiles;

    /// A fresh directory under the system's temporary directory.
    pub fn tempdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "flotilla-tls-{tag}-{}-{}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::create_dir_all(&d).expect("dir");
        d
    }

    fn write_private(path: &Path, text: &str) {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .expect("key file");
        f.write_all(text.as_bytes()).expect("write key");
    }

    /// Writes a CA and a certificate for each of `hosts` into `dir`; returns the files of
    /// each host.
    pub fn make_certs(dir: &Path, hosts: &[&str]) -> Vec<TlsFiles> {
        use rcgen::{
            BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
            KeyPair, KeyUsagePurpose,
        };
        let ca_key = KeyPair::generate().expect("ca key");
        let mut ca = CertificateParams::new(Vec::<String>::new()).expect("ca params");
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name.push(
            DnType::CommonName,
            format!("test CA {}", rand::random::<u32>()),
        );
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca_cert = ca.self_signed(&ca_key).expect("ca cert");
        std::fs::write(dir.join("ca.pem"), ca_cert.pem()).expect("ca.pem");
        let issuer = Issuer::new(ca, ca_key);
        hosts
            .iter()
            .map(|host| {
                let key = KeyPair::generate().expect("key");
                let mut p = CertificateParams::new(vec![host.to_string()]).expect("params");
                p.distinguished_name.push(DnType::CommonName, *host);
                p.extended_key_usages = vec![
                    ExtendedKeyUsagePurpose::ServerAuth,
                    ExtendedKeyUsagePurpose::ClientAuth,
                ];
                let cert = p.signed_by(&key, &issuer).expect("sign");
                let files = TlsFiles::in_dir(dir, host);
                std::fs::write(&files.cert, cert.pem()).expect("cert");
                write_private(&files.key, &key.serialize_pem());
                files
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::testing::{make_certs, tempdir};
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn files_from_flotilla_certs_load() {
        let d = tempdir("load");
        let files = make_certs(&d, &["127.0.0.1"]);
        let cfg = files[0].load().expect("loads");
        assert!(format!("{cfg:?}").contains("127.0.0.1.pem"));
        let _ = std::fs::remove_dir_all(d);
    }

    #[test]
    fn bad_files_are_errors_naming_them() {
        let d = tempdir("bad");
        let good = make_certs(&d, &["127.0.0.1"]).remove(0);
        let other = tempdir("other");
        let foreign = make_certs(&other, &["127.0.0.1"]).remove(0);
        let check = |files: TlsFiles, path: &Path, needle: &str| {
            let e = files.load().expect_err("must fail").to_string();
            assert!(
                e.contains(&path.display().to_string()) && e.contains(needle),
                "{e}"
            );
        };
        let missing = d.join("missing.key");
        check(
            TlsFiles {
                key: missing.clone(),
                ..good.clone()
            },
            &missing,
            "cannot read the TLS private key file",
        );
        let garbage = d.join("garbage.pem");
        std::fs::write(&garbage, "not a certificate\n").expect("write");
        check(
            TlsFiles {
                ca: garbage.clone(),
                ..good.clone()
            },
            &garbage,
            "holds no PEM certificate",
        );
        check(
            TlsFiles {
                cert: foreign.cert.clone(),
                key: foreign.key.clone(),
                ..good.clone()
            },
            &foreign.cert,
            "is not accepted by the CA",
        );
        check(
            TlsFiles {
                key: foreign.key.clone(),
                ..good.clone()
            },
            &foreign.key,
            "does not fit the certificate",
        );
        std::fs::set_permissions(&good.key, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        check(good.clone(), &good.key, "chmod 600");
        let _ = std::fs::remove_dir_all(d);
        let _ = std::fs::remove_dir_all(other);
    }

    #[test]
    fn the_environment_sets_all_three_or_none() {
        let os = |s: &str| Some(std::ffi::OsString::from(s));
        assert_eq!(TlsFiles::from_vars(None, None, None).expect("none"), None);
        let f = TlsFiles::from_vars(os("a"), os("b"), os("c"))
            .expect("all")
            .expect("some");
        assert_eq!(f.key, PathBuf::from("c"));
        let e = TlsFiles::from_vars(os("a"), None, None)
            .expect_err("partial")
            .to_string();
        assert!(
            e.contains("FLOTILLA_TLS_CERT and FLOTILLA_TLS_KEY not set"),
            "{e}"
        );
    }
}
