//! Secure by default in the library: a TCP rank built with `CommConfig::new` and no secret
//! refuses at once (it neither listens nor connects), unless the user opted out; the
//! in-memory transport needs no secret; a short secret is refused.

use std::net::TcpListener;
use std::thread;
use std::time::{Duration, Instant};

use flotilla_tcp::{CommConfig, CommError, ProcessGroup, Secret, TcpGroup};

fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

#[test]
fn a_tcp_rank_without_a_secret_refuses_at_once_without_touching_the_network() {
    let port = free_port();
    for rank in [Some(0), Some(1), None] {
        let cfg = CommConfig::new(rank, 2)
            .with_master("127.0.0.1", port)
            .with_join_timeout(Duration::from_secs(30));
        let t = Instant::now();
        let e = TcpGroup::connect(cfg).err();
        let elapsed = t.elapsed();
        let Some(CommError::Config(msg)) = e else {
            panic!("rank {rank:?}: expected a refusal, got {e:?}");
        };
        assert!(elapsed < Duration::from_secs(1), "{elapsed:?}");
        for needle in [
            "no cluster secret",
            "flotilla secret",
            "FLOTILLA_SECRET_FILE",
            "insecure",
        ] {
            assert!(msg.contains(needle), "`{needle}` missing: {msg}");
        }
        // Rank 0 did not listen: the port is still free.
        TcpListener::bind(("127.0.0.1", port)).expect("the port was never bound");
    }
}

#[test]
fn the_in_memory_transport_needs_no_secret_and_insecure_opts_out() {
    let comms = TcpGroup::in_memory(2, CommConfig::new(Some(0), 2)).expect("in memory");
    let handles: Vec<_> = comms
        .into_iter()
        .map(|c| thread::spawn(move || c.all_gather_u64(c.rank() as u64 + 5)))
        .collect();
    for h in handles {
        assert_eq!(h.join().expect("thread").expect("gather"), vec![5, 6]);
    }
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = l.local_addr().expect("addr").port();
    let cfg = |r: usize| {
        CommConfig::new(Some(r), 2)
            .with_master("127.0.0.1", port)
            .with_insecure(true)
            .with_timeout(Duration::from_secs(10))
    };
    let (c0, c1) = (cfg(0), cfg(1));
    let rank0 = thread::spawn(move || {
        TcpGroup::connect_with_listener(c0, l).and_then(|c| c.all_gather_u64(1))
    });
    let rank1 = TcpGroup::connect(c1).and_then(|c| c.all_gather_u64(2));
    assert_eq!(rank1.expect("insecure rank 1"), vec![1, 2]);
    assert_eq!(rank0.join().expect("thread").expect("rank 0"), vec![1, 2]);
}

#[test]
fn a_secret_shorter_than_16_bytes_is_refused_with_the_reason() {
    let e = Secret::new(b"short-secret".to_vec()).expect_err("12 bytes");
    let msg = e.to_string();
    assert!(msg.contains("12 bytes") && msg.contains("16"), "{msg}");
    assert!(!msg.contains("short-secret"), "{msg}");
    Secret::new(b"sixteen-bytes-ok".to_vec()).expect("16 bytes");
}
