//! TLS end to end in one process: every rank is a thread with its own TcpGroup over
//! 127.0.0.1, each connection (rendezvous and mesh) wrapped in mutual TLS; a relay between
//! two ranks sees only TLS records.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

use flotilla_tcp::frame::{FrameHeader, HEADER_LEN, Op, channel};
use flotilla_tcp::{
    CommConfig, CommError, PeerName, ProcessGroup, RendezvousError, Secret, TcpGroup, TlsConfig,
    TlsFiles, Transport,
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
        // What these tests watch is the TLS wire (ranks of one host would share memory).
        .with_transport(Transport::Tcp)
}

/// The error of a connect that must fail.
fn refused(r: Result<TcpGroup, CommError>, what: &str) -> CommError {
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
    let secret = Secret::new(b"tls-world-secret-0123".to_vec()).expect("secret");
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
                    Some(l) => TcpGroup::connect_with_listener(cfg, l)?,
                    None => TcpGroup::connect(cfg)?,
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
        TcpGroup::connect_with_listener(cfg, l).and_then(|c| c.all_gather_u64(10))
    });
    let e = refused(
        TcpGroup::connect(base(None, 2, port).with_tls(Some(foreign))),
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
        TcpGroup::connect(base(None, 2, port).with_insecure(true)),
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
    let rank1 = TcpGroup::connect(base(Some(1), 2, port).with_tls(Some(tls)))
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
    // A plain job: neither TLS nor a secret (its rank 0 opted out).
    let cfg = base(Some(0), 2, port)
        .with_join_timeout(Duration::from_millis(1500))
        .with_insecure(true);
    let master = thread::spawn(move || TcpGroup::connect_with_listener(cfg, l).map(|_| ()));
    let e = refused(
        TcpGroup::connect(base(Some(1), 2, port).with_tls(Some(tls))),
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

/// A port that was free a moment ago on 127.0.0.1 (for a rank's mesh listener).
fn free_port() -> u16 {
    master_listener().1
}

/// Connects to 127.0.0.1:`port`, retrying while nothing listens there yet (a rank binds its
/// mesh listener once rank 0 let it in), for at most 10 s.
fn connect_when_listening(port: u16) -> TcpStream {
    let started = Instant::now();
    loop {
        match TcpStream::connect(("127.0.0.1", port)) {
            Ok(s) => return s,
            Err(e) if started.elapsed() > Duration::from_secs(10) => {
                panic!("nothing listens on port {port}: {e}")
            }
            Err(_) => thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// The bytes a peer sends until it closes the connection (at most 10 s).
fn read_to_close(mut s: TcpStream) -> Vec<u8> {
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got);
    got
}

/// A rank's thread: its sums and the gathered messages.
type Rank = thread::JoinHandle<Result<(Vec<f32>, Vec<Vec<u8>>), CommError>>;

/// Every rank all-reduces [`VALUES`] floats and all-gathers its [`plaintext`] message;
/// checks the sums and the messages on every rank.
fn exchange(handles: Vec<Rank>) {
    let n = handles.len();
    for (rank, h) in handles.into_iter().enumerate() {
        let (v, messages) = h
            .join()
            .expect("no panic")
            .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert_eq!(v.len(), VALUES);
        for (i, x) in v.iter().enumerate() {
            let want: f32 = (0..n).map(|r| ((i + r) % 7) as f32).sum();
            assert_eq!(*x, want, "rank {rank} element {i}");
        }
        let want: Vec<Vec<u8>> = (0..n).map(plaintext).collect();
        assert!(
            messages == want,
            "rank {rank}: the gathered messages differ"
        );
    }
}

/// Elements each rank all-reduces.
const VALUES: usize = 200_000;

/// What rank `r` all-gathers: text a relay would recognise if it saw it.
fn plaintext(r: usize) -> Vec<u8> {
    format!("flotilla plaintext of rank {r}; ")
        .repeat(1000)
        .into_bytes()
}

/// Starts a rank with `cfg` (rank 0 on `listener`) that runs [`exchange`]'s collectives.
fn start_rank(cfg: CommConfig, listener: Option<TcpListener>) -> Rank {
    thread::spawn(move || {
        let c = match listener {
            Some(l) => TcpGroup::connect_with_listener(cfg, l)?,
            None => TcpGroup::connect(cfg)?,
        };
        let r = c.rank();
        let mut v: Vec<f32> = (0..VALUES).map(|i| ((i + r) % 7) as f32).collect();
        c.all_reduce_sum(&mut v)?;
        let messages = c.all_gather_bytes(&plaintext(r))?;
        Ok((v, messages))
    })
}

/// A process without TLS that knocks at a TLS job's mesh listener (rank 1's, where rank 2
/// connects) is refused, told in plain text that the job requires TLS, and the job — rank 2
/// arriving after it — goes on: every collective gives exact results.
#[test]
fn a_plain_connection_to_a_mesh_listener_is_refused_and_the_job_goes_on() {
    let dir = tempdir("mesh-stranger");
    let tls = cluster(&dir);
    let (l, port) = master_listener();
    let mesh_port = free_port();
    let cfg = |r: usize| base(Some(r), 3, port).with_tls(Some(tls.clone()));
    let rank0 = start_rank(cfg(0), Some(l));
    let rank1 = start_rank(cfg(1).with_mesh_port(Some(mesh_port)), None);
    // Rank 1 listens for rank 2 once rank 0 let it in; the stranger gets there first and
    // speaks plain frames (rank 1 reads its connection when rank 2 has joined).
    let mut stranger = connect_when_listening(mesh_port);
    let hello = br#"{"hello":"no TLS"}"#;
    let header = FrameHeader {
        channel: channel::CONTROL,
        flags: 0,
        op: Op::Control as u8,
        group: 0,
        seq: 0,
        tag: 0,
        len: hello.len() as u32,
    };
    stranger.write_all(&header.encode()).expect("write");
    stranger.write_all(hello).expect("write");
    let rank2 = start_rank(cfg(2), None);
    // One plain frame: a rejection, whose error says what is wrong.
    let answer = read_to_close(stranger);
    assert_eq!(frame_headers(&answer), 1, "{answer:?}");
    let json: serde_json::Value = serde_json::from_slice(&answer[HEADER_LEN..]).expect("json");
    let told: RendezvousError =
        serde_json::from_value(json["Reject"].clone()).expect("a rejection");
    assert!(
        matches!(told, RendezvousError::TlsRequired { .. })
            && told
                .to_string()
                .contains("did not start TLS, but this job requires TLS on every connection"),
        "{told}"
    );
    exchange(vec![rank0, rank1, rank2]);
    let _ = std::fs::remove_dir_all(dir);
}

/// How many positions of `bytes` start a valid Flotilla frame header (magic, version,
/// channel, flags, op, reserved zeros and a length within 64 MiB).
fn frame_headers(bytes: &[u8]) -> usize {
    let peer = PeerName::unranked("relay");
    bytes
        .windows(HEADER_LEN)
        .filter(|w| {
            let h: &[u8; HEADER_LEN] = (*w).try_into().expect("window");
            FrameHeader::decode(h, 64 << 20, &peer).is_ok()
        })
        .count()
}

/// Whether `bytes` are TLS records end to end, from the first byte: each a content type
/// (change cipher spec, alert, handshake, application data), a TLS 1.0–1.2 record version,
/// a length within the largest record, and that many bytes; the first a handshake.
fn tls_records_only(bytes: &[u8]) -> bool {
    let mut at = 0;
    while at < bytes.len() {
        let Some(h) = bytes.get(at..at + 5) else {
            return false;
        };
        let len = usize::from(u16::from_be_bytes([h[3], h[4]]));
        let known_type = (20..=23).contains(&h[0]) && (at > 0 || h[0] == 22);
        if !known_type || h[1] != 3 || !(1..=3).contains(&h[2]) || len > 16_640 {
            return false;
        }
        at += 5 + len;
    }
    at == bytes.len() && !bytes.is_empty()
}

/// One direction of a relayed connection: what the relay read from one end and wrote to
/// the other.
struct Recorded {
    what: String,
    bytes: Vec<u8>,
}

/// A TCP relay on 127.0.0.1 in front of `target`: it accepts one connection (within
/// 20 s), opens one to `target`, and copies bytes both ways, recording them, until either
/// end closes.
struct Relay {
    port: u16,
    done: thread::JoinHandle<Vec<Recorded>>,
}

impl Relay {
    fn start(name: &'static str, target: u16) -> Relay {
        let (l, port) = master_listener();
        let done = thread::spawn(move || {
            l.set_nonblocking(true).expect("nonblocking");
            let started = Instant::now();
            let client = loop {
                match l.accept() {
                    Ok((s, _)) => break s,
                    Err(_) if started.elapsed() < Duration::from_secs(20) => {
                        thread::sleep(Duration::from_millis(5))
                    }
                    Err(e) => panic!("{name}: nobody connected: {e}"),
                }
            };
            client.set_nonblocking(false).expect("blocking");
            let server = TcpStream::connect(("127.0.0.1", target)).expect("relay connect");
            let pump = |from: &TcpStream, to: &TcpStream, what: String| {
                let (mut from, mut to) = (
                    from.try_clone().expect("clone"),
                    to.try_clone().expect("clone"),
                );
                thread::spawn(move || {
                    from.set_read_timeout(Some(Duration::from_secs(30)))
                        .expect("timeout");
                    let (mut bytes, mut buf) = (Vec::new(), vec![0u8; 64 << 10]);
                    while let Ok(n @ 1..) = from.read(&mut buf) {
                        bytes.extend_from_slice(&buf[..n]);
                        if to.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = to.shutdown(std::net::Shutdown::Write);
                    Recorded { what, bytes }
                })
            };
            let up = pump(
                &client,
                &server,
                format!("{name}: from the connecting rank"),
            );
            let down = pump(&server, &client, format!("{name}: from the accepting rank"));
            [up, down]
                .into_iter()
                .map(|p| p.join().expect("pump"))
                .collect()
        });
        Relay { port, done }
    }
}

/// Three ranks (with `tls`, or plain) where every byte rank 1 exchanges goes through a
/// relay: its rendezvous connection to rank 0 (rank 1 is told the relay is rank 0) and
/// the mesh connection from rank 2 (rank 1 advertises the relay's port for its mesh
/// listener). The collectives give exact results through the relays; returns what the
/// relays recorded.
fn relayed_world(tls: Option<TlsConfig>) -> Vec<Recorded> {
    let (l, port) = master_listener();
    let mesh_port = free_port();
    let to_rank0 = Relay::start("rank 1 -> rank 0", port);
    let to_rank1 = Relay::start("rank 2 -> rank 1", mesh_port);
    // Plain: neither TLS nor a secret (which would not hide the bytes either).
    let cfg = |r: usize, port: u16| {
        base(Some(r), 3, port)
            .with_tls(tls.clone())
            .with_insecure(true)
    };
    let rank1 = cfg(1, to_rank0.port)
        .with_mesh_port(Some(mesh_port))
        .with_advertise_port(Some(to_rank1.port));
    let ranks = vec![
        start_rank(cfg(0, port), Some(l)),
        start_rank(rank1, None),
        start_rank(cfg(2, port), None),
    ];
    exchange(ranks);
    [to_rank0, to_rank1]
        .into_iter()
        .flat_map(|r| r.done.join().expect("relay"))
        .collect()
}

/// With TLS, a relay between two ranks — on the rendezvous connection and on a mesh
/// connection — sees only TLS records, in both directions from the first byte: not one
/// frame header, not the text the ranks exchange. The same relay without TLS sees both,
/// so the check can fail.
#[test]
fn a_relay_between_tls_ranks_sees_no_frame_and_no_plaintext() {
    let dir = tempdir("relay");
    let tls = cluster(&dir);
    let needle = b"flotilla plaintext of rank ";
    let shows = |r: &Recorded| r.bytes.windows(needle.len()).any(|w| w == needle);
    let encrypted = relayed_world(Some(tls));
    for r in &encrypted {
        let what = &r.what;
        assert_eq!(frame_headers(&r.bytes), 0, "{what}: a frame header");
        assert!(tls_records_only(&r.bytes), "{what}: not TLS records only");
        assert!(!shows(r), "{what}: the plaintext");
    }
    // The relays carried the collectives: the ring's data crosses both (0 -> 1 -> 2).
    let total: usize = encrypted.iter().map(|r| r.bytes.len()).sum();
    assert!(total > 2 * VALUES * 4, "the relays carried {total} bytes");
    // The control: without TLS the same relays see frames, and the text on both relays.
    let plain = relayed_world(None);
    for r in &plain {
        assert!(frame_headers(&r.bytes) > 0, "{}: no frame header", r.what);
        assert!(!tls_records_only(&r.bytes), "{}: TLS records", r.what);
    }
    let (rendezvous, mesh) = plain.split_at(2);
    assert!(
        rendezvous.iter().any(shows) && mesh.iter().any(shows),
        "the gathered text crosses both relays in the plain world"
    );
    let _ = std::fs::remove_dir_all(dir);
}
