//! A lost rank rejoins a running job (`Rejoin::Accept` on rank 0, `Rejoin::Join` on the
//! replacement): point-to-point traffic with rank 0 flows again; a stranger, a wrong config
//! and a rank that is still connected are refused without disturbing the job; collectives
//! refuse the rejoined link.

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use flotilla_tcp::{CommConfig, CommError, ProcessGroup, Rejoin, RendezvousError, TcpGroup};

const TAG: u32 = 7;

fn cfg(rank: usize, port: u16) -> CommConfig {
    CommConfig::new(Some(rank), 3)
        .with_secret(Some(
            flotilla_tcp::Secret::new(b"flotilla-test-secret-0123456789".to_vec()).expect("secret"),
        ))
        .with_master("127.0.0.1", port)
        .with_timeout(Duration::from_secs(5))
        .with_join_timeout(Duration::from_secs(10))
        .with_config_hash(42)
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(5)
}

fn rejoin(rank: usize, port: u16, hash: u64) -> Result<TcpGroup, CommError> {
    let mut c = cfg(rank, port).with_config_hash(hash);
    c.rejoin = Rejoin::Join;
    TcpGroup::connect(c)
}

#[test]
fn a_lost_rank_rejoins_point_to_point_and_strangers_are_refused() {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = l.local_addr().expect("addr").port();
    let mut c0 = cfg(0, port);
    c0.rejoin = Rejoin::Accept;
    let master = thread::spawn(move || TcpGroup::connect_with_listener(c0, l));
    let (tx, rx) = mpsc::channel();
    for r in [1, 2] {
        let tx = tx.clone();
        thread::spawn(move || {
            let _ = tx.send((r, TcpGroup::connect(cfg(r, port))));
        });
    }
    let rank0 = master.join().expect("rank 0").expect("rank 0 connects");
    let mut others: Vec<(usize, TcpGroup)> = (0..2)
        .map(|_| {
            let (r, c) = rx.recv_timeout(Duration::from_secs(20)).expect("rank");
            (r, c.expect("connects"))
        })
        .collect();
    others.sort_by_key(|(r, _)| *r);
    let (_, rank2) = others.pop().expect("rank 2");
    let (_, rank1) = others.pop().expect("rank 1");

    // Rank 2 goes away: rank 0 sees it lost.
    rank2.send(0, TAG, b"first").expect("send");
    assert_eq!(rank0.recv(2, TAG, soon()).expect("recv"), b"first");
    drop(rank2);
    let lost = rank0.recv(2, TAG, soon()).expect_err("rank 2 is gone");
    assert!(
        matches!(lost, CommError::PeerLost { peer: 2, .. }),
        "{lost}"
    );

    // Strangers on the kept rendezvous port change nothing: an HTTP request, random bytes,
    // a frame header announcing more than follows.
    let mut truncated = vec![0xF1, 2, 0, 0, 0, 0, 0, 0];
    truncated.extend_from_slice(&[0; 20]);
    truncated.extend_from_slice(&1024u32.to_le_bytes());
    truncated.extend_from_slice(&[0x5A; 100]);
    let random: Vec<u8> = (0..4096u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    for bytes in [
        &b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"[..],
        &random,
        &truncated,
    ] {
        let mut s = TcpStream::connect(("127.0.0.1", port)).expect("stranger connects");
        let _ = s.write_all(bytes);
        drop(s);
    }
    rank1.send(0, TAG, b"still here").expect("send");
    assert_eq!(rank0.recv(1, TAG, soon()).expect("recv"), b"still here");
    // A process with another config, and a replacement of a rank still connected: refused.
    let e = rejoin(2, port, 43).expect_err("wrong config");
    assert!(
        matches!(
            e,
            CommError::Rendezvous(RendezvousError::ConfigHashMismatch { .. })
        ),
        "{e}"
    );
    let e = rejoin(1, port, 42).expect_err("rank 1 is alive");
    assert!(e.to_string().contains("still connected"), "{e}");

    // The replacement of rank 2 gets in and talks to rank 0 both ways.
    let back = rejoin(2, port, 42).expect("rank 2 rejoins");
    let until = Instant::now() + Duration::from_secs(5);
    while rank0.rejoins(2) == 0 {
        assert!(Instant::now() < until, "rank 0 never saw the rejoin");
        thread::sleep(Duration::from_millis(10));
    }
    back.send(0, TAG, b"back").expect("send");
    assert_eq!(rank0.recv(2, TAG, soon()).expect("recv"), b"back");
    rank0.send(2, TAG, b"welcome").expect("send");
    assert_eq!(back.recv(0, TAG, soon()).expect("recv"), b"welcome");
    // The other links are untouched.
    rank1.send(0, TAG, b"one").expect("send");
    assert_eq!(rank0.recv(1, TAG, soon()).expect("recv"), b"one");
    // Collectives refuse the rejoined link, at once, on both sides.
    let t = Instant::now();
    assert!(back.barrier().is_err());
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
}
