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

/// The shortest secret accepted, in bytes: 16 bytes (128 bits) of a random secret keep the
/// HMAC's key out of reach of guessing; a shorter one is a password, refused with the reason.
pub const MIN_SECRET_BYTES: usize = 16;

/// The environment variable that lets a TCP rank run without authentication (`1`, `true`):
/// the opt-out of [`crate::CommConfig::insecure`], for a trusted network only.
pub const INSECURE_ENV: &str = "FLOTILLA_INSECURE";

/// What a rank without a secret is told: how to make one, and how to opt out.
pub const HOW_TO_MAKE_A_SECRET: &str = "make one with `flotilla secret --out FILE` (a fresh \
    random secret in a new 0600 file) and give every rank the same one in FLOTILLA_SECRET_FILE=FILE \
    (or FLOTILLA_SECRET, or `comm.secret_file`; `flotilla launch` makes one for every job it \
    starts); to run unauthenticated on a trusted network, say so with `--insecure`, \
    `comm.insecure: true` or FLOTILLA_INSECURE=1";

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
    /// A secret of these bytes; an empty one, or one shorter than [`MIN_SECRET_BYTES`], is an
    /// error saying so (without the secret).
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<Secret, CommError> {
        let bytes: Vec<u8> = bytes.into();
        if bytes.is_empty() {
            return Err(CommError::Config("the cluster secret is empty".into()));
        }
        if bytes.len() < MIN_SECRET_BYTES {
            return Err(CommError::Config(format!(
                "the cluster secret has {} bytes, fewer than the {MIN_SECRET_BYTES} a secret needs \
                 to resist guessing; `flotilla secret` prints a random one",
                bytes.len()
            )));
        }
        Ok(Secret(bytes.into()))
    }

    /// A fresh random secret: 32 bytes of the operating system's generator, written as 64
    /// hexadecimal characters (text, so that it survives a file, an environment variable and
    /// a Kubernetes Secret unchanged).
    pub fn generate() -> Secret {
        let bytes: [u8; 32] = rand::random();
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        Secret(hex.into_bytes().into())
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
        if bytes.is_empty() {
            return Err(CommError::Config(format!(
                "secret file {shown} holds no secret"
            )));
        }
        Secret::new(bytes).map_err(|e| CommError::Config(format!("secret file {shown}: {e}")))
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

    /// The secret's bytes (for the handshake's MAC, and for a launcher writing it where its
    /// ranks read it: a file, a Kubernetes Secret).
    pub fn bytes(&self) -> &[u8] {
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
        let p = write(&d, "short", b"fifteen-bytes!!\n", 0o600);
        let e = Secret::from_file(&p).expect_err("15 bytes").to_string();
        assert!(e.contains("15 bytes") && e.contains("16"), "{e}");
        assert!(!e.contains("fifteen"), "{e}");
        let p = write(&d, "huge", &vec![b'x'; 70_000], 0o600);
        let e = Secret::from_file(&p).expect_err("too large").to_string();
        assert!(e.contains("limit"), "{e}");
        assert!(Secret::from_file(&d.join("missing")).is_err());
        assert!(Secret::new(Vec::new()).is_err());
        assert!(Secret::new(b"0123456789abcde".to_vec()).is_err());
        assert!(Secret::new(b"0123456789abcdef".to_vec()).is_ok());
        let _ = std::fs::remove_dir_all(d);
    }

    #[test]
    fn generated_secrets_are_long_random_text() {
        let (a, b) = (Secret::generate(), Secret::generate());
        assert_eq!(a.bytes().len(), 64);
        assert!(a.bytes().iter().all(u8::is_ascii_hexdigit));
        assert_ne!(a.bytes(), b.bytes());
        Secret::new(a.bytes().to_vec()).expect("a generated secret is accepted");
    }
}
