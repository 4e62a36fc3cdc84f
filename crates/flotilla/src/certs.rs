//! `flotilla certs`: a cluster CA and one certificate per host, for the job's mutual TLS
//! (`comm.tls`, or `FLOTILLA_TLS_CA` / `_CERT` / `_KEY`).
//!
//! `DIR/ca.pem` (the CA's certificate: every host gets it) and `DIR/ca.key` (its key, mode
//! 0600: it stays here, to sign more hosts later), then for every host `DIR/<host>.pem` and
//! `DIR/<host>.key` (mode 0600), valid for the host's names and addresses (its subject
//! alternative names) as a TLS server and as a client. An existing CA in `DIR` is used again
//! to add hosts; nothing existing is overwritten unless `--force` (which makes a new CA:
//! certificates of the old one are then refused). Every file is written into a staging
//! directory first, checked as the ranks will check it, then moved into place.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Args;
use flotilla_tcp::TlsFiles;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use time::{Duration, OffsetDateTime};

/// `flotilla certs`.
#[derive(Debug, Clone, Args)]
pub struct CertsArgs {
    /// Directory for the CA and the hosts' files (created if missing).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// The hosts, comma-separated: each a DNS name or IP address, as the ranks reach it
    /// (inventory address, `master_addr`, the IP its peers connect to). A host known by
    /// several: `name/10.0.0.5` (the files are named after the first).
    #[arg(long, value_delimiter = ',', required = true, value_name = "H1,H2")]
    pub hosts: Vec<String>,
    /// Days the host certificates are valid (a new CA: ten times as long).
    #[arg(long, default_value_t = 365, value_name = "N")]
    pub days: u32,
    /// Make a new CA even if DIR has one, and overwrite the hosts' files.
    #[arg(long)]
    pub force: bool,
}

/// The CA's files in the output directory.
const CA_CERT: &str = "ca.pem";
const CA_KEY: &str = "ca.key";

/// One host to certify: the file name and the names in the certificate.
struct Host {
    file: String,
    names: Vec<String>,
}

/// Parses `name/alt/...` entries; a name is a DNS name or an IP address.
fn hosts(entries: &[String]) -> Result<Vec<Host>> {
    let mut out: Vec<Host> = Vec::new();
    for entry in entries.iter().map(|e| e.trim()).filter(|e| !e.is_empty()) {
        let names: Vec<String> = entry.split('/').map(|n| n.trim().to_owned()).collect();
        if let Some(bad) = names.iter().find(|n| {
            n.is_empty()
                || n.starts_with('.')
                || !n
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | ':' | '_'))
        }) {
            bail!("`{entry}`: {bad:?} is not a host name or IP address");
        }
        let file = names[0].clone();
        if out.iter().any(|h| h.file == file) {
            bail!("host {file} is given twice");
        }
        out.push(Host { file, names });
    }
    if out.is_empty() {
        bail!("--hosts names no host");
    }
    Ok(out)
}

/// Without `--force`: refuses to overwrite a host's files, or to go on with half a CA.
fn refuse_to_overwrite(
    dir: &Path,
    hosts: &[Host],
    have_ca: (bool, bool),
    (ca_pem, ca_key): (&Path, &Path),
) -> Result<()> {
    let existing: Vec<String> = hosts
        .iter()
        .flat_map(|h| [format!("{}.pem", h.file), format!("{}.key", h.file)])
        .filter(|f| dir.join(f).exists())
        .map(|f| dir.join(f).display().to_string())
        .collect();
    if !existing.is_empty() {
        bail!(
            "{} already exist: remove them, or use --force to make a new CA and all the hosts' files again",
            existing.join(", ")
        );
    }
    if have_ca.0 != have_ca.1 {
        let (has, lacks) = if have_ca.0 {
            (&ca_pem, &ca_key)
        } else {
            (&ca_key, &ca_pem)
        };
        bail!(
            "{} exists without {}: restore it, or use --force to make a new CA",
            has.display(),
            lacks.display()
        );
    }
    Ok(())
}

