//! A `tracing` layer that records a rank's spans as Chrome trace events, one JSON object per
//! line (`<output>/rank-N/timeline.jsonl`), for [`crate::merge()`] to join into one trace.
//!
//! - Every closed span of a `flotilla*` target becomes a complete event (`"ph": "X"`) with its
//!   fields as `args`; `ts` is microseconds since the Unix epoch, so ranks on one host line up.
//! - A span with a `track` field goes to a lane of that name instead of its thread's lane
//!   (collectives run on runtime threads; they share the `comm` lane, where they never overlap
//!   because the group runs its collectives one at a time).
//! - An event of target [`COUNTER_TARGET`] becomes a counter (`"ph": "C"`) named by its
//!   `counter` field, with its numeric fields as the series.
//! - [`Timeline::set_process`] writes the `process_name` metadata (`rank N (role)`); the pid of
//!   every event is the rank.
//! - A span without a parent (a step, an evaluation, a checkpoint) is flushed when it ends,
//!   so a rank killed mid-run leaves every step it finished. A rank that continues an
//!   earlier run ([`Opening::Continue`]: a resumed job, a replaced worker) appends, so the
//!   file holds each start of the rank in order, each beginning with its `process_name`.
//!
//! `tracing-chrome` was the first choice; it writes pid 1 for every process, timestamps from a
//! per-process monotonic clock (ranks cannot be aligned), no counters, and one JSON array that
//! a crash leaves unreadable. This layer is the part of it Flotilla needs, with those fixed.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde_json::{Map, Value, json};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Subscriber};
use tracing_subscriber::Layer;
use tracing_subscriber::layer::Context;
use tracing_subscriber::registry::LookupSpan;

/// Target of events that are counters (`tracing::trace!(target: COUNTER_TARGET, counter =
/// "bytes", sent = .., received = ..)`).
pub const COUNTER_TARGET: &str = "flotilla::counter";

/// Where timeline lines go; shared by the layer and its [`Timeline`] handle.
struct Sink {
    out: Mutex<Option<BufWriter<File>>>,
    pid: AtomicU64,
    /// Wall clock at `origin`, in microseconds since the Unix epoch.
    origin_us: f64,
    origin: Instant,
    tracks: Mutex<HashMap<String, u64>>,
}

impl Sink {
    fn now_us(&self) -> f64 {
        self.origin_us + self.origin.elapsed().as_nanos() as f64 / 1000.0
    }

    fn ts_of(&self, at: Instant) -> f64 {
        self.origin_us + at.duration_since(self.origin).as_nanos() as f64 / 1000.0
    }

    fn write(&self, mut event: Value) {
        event["pid"] = json!(self.pid.load(Ordering::Relaxed));
        if let Ok(mut out) = self.out.lock()
            && let Some(w) = out.as_mut()
        {
            // A full disk loses timeline lines, never the training run.
            let _ = serde_json::to_writer(&mut *w, &event);
            let _ = w.write_all(b"\n");
        }
    }

    fn flush(&self) {
        if let Ok(mut out) = self.out.lock()
            && let Some(w) = out.as_mut()
        {
            let _ = w.flush();
        }
    }

    /// The lane (`tid`) of a named track, announcing its name the first time.
    fn track(&self, name: &str) -> u64 {
        let (tid, new) = {
            let mut tracks = self.tracks.lock().unwrap_or_else(|p| p.into_inner());
            let next = 1_000_000 + tracks.len() as u64;
            match tracks.get(name) {
                Some(t) => (*t, false),
                None => {
                    tracks.insert(name.to_string(), next);
                    (next, true)
                }
            }
        };
        if new {
            self.write(
                json!({"ph": "M", "name": "thread_name", "tid": tid, "args": {"name": name}}),
            );
        }
        tid
    }
}

/// Opens `path` to append, first cutting a last line without its newline (the earlier
/// run died while writing it), so that every line stays one complete event.
fn continue_file(path: &Path) -> std::io::Result<File> {
    let complete = match std::fs::read(path) {
        Ok(bytes) => bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
        Err(e) => return Err(e),
    };
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    file.set_len(complete as u64)?;
    Ok(file)
}

