//! The job's cluster secret: where it comes from (an environment variable or a private file,
//! never a flag) and a type that never shows it (no `Display`, a redacted `Debug`).

use std::fmt;
use std::path::Path;
use std::sync::{Arc, Once};

use flotilla_group::CommError;

/// The environment variable holding the cluster secret itself.
pub const SECRET_ENV: &str = "FLOTILLA_SECRET";

/// The environment variable naming a file that holds the cluster secret (mode 0600).
pub const SECRET_FILE_ENV: &str = "FLOTILLA_SECRET_FILE";

/// Deprecated: the old name of [`SECRET_ENV`], still read (with a warning) when neither new
/// one is set.
pub const TOKEN_ENV: &str = "FLOTILLA_TOKEN";

/// The largest secret file accepted (a secret is a short line; anything larger is a mistake).
pub const MAX_SECRET_FILE_BYTES: u64 = 64 << 10;

/// A cluster secret: every rank of a job holds the same one and proves it on every
/// connection. Its bytes never appear in `Debug` output, logs or errors.
#[derive(Clone)]
pub struct Secret(Arc<[u8]>);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl Secret {
    /// A secret of these bytes; an empty one is an error.
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<Secret, CommError> {
        let bytes: Vec<u8> = bytes.into();
        if bytes.is_empty() {
            return Err(CommError::Config("the cluster secret is empty".into()));
        }
        Ok(Secret(bytes.into()))
    }

    /// The secret in a file: its content without trailing white space. The file must not
    /// be accessible to group or others (`chmod 600`) and must hold at most
    /// [`MAX_SECRET_FILE_BYTES`].
    pub fn from_file(path: &Path) -> Result<Secret, CommError> {
        let shown = path.display();
        let io = |e: std::io::Error| CommError::io(format!("reading secret file {shown}"), e);
        let meta = std::fs::metadata(path).map_err(io)?;
        if !meta.is_file() {
            return Err(CommError::Config(format!(
                "secret file {shown} is not a regular file"
            )));
        }
        check_private(path, &meta)?;
        if meta.len() > MAX_SECRET_FILE_BYTES {
            return Err(CommError::Config(format!(
                "secret file {shown} has {} bytes, more than the limit of {MAX_SECRET_FILE_BYTES}",
                meta.len()
            )));
        }
        let mut bytes = std::fs::read(path).map_err(io)?;
        while bytes.last().is_some_and(|b| b.is_ascii_whitespace()) {
            bytes.pop();
        }
        Secret::new(bytes)
            .map_err(|_| CommError::Config(format!("secret file {shown} holds no secret")))
    }

    /// The secret of the environment: [`SECRET_FILE_ENV`] (a file) or [`SECRET_ENV`] (the
    /// secret itself; setting both is an error), else the deprecated `FLOTILLA_TOKEN`.
    /// `None`: no secret, connections are not authenticated.
    pub fn from_env() -> Result<Option<Secret>, CommError> {
        let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
        match (var(SECRET_FILE_ENV), var(SECRET_ENV)) {
            (Some(_), Some(_)) => Err(CommError::Config(format!(
                "both {SECRET_ENV} and {SECRET_FILE_ENV} are set: set only one"
            ))),
            (Some(file), None) => Secret::from_file(Path::new(&file)).map(Some),
            (None, Some(s)) => Secret::new(s.into_encoded_bytes()).map(Some),
            (None, None) => match var(TOKEN_ENV) {
                Some(s) => {
                    static WARNED: Once = Once::new();
                    WARNED.call_once(|| {
                        tracing::warn!("{TOKEN_ENV} is deprecated: set {SECRET_ENV} instead");
                    });
                    Secret::new(s.into_encoded_bytes()).map(Some)
                }
                None => Ok(None),
            },
        }
    }

    /// Writes the secret to a new file at `path` that only its owner may read (mode 0600 from
    /// its creation), for a launcher to hand it to ranks without a command line.
    pub fn write_private(&self, path: &Path) -> Result<(), CommError> {
        use std::io::Write;
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
        let io = |e| CommError::io(format!("writing secret file {}", path.display()), e);
        let mut file = options.open(path).map_err(io)?;
        file.write_all(&self.0).map_err(io)
    }

    /// The secret's bytes (for the handshake's MAC only).
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.0
    }
}

#[cfg(unix)]
fn check_private(path: &Path, meta: &std::fs::Metadata) -> Result<(), CommError> {
    use std::os::unix::fs::PermissionsExt;
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(CommError::Config(format!(
            "secret file {p} is accessible to group or others (mode {mode:04o}); run `chmod 600 {p}`",
            p = path.display()
        )));
    }
    Ok(())
}

#[cfg(not(unix))]
fn check_private(_path: &Path, _meta: &std::fs::Metadata) -> Result<(), CommError> {
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn write(dir: &Path, name: &str, content: &[u8], mode: u32) -> std::path::PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, content).expect("write");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).expect("chmod");
        p
    }

    fn tempdir() -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!(
            "flotilla-secret-{}-{}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::create_dir_all(&d).expect("dir");
        d
    }

    #[test]
    fn a_private_file_gives_its_secret_without_the_newline() {
        let d = tempdir();
        let p = write(&d, "s", b"hunter2-is-long-enough\n", 0o600);
        let s = Secret::from_file(&p).expect("secret");
        assert_eq!(s.bytes(), b"hunter2-is-long-enough");
        assert_eq!(format!("{s:?}"), "Secret(<redacted>)");
        let copy = d.join("copy");
        s.write_private(&copy).expect("write");
        assert_eq!(
            Secret::from_file(&copy).expect("private copy").bytes(),
            s.bytes()
        );
        assert!(s.write_private(&copy).is_err(), "never overwrites");
        let _ = std::fs::remove_dir_all(d);
    }

    #[test]
    fn a_readable_empty_or_huge_file_is_refused_without_leaking() {
        let d = tempdir();
        for mode in [0o640, 0o604, 0o660] {
            let p = write(&d, "open", b"topsecretvalue", mode);
            let e = Secret::from_file(&p).expect_err("group/world readable");
            let msg = e.to_string();
            assert!(msg.contains("chmod 600") && msg.contains("open"), "{msg}");
            assert!(!msg.contains("topsecretvalue"), "{msg}");
        }
        let p = write(&d, "empty", b"\n", 0o600);
        assert!(Secret::from_file(&p).is_err());
        let p = write(&d, "huge", &vec![b'x'; 70_000], 0o600);
        let e = Secret::from_file(&p).expect_err("too large").to_string();
        assert!(e.contains("limit"), "{e}");
        assert!(Secret::from_file(&d.join("missing")).is_err());
        assert!(Secret::new(Vec::new()).is_err());
        let _ = std::fs::remove_dir_all(d);
    }
}