/// Runs `flotilla certs`.
pub fn run(args: &CertsArgs) -> Result<()> {
    let hosts = hosts(&args.hosts)?;
    if args.days == 0 {
        bail!("--days must be at least 1");
    }
    let dir = &args.out;
    create_private_dir(dir)?;
    let (ca_pem, ca_key) = (dir.join(CA_CERT), dir.join(CA_KEY));
    let have_ca = (ca_pem.exists(), ca_key.exists());
    if !args.force {
        refuse_to_overwrite(dir, &hosts, have_ca, (&ca_pem, &ca_key))?;
    }
    let now = OffsetDateTime::now_utc();
    let staging = tempfile::Builder::new()
        .prefix(".certs-staging-")
        .tempdir_in(dir)
        .with_context(|| format!("creating a staging directory in {}", dir.display()))?;
    let stage = staging.path();
    let reuse = have_ca.0 && have_ca.1 && !args.force;
    let issuer = if reuse {
        load_ca(&ca_pem, &ca_key)?
    } else {
        new_ca(stage, now, args.days)?
    };
    let mut written = Vec::new();
    for host in &hosts {
        issue(stage, host, &issuer, now, args.days)?;
        // The ranks' own check: signed by the CA, the key fits, the key file is private.
        let ca = if reuse {
            ca_pem.clone()
        } else {
            stage.join(CA_CERT)
        };
        let files = TlsFiles {
            ca,
            ..TlsFiles::in_dir(stage, &host.file)
        };
        files.load().with_context(|| {
            format!(
                "the certificate made for {} does not pass the ranks' check (does {} belong to {}?)",
                host.file,
                ca_key.display(),
                ca_pem.display()
            )
        })?;
    }
    if !reuse {
        for f in [CA_CERT, CA_KEY] {
            place(stage, dir, f)?;
        }
        written.push(format!(
            "{} (the cluster CA: give it to every host) and {} (its key: keep it here, it signs new hosts)",
            ca_pem.display(),
            ca_key.display()
        ));
    }
    for host in &hosts {
        for ext in ["pem", "key"] {
            place(stage, dir, &format!("{}.{ext}", host.file))?;
        }
        written.push(format!(
            "{} and {} (host {}: valid for {} for {} days)",
            dir.join(format!("{}.pem", host.file)).display(),
            dir.join(format!("{}.key", host.file)).display(),
            host.file,
            host.names.join(", "),
            args.days
        ));
    }
    print_summary(dir, reuse, &written, &hosts[0].file);
    Ok(())
}

fn print_summary(dir: &Path, reuse: bool, written: &[String], example: &str) {
    let d = dir.display();
    if reuse {
        println!("using the existing CA {d}/{CA_CERT}");
    }
    for w in written {
        println!("wrote {w}");
    }
    println!(
        "\nTo encrypt a job (mutual TLS on every connection), give each host {d}/{CA_CERT} and its own pair, and set on every rank, e.g. for host {example}:\n\
         \n  comm:\n    tls: {{ca: {d}/{CA_CERT}, cert: {d}/{example}.pem, key: {d}/{example}.key}}\n\
         \nor: export FLOTILLA_TLS_CA={d}/{CA_CERT} FLOTILLA_TLS_CERT={d}/{example}.pem FLOTILLA_TLS_KEY={d}/{example}.key\n\
         \n`flotilla launch --inventory` copies each host's pair from {d}/ into its job directory when the host's inventory address has one."
    );
}

/// A CA and a certificate per host of `addresses` for one job (valid for `days`), written
/// into the private directory `dir` as `flotilla certs` writes them (`ca.pem`,
/// `<address>.pem`, `<address>.key`): what `flotilla launch --inventory` makes when the
/// user gave no TLS files. Returns the CA certificate's path.
pub fn job_certs(dir: &Path, addresses: &[String], days: u32) -> Result<PathBuf> {
    let hosts = hosts(addresses)?;
    let now = OffsetDateTime::now_utc();
    let issuer = new_ca(dir, now, days)?;
    for host in &hosts {
        issue(dir, host, &issuer, now, days)?;
    }
    Ok(dir.join(CA_CERT))
}

/// Creates `dir` (mode 0700 when created here).
fn create_private_dir(dir: &Path) -> Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    let mut b = std::fs::DirBuilder::new();
    b.recursive(true);
    std::os::unix::fs::DirBuilderExt::mode(&mut b, 0o700);
    b.create(dir)
        .with_context(|| format!("creating {}", dir.display()))
}

/// A new CA, its files written into `stage`.
fn new_ca(stage: &Path, now: OffsetDateTime, days: u32) -> Result<Issuer<'static, KeyPair>> {
    let key = KeyPair::generate().context("generating the CA key")?;
    let mut p = CertificateParams::new(Vec::<String>::new()).context("CA parameters")?;
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    // Named after its key, so that two CAs never look alike in an error.
    let id: String = key
        .public_key_raw()
        .iter()
        .skip(1)
        .take(4)
        .map(|b| format!("{b:02x}"))
        .collect();
    p.distinguished_name
        .push(DnType::CommonName, format!("Flotilla cluster CA {id}"));
    p.distinguished_name
        .push(DnType::OrganizationName, "Flotilla");
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    p.not_before = now - Duration::hours(1);
    p.not_after = now + Duration::days(i64::from(days) * 10);
    let cert = p.self_signed(&key).context("signing the CA certificate")?;
    write_file(&stage.join(CA_CERT), &cert.pem(), 0o644)?;
    write_file(&stage.join(CA_KEY), &key.serialize_pem(), 0o600)?;
    Ok(Issuer::new(p, key))
}

