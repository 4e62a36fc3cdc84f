//! Joining the ranks' timeline files (JSON lines, see [`mod@crate::timeline`]) into one Chrome
//! trace-event file that Perfetto and chrome://tracing open: `{"traceEvents": [...]}`.
//!
//! A file cut short by a crash still merges: a last line that is not complete JSON is
//! skipped (and counted). Events keep the pid their rank wrote.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};

/// Why a merge failed.
#[derive(Debug, thiserror::Error)]
pub enum MergeError {
    /// A file could not be read or written (the cause is the error's source).
    #[error("{path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A line in the middle of a file is not JSON.
    #[error("{path}:{line}: not a timeline event: {message}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// The parser's message.
        message: String,
    },
}

/// What a merge did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MergeReport {
    /// Events written.
    pub events: usize,
    /// Files merged.
    pub files: usize,
    /// Files whose last line was incomplete (a rank that died while writing).
    pub truncated: Vec<PathBuf>,
}

/// Reads the events of one rank's timeline file.
fn read_events(path: &Path, report: &mut MergeReport) -> Result<Vec<Value>, MergeError> {
    let text = fs::read_to_string(path).map_err(|source| MergeError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let mut events = Vec::with_capacity(lines.len());
    for (i, line) in lines.iter().enumerate() {
        match serde_json::from_str::<Value>(line) {
            Ok(v) if v.is_object() => events.push(v),
            Ok(_) | Err(_) if i + 1 == lines.len() && !text.ends_with('\n') => {
                report.truncated.push(path.to_path_buf());
            }
            Ok(_) => {
                return Err(MergeError::Corrupt {
                    path: path.to_path_buf(),
                    line: i + 1,
                    message: "not a JSON object".into(),
                });
            }
            Err(e) => {
                return Err(MergeError::Corrupt {
                    path: path.to_path_buf(),
                    line: i + 1,
                    message: e.to_string(),
                });
            }
        }
    }
    Ok(events)
}

/// Merges `inputs` into the Chrome trace file `output`: metadata first, then every event in
/// time order.
pub fn merge(inputs: &[PathBuf], output: &Path) -> Result<MergeReport, MergeError> {
    let mut report = MergeReport::default();
    let mut events = Vec::new();
    for path in inputs {
        events.extend(read_events(path, &mut report)?);
        report.files += 1;
    }
    let ts = |e: &Value| {
        if e["ph"] == "M" {
            f64::NEG_INFINITY
        } else {
            e["ts"].as_f64().unwrap_or(0.0)
        }
    };
    events.sort_by(|a, b| ts(a).total_cmp(&ts(b)));
    report.events = events.len();
    let trace = json!({"traceEvents": events, "displayTimeUnit": "ms"});
    let io = |source| MergeError::Io {
        path: output.to_path_buf(),
        source,
    };
    let tmp = output.with_extension("json.tmp");
    let mut f = fs::File::create(&tmp).map_err(io)?;
    serde_json::to_writer(&mut f, &trace).map_err(|e| io(e.into()))?;
    f.write_all(b"\n").map_err(io)?;
    drop(f);
    fs::rename(&tmp, output).map_err(io)?;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_merge_in_time_order_and_a_truncated_tail_is_skipped() {
        let dir = tempfile::tempdir().expect("tempdir");
        let a = dir.path().join("a.jsonl");
        let b = dir.path().join("b.jsonl");
        fs::write(
            &a,
            "{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":0,\"args\":{\"name\":\"rank 0 (peer)\"}}\n\
             {\"ph\":\"X\",\"name\":\"forward\",\"pid\":0,\"ts\":30.0,\"dur\":1.0}\n",
        )
        .expect("a");
        fs::write(
            &b,
            "{\"ph\":\"X\",\"name\":\"backward\",\"pid\":1,\"ts\":10.0,\"dur\":1.0}\n{\"ph\":\"X\",\"na",
        )
        .expect("b");
        let out = dir.path().join("trace.json");
        let r = merge(&[a.clone(), b.clone()], &out).expect("merge");
        assert_eq!(r.events, 3);
        assert_eq!(r.truncated, vec![b]);
        let v: Value =
            serde_json::from_str(&fs::read_to_string(&out).expect("read")).expect("json");
        let names: Vec<&str> = v["traceEvents"]
            .as_array()
            .expect("array")
            .iter()
            .map(|e| e["name"].as_str().expect("name"))
            .collect();
        assert_eq!(names, ["process_name", "backward", "forward"]);

        fs::write(&a, "{\"ph\":\"X\"}\nnot json\n{\"ph\":\"X\"}\n").expect("corrupt");
        let e = merge(&[a], &out).expect_err("corrupt middle line");
        assert!(e.to_string().contains(":2:"), "{e}");
    }
}
