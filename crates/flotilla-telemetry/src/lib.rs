//! Telemetry of a Flotilla rank, outside the training libraries (which only emit `tracing`
//! spans and `metrics` values):
//! - [`mod@timeline`]: a `tracing` layer writing the rank's Chrome trace events as JSON lines;
//! - [`mod@merge`]: joins the ranks' files into one trace for Perfetto / chrome://tracing;
//! - [`exporter`]: the rank's Prometheus `/metrics` endpoint, served by [`http`] (bounded);
//! - [`events`]: the JSON-lines events a rank prints for its launcher.

#![forbid(unsafe_code)]

pub mod events;
pub mod exporter;
pub mod http;
pub mod merge;
pub mod timeline;

pub use events::{EVENT_PREFIX, RankEvent};
pub use exporter::{ExporterError, MetricsServer, Recorder, install};
pub use merge::{MergeError, MergeReport, merge};
pub use timeline::{COUNTER_TARGET, Opening, Timeline, TimelineLayer, timeline};
