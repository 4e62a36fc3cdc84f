//! TLS end to end in one process: every rank is a thread with its own Communicator over
//! 127.0.0.1, each connection (rendezvous and mesh) wrapped in mutual TLS.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::thread;
use std::time::Duration;

use flotilla_comm::{
    CommConfig, CommError, Communicator, ProcessGroup, RendezvousError, Secret, TlsConfig, TlsFiles,
};

fn tempdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "flotilla-tls-it-{tag}-{}-{:x}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default()
    ));
    std::fs::create_dir_all(&d).expect("dir");
    d
}

/// A CA and one certificate for 127.0.0.1 in `dir`, loaded.
fn cluster(dir: &Path) -> TlsConfig {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    };
    use std::os::unix::fs::PermissionsExt;
    let ca_key = KeyPair::generate().expect("ca key");
    let mut ca = CertificateParams::new(Vec::<String>::new()).expect("params");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, format!("CA {}", dir.display()));
    std::fs::write(
        dir.join("ca.pem"),
        ca.self_signed(&ca_key).expect("ca").pem(),
    )
    .expect("ca");
    let issuer = Issuer::new(ca, ca_key);
    let key = KeyPair::generate().expect("key");
    let mut p = CertificateParams::new(vec!["127.0.0.1".to_string()]).expect("params");
    p.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    let files = TlsFiles::in_dir(dir, "127.0.0.1");
    std::fs::write(&files.cert, p.signed_by(&key, &issuer).expect("cert").pem()).expect("cert");
    std::fs::write(&files.key, key.serialize_pem()).expect("key");
    std::fs::set_permissions(&files.key, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    files.load().expect("load")
}

fn base(rank: Option<usize>, n: usize, port: u16) -> CommConfig {
    CommConfig::new(rank, n)
        .with_master("127.0.0.1", port)
        .with_timeout(Duration::from_secs(10))
        .with_join_timeout(Duration::from_secs(10))
}

/// The error of a connect that must fail.
fn refused(r: Result<Communicator, CommError>, what: &str) -> CommError {
    match r {
        Ok(_) => panic!("{what}: connected"),
        Err(e) => e,
    }
}

fn master_listener() -> (TcpListener, u16) {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = l.local_addr().expect("addr").port();
    (l, port)
}

/// Four ranks with TLS and a secret: the rendezvous and every mesh connection are TLS,
/// and the collectives give exact results.
#[test]
fn a_tls_world_reduces_exactly() {
    let dir = tempdir("world");
    let tls = cluster(&dir);
    let secret = Secret::new(b"s".to_vec()).expect("secret");
    let (l, port) = master_listener();
    let mut l = Some(l);
    let n = 4;
    let handles: Vec<_> = (0..n)
        .map(|r| {
            let cfg = base(Some(r), n, port)
                .with_tls(Some(tls.clone()))
                .with_secret(Some(secret.clone()));
            let l = if r == 0 { l.take() } else { None };
            thread::spawn(move || {
                let c = match l {
                    Some(l) => Communicator::connect_with_listener(cfg, l)?,
                    None => Communicator::connect(cfg)?,
                };
                let mut v: Vec<f32> = (0..300_000).map(|i| ((i + r) % 7) as f32).collect();
                c.all_reduce_sum(&mut v)?;
                let ranks = c.all_gather_u64(r as u64)?;
                Ok::<_, CommError>((v, ranks))
            })
        })
        .collect();
    for h in handles {
        let (v, ranks) = h.join().expect("no panic").expect("rank");
        assert_eq!(ranks, vec![0, 1, 2, 3]);
        for (i, x) in v.iter().enumerate() {
            let want: f32 = (0..n).map(|r| ((i + r) % 7) as f32).sum();
            assert_eq!(*x, want, "element {i}");
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// Strangers at a TLS job — a process of another cluster CA, a process without TLS — are
/// refused (each told why) and never break it: the real rank 1 then joins and they work.
#[test]
fn strangers_never_break_a_tls_job() {
    let (dir, other) = (tempdir("job"), tempdir("other"));
    let (tls, foreign) = (cluster(&dir), cluster(&other));
    let (l, port) = master_listener();
    let cfg = base(Some(0), 2, port).with_tls(Some(tls.clone()));
    let master = thread::spawn(move || {
        Communicator::connect_with_listener(cfg, l).and_then(|c| c.all_gather_u64(10))
    });
    let e = refused(
        Communicator::connect(base(None, 2, port).with_tls(Some(foreign))),
        "another CA is refused",
    );
    assert!(
        matches!(
            &e,
            CommError::Rendezvous(RendezvousError::TlsFailed { peer, .. }) if peer.rank == Some(0)
        ),
        "{e}"
    );
    assert!(e.to_string().contains("not signed by this job's CA"), "{e}");
    let e = refused(
        Communicator::connect(base(None, 2, port)),
        "no TLS is refused",
    );
    assert!(
        matches!(
            &e,
            CommError::Rendezvous(RendezvousError::TlsRequired { .. })
        ),
        "{e}"
    );
    assert!(e.to_string().contains("FLOTILLA_TLS_CA"), "{e}");
    let rank1 = Communicator::connect(base(Some(1), 2, port).with_tls(Some(tls)))
        .and_then(|c| c.all_gather_u64(11));
    assert_eq!(rank1.expect("rank 1"), vec![10, 11]);
    assert_eq!(
        master.join().expect("no panic").expect("rank 0"),
        vec![10, 11]
    );
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_dir_all(other);
}

/// A TLS rank at a plain job is refused; rank 0's join deadline names the refusal.
#[test]
fn a_tls_rank_at_a_plain_job_is_refused_and_named() {
    let dir = tempdir("plain-job");
    let tls = cluster(&dir);
    let (l, port) = master_listener();
    let cfg = base(Some(0), 2, port).with_join_timeout(Duration::from_millis(1500));
    let master = thread::spawn(move || Communicator::connect_with_listener(cfg, l).map(|_| ()));
    let e = refused(
        Communicator::connect(base(Some(1), 2, port).with_tls(Some(tls))),
        "refused",
    );
    assert!(e.to_string().contains("does not speak TLS"), "{e}");
    let e0 = master
        .join()
        .expect("no panic")
        .expect_err("rank 0 times out");
    let msg = e0.to_string();
    assert!(
        msg.contains("refused meanwhile")
            && msg.contains("speaks TLS, but this process has no TLS"),
        "{msg}"
    );
    let _ = std::fs::remove_dir_all(dir);
}