/// The CA of `cert` and `key` (files of an earlier `flotilla certs`).
fn load_ca(cert: &Path, key: &Path) -> Result<Issuer<'static, KeyPair>> {
    let key_pem =
        std::fs::read_to_string(key).with_context(|| format!("reading {}", key.display()))?;
    let key_pair = KeyPair::from_pem(&key_pem)
        .with_context(|| format!("{} holds no PEM private key", key.display()))?;
    let cert_pem =
        std::fs::read_to_string(cert).with_context(|| format!("reading {}", cert.display()))?;
    Issuer::from_ca_cert_pem(&cert_pem, key_pair)
        .with_context(|| format!("{} holds no CA certificate", cert.display()))
}

/// A host's certificate and key, signed by `issuer`, written into `stage`.
fn issue(
    stage: &Path,
    host: &Host,
    issuer: &Issuer<'static, KeyPair>,
    now: OffsetDateTime,
    days: u32,
) -> Result<()> {
    let key = KeyPair::generate().context("generating a host key")?;
    let mut p = CertificateParams::new(host.names.clone())
        .with_context(|| format!("host {}: not a valid name or address", host.file))?;
    p.distinguished_name.push(DnType::CommonName, &host.file);
    p.distinguished_name
        .push(DnType::OrganizationName, "Flotilla");
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    p.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    p.not_before = now - Duration::hours(1);
    p.not_after = now + Duration::days(i64::from(days));
    let cert = p
        .signed_by(&key, issuer)
        .with_context(|| format!("signing the certificate of {}", host.file))?;
    write_file(
        &stage.join(format!("{}.pem", host.file)),
        &cert.pem(),
        0o644,
    )?;
    write_file(
        &stage.join(format!("{}.key", host.file)),
        &key.serialize_pem(),
        0o600,
    )
}

/// Writes a new file with `mode` from its creation.
fn write_file(path: &Path, text: &str, mode: u32) -> Result<()> {
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, mode);
    let mut f = options
        .open(path)
        .with_context(|| format!("creating {}", path.display()))?;
    f.write_all(text.as_bytes())
        .with_context(|| format!("writing {}", path.display()))
}

/// Moves `name` from the staging directory into `dir` (replacing what is there).
fn place(stage: &Path, dir: &Path, name: &str) -> Result<()> {
    let (from, to) = (stage.join(name), dir.join(name));
    std::fs::rename(&from, &to).with_context(|| format!("writing {}", to.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(out: &Path, hosts: &[&str], force: bool) -> CertsArgs {
        CertsArgs {
            out: out.to_path_buf(),
            hosts: hosts.iter().map(|h| h.to_string()).collect(),
            days: 30,
            force,
        }
    }

    #[test]
    fn host_entries_parse_and_bad_ones_are_refused() {
        let h = hosts(&["node1/10.0.0.1".into(), "127.0.0.1".into(), "::1".into()]).expect("ok");
        assert_eq!(h[0].file, "node1");
        assert_eq!(h[0].names, ["node1", "10.0.0.1"]);
        assert_eq!(h[2].file, "::1");
        for bad in ["../etc", "a b", "x/", "a,", ".hidden"] {
            assert!(hosts(&[bad.into()]).is_err(), "{bad}");
        }
        assert!(hosts(&["a".into(), "a".into()]).is_err());
    }

    #[test]
    fn a_ca_is_made_once_reused_for_new_hosts_and_replaced_only_by_force() {
        let d = tempfile::tempdir().expect("dir");
        let out = d.path().join("certs");
        run(&args(&out, &["127.0.0.1"], false)).expect("first");
        let ca = std::fs::read(out.join(CA_CERT)).expect("ca");
        let mode = |f: &str| {
            std::os::unix::fs::PermissionsExt::mode(
                &std::fs::metadata(out.join(f)).expect(f).permissions(),
            ) & 0o777
        };
        assert_eq!((mode(CA_KEY), mode("127.0.0.1.key")), (0o600, 0o600));
        TlsFiles::in_dir(&out, "127.0.0.1").load().expect("loads");
        // A new host: the same CA signs it; the first host's files are left alone.
        run(&args(&out, &["localhost"], false)).expect("second");
        assert_eq!(std::fs::read(out.join(CA_CERT)).expect("ca"), ca);
        TlsFiles::in_dir(&out, "localhost")
            .load()
            .expect("new host loads");
        TlsFiles::in_dir(&out, "127.0.0.1")
            .load()
            .expect("old host still loads");
        // An existing host is not overwritten without --force.
        let e = run(&args(&out, &["127.0.0.1"], false)).expect_err("exists");
        assert!(format!("{e:#}").contains("--force"), "{e:#}");
        // --force: a new CA; the other host's old certificate is no longer accepted.
        run(&args(&out, &["127.0.0.1"], true)).expect("force");
        assert_ne!(std::fs::read(out.join(CA_CERT)).expect("ca"), ca);
        TlsFiles::in_dir(&out, "127.0.0.1")
            .load()
            .expect("reissued");
        assert!(TlsFiles::in_dir(&out, "localhost").load().is_err());
        let left: Vec<_> = std::fs::read_dir(&out)
            .expect("dir")
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with(".certs"))
            .collect();
        assert!(left.is_empty(), "staging directories left behind");
    }
}
