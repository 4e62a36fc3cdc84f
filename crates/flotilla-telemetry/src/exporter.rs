//! The Prometheus endpoint of a rank: the `metrics` facade's recorder (the libraries record
//! through `metrics::counter!`/`gauge!`/`histogram!`), rendered as Prometheus text by
//! `metrics-exporter-prometheus` and served at `http://ADDR:PORT/metrics` by `tiny_http` on
//! one background thread.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// Why the endpoint could not start.
#[derive(Debug, thiserror::Error)]
pub enum ExporterError {
    /// The port could not be bound.
    #[error("serving /metrics on {addr}: {message}")]
    Bind {
        /// The address.
        addr: String,
        /// The cause.
        message: String,
    },
    /// Another recorder is installed already.
    #[error("a metrics recorder is already installed: {0}")]
    Recorder(String),
}

/// A running `/metrics` endpoint; stops when dropped.
pub struct MetricsServer {
    handle: PrometheusHandle,
    port: u16,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// Histogram buckets (seconds) for step and collective times: 100 µs to 100 s.
const SECONDS_BUCKETS: [f64; 13] = [
    1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0,
];

/// The installed global recorder: values recorded from now on are kept for `/metrics`.
#[derive(Clone)]
pub struct Recorder {
    handle: PrometheusHandle,
}

/// Installs the global `metrics` recorder. Install it before the communicator connects:
/// handles taken before (per-peer byte counters) would record nowhere.
pub fn install() -> Result<Recorder, ExporterError> {
    let recorder = PrometheusBuilder::new()
        .set_buckets(&SECONDS_BUCKETS)
        .map_err(|e| ExporterError::Recorder(e.to_string()))?
        .build_recorder();
    let handle = recorder.handle();
    metrics::set_global_recorder(recorder).map_err(|e| ExporterError::Recorder(e.to_string()))?;
    Ok(Recorder { handle })
}

impl Recorder {
    /// Serves the recorded values on `addr:port` (port 0 picks a free one).
    pub fn serve(&self, addr: &str, port: u16) -> Result<MetricsServer, ExporterError> {
        let bind = format!("{addr}:{port}");
        let server = tiny_http::Server::http(&bind).map_err(|e| ExporterError::Bind {
            addr: bind.clone(),
            message: e.to_string(),
        })?;
        let port = server
            .server_addr()
            .to_ip()
            .map(|a| a.port())
            .unwrap_or(port);
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (handle, stop) = (self.handle.clone(), stop.clone());
            std::thread::Builder::new()
                .name("metrics-http".into())
                .spawn(move || answer(&server, &handle, &stop))
                .map_err(|e| ExporterError::Bind {
                    addr: bind,
                    message: e.to_string(),
                })?
        };
        Ok(MetricsServer {
            handle: self.handle.clone(),
            port,
            stop,
            thread: Some(thread),
        })
    }

    /// The Prometheus text of the values recorded so far.
    pub fn render(&self) -> String {
        self.handle.render()
    }
}

/// Answers requests until `stop`: `/metrics` gets the Prometheus text, anything else 404.
fn answer(server: &tiny_http::Server, handle: &PrometheusHandle, stop: &AtomicBool) {
    while !stop.load(Ordering::Relaxed) {
        let request = match server.recv_timeout(Duration::from_millis(100)) {
            Ok(Some(r)) => r,
            Ok(None) => continue,
            Err(_) => break,
        };
        let path = request
            .url()
            .split('?')
            .next()
            .unwrap_or_default()
            .to_string();
        let response = if path == "/metrics" {
            handle.run_upkeep();
            let content_type = tiny_http::Header::from_bytes(
                &b"Content-Type"[..],
                &b"text/plain; version=0.0.4; charset=utf-8"[..],
            );
            let mut r = tiny_http::Response::from_string(handle.render());
            if let Ok(h) = content_type {
                r.add_header(h);
            }
            r
        } else {
            tiny_http::Response::from_string("not found: try /metrics\n").with_status_code(404)
        };
        // A client that went away is its own problem.
        let _ = request.respond(response);
    }
}

impl MetricsServer {
    /// The port served.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The text `/metrics` serves now.
    pub fn render(&self) -> String {
        self.handle.render()
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