/// The handle of a rank's timeline: names the process and flushes the file.
#[derive(Clone)]
pub struct Timeline {
    sink: Arc<Sink>,
}

/// The layer to add to the subscriber.
pub struct TimelineLayer {
    sink: Arc<Sink>,
}

/// How a rank's timeline file is opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Opening {
    /// A fresh run: the file starts empty.
    Fresh,
    /// A run that continues an earlier one of the same rank (a resumed job, a replaced
    /// worker): its events follow the earlier run's, after a line that run's death cut
    /// short is dropped, so the file holds every start of the rank in order.
    Continue,
}

/// Creates (or, to continue, opens) the timeline file at `path` (its directory must exist)
/// and the layer writing it.
pub fn timeline(path: &Path, opening: Opening) -> std::io::Result<(Timeline, TimelineLayer)> {
    let file = match opening {
        Opening::Fresh => File::create(path)?,
        Opening::Continue => continue_file(path)?,
    };
    let origin_us = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as f64 / 1000.0)
        .unwrap_or(0.0);
    let sink = Arc::new(Sink {
        out: Mutex::new(Some(BufWriter::new(file))),
        pid: AtomicU64::new(0),
        origin_us,
        origin: Instant::now(),
        tracks: Mutex::new(HashMap::new()),
    });
    Ok((Timeline { sink: sink.clone() }, TimelineLayer { sink }))
}

impl Timeline {
    /// Names this process `rank R (role)`; every event carries pid `rank`.
    pub fn set_process(&self, rank: usize, role: &str) {
        self.sink.pid.store(rank as u64, Ordering::Relaxed);
        self.sink.write(json!({
            "ph": "M", "name": "process_name", "tid": 0,
            "args": {"name": format!("rank {rank} ({role})")}
        }));
        self.sink.write(json!({
            "ph": "M", "name": "process_sort_index", "tid": 0, "args": {"sort_index": rank}
        }));
    }

    /// Writes out what is buffered.
    pub fn flush(&self) {
        self.sink.flush();
    }

    /// Flushes and closes the file; later events are dropped.
    pub fn close(&self) {
        if let Ok(mut out) = self.sink.out.lock()
            && let Some(mut w) = out.take()
        {
            let _ = w.flush();
        }
    }
}

/// What the layer keeps on a span: when it opened, its fields, its track.
struct Open {
    start: Instant,
    args: Map<String, Value>,
    track: Option<String>,
}

/// Collects fields as JSON.
struct Fields<'a>(&'a mut Map<String, Value>);

impl Visit for Fields<'_> {
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.0.insert(field.name().into(), json!(value));
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name().into(), json!(value));
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().into(), json!(value));
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.insert(field.name().into(), json!(value));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().into(), json!(value));
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0
            .insert(field.name().into(), json!(format!("{value:?}")));
    }
}

fn ours(target: &str) -> bool {
    target.starts_with("flotilla")
}

fn thread_tid() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local! {
        static TID: u64 = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    TID.with(|t| *t)
}

