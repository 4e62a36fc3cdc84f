//! The `/metrics` HTTP server: one accept thread and at most [`MAX_CONNECTIONS`] connection
//! threads, each answering one request (parsed by `httparse`) and closing.
//!
//! Why not a server crate: `tiny_http`, used before, starts a thread for every connection it
//! accepts, holds it for as long as the client stays silent, and panics when the system
//! refuses another thread; it has no limit and no hook to refuse a connection (its accept loop
//! is its own). A scrape endpoint needs one request per connection and a fixed response, so
//! the accept loop is kept here with the bounds it needs — connections at once, time to send
//! the request, size of the request head — and the HTTP request parsing is `httparse`'s.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Connections served at once; another one is closed as soon as it is accepted. Prometheus
/// scrapes one at a time: 8 leave room for a person's `curl` beside it.
pub const MAX_CONNECTIONS: usize = 8;

/// How long a client may take to send its request head; a silent one is closed then.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(5);

/// The largest request head read (a scrape's is a few hundred bytes).
const MAX_HEAD: usize = 8 * 1024;

/// How often the accept loop looks at its stop flag while no one connects.
const POLL: Duration = Duration::from_millis(50);

/// Serves `page()` at `/metrics` on `listener` until `stop`, from a thread of its own.
pub(crate) fn start(
    listener: TcpListener,
    page: impl Fn() -> String + Send + Sync + 'static,
    stop: Arc<AtomicBool>,
) -> std::io::Result<JoinHandle<()>> {
    listener.set_nonblocking(true)?;
    let page: Arc<dyn Fn() -> String + Send + Sync> = Arc::new(page);
    std::thread::Builder::new()
        .name("metrics-http".into())
        .spawn(move || accept(&listener, &page, &stop))
}

/// Accepts connections until `stop`, each served by a thread of its own while fewer than
/// [`MAX_CONNECTIONS`] are; others are closed at once.
fn accept(listener: &TcpListener, page: &Arc<dyn Fn() -> String + Send + Sync>, stop: &AtomicBool) {
    let live = Arc::new(AtomicUsize::new(0));
    while !stop.load(Ordering::Relaxed) {
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            // Nothing to accept, or the process is out of descriptors for a moment: wait.
            Err(_) => {
                std::thread::sleep(POLL);
                continue;
            }
        };
        if live.load(Ordering::Acquire) >= MAX_CONNECTIONS {
            drop(stream);
            continue;
        }
        live.fetch_add(1, Ordering::AcqRel);
        let slot = Slot(live.clone());
        let page = page.clone();
        let spawned = std::thread::Builder::new()
            .name("metrics-conn".into())
            .spawn(move || {
                let _slot = slot;
                // A client that went away or sent garbage is its own problem.
                let _ = answer(stream, &*page);
            });
        // No thread to be had: the connection is closed (its slot freed with the closure).
        drop(spawned);
    }
}

/// One of the [`MAX_CONNECTIONS`] slots, freed when dropped.
struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Reads one request head (within [`REQUEST_DEADLINE`] and [`MAX_HEAD`]) and answers it:
/// `GET /metrics` with `page()`, another path with 404, a request that does not parse with
/// 400.
fn answer(mut stream: TcpStream, page: &dyn Fn() -> String) -> std::io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_write_timeout(Some(REQUEST_DEADLINE))?;
    let deadline = Instant::now() + REQUEST_DEADLINE;
    let mut head = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    let target = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || head.len() > MAX_HEAD {
            return Ok(());
        }
        stream.set_read_timeout(Some(left))?;
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            return Ok(());
        }
        head.extend_from_slice(&chunk[..n]);
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut request = httparse::Request::new(&mut headers);
        match request.parse(&head) {
            Ok(httparse::Status::Complete(_)) => {
                break (request.method, request.path.map(str::to_owned));
            }
            Ok(httparse::Status::Partial) => {}
            Err(_) => break (None, None),
        }
    };
    let (status, body) = match target {
        (Some("GET"), Some(path)) if path.split('?').next() == Some("/metrics") => {
            ("200 OK", page())
        }
        (Some(_), Some(_)) => ("404 Not Found", "not found: try /metrics\n".to_string()),
        _ => ("400 Bad Request", "bad request\n".to_string()),
    };
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(response.as_bytes())?;
    stream.flush()
}
