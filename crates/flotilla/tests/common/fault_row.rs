//! One row of the fault-injection table (BENCHMARKS.md §13): what was done, what came of it,
//! and whether that is what the documentation says; and the checks every row shares.
#![allow(dead_code)]

use std::path::Path;
use std::time::Duration;

use crate::common::{checkpoint_tensors, processes_mentioning};
use crate::procfs;

/// One row of the table, and whether it is what the documentation says.
pub struct Row {
    pub fault: String,
    pub mode: String,
    pub target: String,
    pub detected_s: Option<f64>,
    pub outcome: String,
    /// `None`: as documented; `Some(why)`: not.
    pub problem: Option<String>,
}

impl Row {
    /// A row not judged yet.
    pub fn new(
        fault: impl Into<String>,
        mode: impl Into<String>,
        target: impl Into<String>,
    ) -> Row {
        Row {
            fault: fault.into(),
            mode: mode.into(),
            target: target.into(),
            detected_s: None,
            outcome: String::new(),
            problem: None,
        }
    }
}

/// Marks the row as not documented behaviour, keeping the end of the output for the report.
pub fn fail(row: &mut Row, why: String, output: &str) {
    if row.outcome.is_empty() {
        row.outcome = why.clone();
    }
    let tail: Vec<&str> = output.lines().rev().take(25).collect();
    let tail: Vec<&str> = tail.into_iter().rev().collect();
    let msg = format!("{why}\n    {}", tail.join("\n    "));
    row.problem = Some(match row.problem.take() {
        Some(p) => format!("{p}\n{msg}"),
        None => msg,
    });
}

/// No process of the scenario may be left: none of `pids` (zombies count as gone), and no
/// `flotilla` process whose command line names its output directory.
pub fn check_nothing_left(row: &mut Row, pids: &[u32], out: &Path) {
    let left = procfs::wait_gone(pids, Duration::from_secs(5));
    let needle = out.to_str().expect("utf8");
    let named: Vec<(u32, String)> = processes_mentioning(needle)
        .into_iter()
        .filter(|(pid, _)| procfs::alive(*pid))
        .collect();
    if !left.is_empty() || !named.is_empty() {
        for pid in left.iter().chain(named.iter().map(|(p, _)| p)) {
            let _ = procfs::signal(*pid, libc::SIGKILL);
        }
        let why = format!("ORPHANS: processes left after the scenario: {left:?} {named:?}");
        row.outcome = format!("{}; {why}", row.outcome);
        fail(row, why, "");
    }
}

/// How the final checkpoints (`model.safetensors`) under the outputs `a` and `b` differ:
/// `None` if they hold the same tensors bit for bit.
pub fn checkpoint_difference(a: &Path, b: &Path) -> Option<String> {
    for out in [a, b] {
        if !out.join("checkpoints/latest").is_file() {
            return Some(format!("no checkpoint under {}", out.display()));
        }
    }
    let (a, b) = (checkpoint_tensors(a), checkpoint_tensors(b));
    if a.keys().ne(b.keys()) {
        return Some(format!(
            "other tensors: {:?} and {:?}",
            a.keys().collect::<Vec<_>>(),
            b.keys().collect::<Vec<_>>()
        ));
    }
    let differing: Vec<String> = a
        .iter()
        .filter_map(|(k, va)| {
            let vb = &b[k];
            let n = va
                .iter()
                .zip(vb)
                .filter(|(x, y)| x.to_bits() != y.to_bits())
                .count();
            let n = n + va.len().abs_diff(vb.len());
            (n > 0).then(|| format!("{n} of {} values of {k}", va.len()))
        })
        .collect();
    (!differing.is_empty()).then(|| format!("{} differ", differing.join(", ")))
}

/// `name` as a file name.
pub fn slug(name: &str) -> String {
    name.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect()
}

/// The row as a line of the Markdown table.
pub fn row_line(r: &Row) -> String {
    let detected = r.detected_s.map_or("–".to_string(), |s| format!("{s:.1}"));
    let mark = if r.problem.is_some() {
        " **(not as documented)**"
    } else {
        ""
    };
    format!(
        "| {} | {} | {} | {detected} | {}{mark} |",
        r.fault,
        r.mode,
        r.target,
        r.outcome.replace('|', "\\|")
    )
}

/// The whole table, with the seed, the wall time and the deadline of the run.
pub fn table(rows: &[Row], seed: u64, wall_s: f64, timeout_s: f64) -> String {
    let mut t = format!(
        "Seed {seed}, {} scenarios in {wall_s:.0} s; `comm.timeout_s` {timeout_s} s.\n\n\
         | fault | mode | target | detected in s | outcome |\n|---|---|---|---|---|\n",
        rows.len()
    );
    for r in rows {
        t.push_str(&row_line(r));
        t.push('\n');
    }
    t
}
