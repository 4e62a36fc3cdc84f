//! `/metrics` under many idle connections: the process holds a bounded number of threads for
//! them (not one each, which exhausts a rank's threads), closes the ones over the limit at
//! once, and serves scrapes again once the idle ones give up. Alone in its test binary: it
//! counts the threads of the process.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use flotilla_telemetry::http::{MAX_CONNECTIONS, REQUEST_DEADLINE};

/// Threads of this process now.
fn threads() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|n| n.trim().parse().ok())
        .expect("Threads: line")
}

/// `GET /metrics` on 127.0.0.1:`port`: the status line and body, if it answers in time.
fn scrape(port: u16) -> Option<(String, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .ok()?;
    let mut reply = String::new();
    s.read_to_string(&mut reply).ok()?;
    let (head, body) = reply.split_once("\r\n\r\n")?;
    Some((head.lines().next()?.to_string(), body.to_string()))
}

#[test]
fn idle_connections_hold_a_bounded_number_of_threads_and_scrapes_go_on() {
    let recorder = flotilla_telemetry::install().expect("recorder");
    metrics::counter!("flotilla_test_connections_total").increment(3);
    let server = recorder.serve("127.0.0.1", 0).expect("serve");
    let port = server.port();
    let (status, body) = scrape(port).expect("a first scrape");
    assert!(status.contains(" 200 "), "{status}");
    assert!(body.contains("flotilla_test_connections_total 3"), "{body}");
    std::thread::sleep(Duration::from_millis(200));
    let before = threads();
    // Connections that send nothing, as a slow or hostile client's; bounded in count.
    let idle: Vec<TcpStream> = (0..200)
        .map(|_| TcpStream::connect(("127.0.0.1", port)).expect("connect"))
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let grown = threads().saturating_sub(before);
    assert!(
        grown <= MAX_CONNECTIONS,
        "{grown} more threads for 200 idle connections (at most {MAX_CONNECTIONS})"
    );
    // One over the limit is closed by the server at once (end of stream, no wait).
    let mut last = idle
        .last()
        .expect("a connection")
        .try_clone()
        .expect("clone");
    last.set_read_timeout(Some(Duration::from_secs(2)))
        .expect("timeout");
    let mut byte = [0u8; 1];
    match last.read(&mut byte) {
        Ok(0) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        other => panic!("a connection over the limit stayed open: {other:?}"),
    }
    // The idle ones within the limit are closed after the request deadline; then a scrape
    // is answered (the server and the process live on).
    let started = Instant::now();
    let answered = loop {
        if let Some((status, _)) = scrape(port).filter(|(s, _)| s.contains(" 200 ")) {
            break status;
        }
        assert!(
            started.elapsed() < REQUEST_DEADLINE + Duration::from_secs(10),
            "no scrape answered while idle connections were held"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(answered.starts_with("HTTP/1.1 200"), "{answered}");
    drop(idle);
    drop(server);
}
