//! The Prometheus endpoint of a rank: the `metrics` facade's recorder (the libraries record
//! through `metrics::counter!`/`gauge!`/`histogram!`), rendered as Prometheus text by
//! `metrics-exporter-prometheus` and served at `http://ADDR:PORT/metrics` ([`http`]).

use std::net::TcpListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

use crate::http;

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
    /// Serves the recorded values on `addr:port` (port 0 picks a free one): at most
    /// [`http::MAX_CONNECTIONS`] clients at once, each given [`http::REQUEST_DEADLINE`] to
    /// send its request. `addr` is the interface: `127.0.0.1` (the default of
    /// `telemetry.metrics_addr`) keeps the endpoint to this machine, `0.0.0.0` opens it to
    /// the network.
    pub fn serve(&self, addr: &str, port: u16) -> Result<MetricsServer, ExporterError> {
        let bind = format!("{addr}:{port}");
        let bad = |e: std::io::Error| ExporterError::Bind {
            addr: bind.clone(),
            message: e.to_string(),
        };
        let listener = TcpListener::bind((addr, port)).map_err(bad)?;
        let port = listener.local_addr().map_err(bad)?.port();
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (handle, stop) = (self.handle.clone(), stop.clone());
            let page = move || {
                handle.run_upkeep();
                handle.render()
            };
            http::start(listener, page, stop).map_err(bad)?
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