impl<S> Layer<S> for TimelineLayer
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        if !ours(attrs.metadata().target()) {
            return;
        }
        let mut args = Map::new();
        attrs.record(&mut Fields(&mut args));
        let track = match args.remove("track") {
            Some(Value::String(t)) => Some(t),
            _ => None,
        };
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(Open {
                start: Instant::now(),
                args,
                track,
            });
        }
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id)
            && let Some(open) = span.extensions_mut().get_mut::<Open>()
        {
            values.record(&mut Fields(&mut open.args));
        }
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(&id) else {
            return;
        };
        let Some(open) = span.extensions_mut().remove::<Open>() else {
            return;
        };
        let sink = &self.sink;
        let ts = sink.ts_of(open.start);
        let dur = (sink.now_us() - ts).max(0.0);
        let tid = match &open.track {
            Some(t) => sink.track(t),
            None => thread_tid(),
        };
        sink.write(json!({
            "name": span.name(), "ph": "X", "ts": ts, "dur": dur, "tid": tid,
            "args": Value::Object(open.args),
        }));
        if span.parent().is_none() {
            // A whole step (or evaluation, checkpoint) is on disk once it ends: a rank killed
            // later loses at most the one in progress.
            sink.flush();
        }
    }

    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        if event.metadata().target() != COUNTER_TARGET {
            return;
        }
        let mut args = Map::new();
        event.record(&mut Fields(&mut args));
        args.remove("message");
        let name = match args.remove("counter") {
            Some(Value::String(n)) => n,
            _ => "counter".to_string(),
        };
        args.retain(|_, v| v.is_number());
        let ts = self.sink.now_us();
        self.sink.write(
            json!({"name": name, "ph": "C", "ts": ts, "tid": 0, "args": Value::Object(args)}),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing_subscriber::prelude::*;

    /// A rank that continues appends after what a killed run left, minus its cut line, and
    /// its steps are on disk as each ends (the file is read before the handle is closed).
    #[test]
    fn a_continued_timeline_appends_after_the_cut_line_and_steps_are_flushed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("t.jsonl");
        std::fs::write(&path, "{\"ph\":\"M\",\"name\":\"a\"}\n{\"ph\":\"X\",\"na").expect("write");
        let (handle, layer) = timeline(&path, Opening::Continue).expect("timeline");
        let subscriber = tracing_subscriber::registry().with(layer);
        tracing::subscriber::with_default(subscriber, || {
            let step = tracing::info_span!(target: "flotilla::train", "step", step = 51u64);
            let _e = step.enter();
            tracing::info_span!(target: "flotilla::engine", "forward").in_scope(|| {});
        });
        let text = std::fs::read_to_string(&path).expect("read");
        let names: Vec<String> = text
            .lines()
            .map(|l| {
                let v: Value = serde_json::from_str(l).expect("every line is an event");
                v["name"].as_str().expect("name").to_string()
            })
            .collect();
        assert_eq!(names, ["a", "forward", "step"]);
        drop(handle);
        let (_t, _layer) = timeline(&path, Opening::Fresh).expect("fresh");
        assert_eq!(std::fs::read_to_string(&path).expect("read"), "");
    }

    #[test]
    fn spans_tracks_and_counters_become_chrome_events() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("t.jsonl");
        let (timeline, layer) = timeline(&path, Opening::Fresh).expect("timeline");
        let subscriber = tracing_subscriber::registry().with(layer);
        tracing::subscriber::with_default(subscriber, || {
            timeline.set_process(3, "peer");
            let step = tracing::info_span!(target: "flotilla::train", "forward", step = 7u64);
            {
                let _e = step.enter();
                let inner = tracing::info_span!(target: "flotilla::comm", "all_reduce", bucket = 2u64, bytes = 4096u64, track = "comm");
                drop(inner.enter());
            }
            drop(step);
            tracing::trace!(target: COUNTER_TARGET, counter = "bytes", sent = 10u64, received = 20u64);
            tracing::info_span!(target: "other", "ignored").in_scope(|| {});
        });
        timeline.close();
        let text = std::fs::read_to_string(&path).expect("read");
        let events: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).expect("json line"))
            .collect();
        assert!(events.iter().all(|e| e["pid"] == 3));
        let named = |n: &str| events.iter().find(|e| e["name"] == n).cloned();
        let meta = named("process_name").expect("process_name");
        assert_eq!(meta["args"]["name"], "rank 3 (peer)");
        let ar = named("all_reduce").expect("all_reduce");
        assert_eq!(ar["ph"], "X");
        assert_eq!(ar["args"]["bucket"], 2);
        assert_eq!(ar["args"]["bytes"], 4096);
        assert!(ar["args"].get("track").is_none());
        let lane = named("thread_name").expect("comm lane");
        assert_eq!(lane["args"]["name"], "comm");
        assert_eq!(lane["tid"], ar["tid"]);
        let fwd = named("forward").expect("forward");
        assert_eq!(fwd["args"]["step"], 7);
        assert!(
            fwd["ts"].as_f64().expect("ts") > 1.6e15,
            "wall-clock microseconds"
        );
        assert!(fwd["dur"].as_f64().expect("dur") >= ar["dur"].as_f64().expect("dur"));
        let c = named("bytes").expect("counter");
        assert_eq!(c["ph"], "C");
        assert_eq!(c["args"]["sent"], 10);
        assert_eq!(c["args"]["received"], 20);
        assert!(named("ignored").is_none());
    }
}
