#![allow(dead_code)]
//! What each start of a rank did, read from what it left in its output directory: the
//! `step` spans of its timeline (`--timeline`; a resumed or replaced rank appends, and every
//! start begins with its `process_name` event), the numbers of `summary.json`, and numbered
//! lines of its run log.

use std::path::Path;

/// The `step` numbers of every start of rank `rank` under `out`, one list per start in the
/// order they ran (each step as its span recorded it, in the order the spans closed).
pub fn steps_per_start(out: &Path, rank: usize) -> Vec<Vec<u64>> {
    let path = out.join(format!("rank-{rank}/timeline.jsonl"));
    let text = std::fs::read_to_string(&path).expect("the rank's timeline");
    let mut starts: Vec<Vec<u64>> = Vec::new();
    for line in text.lines() {
        let e: serde_json::Value = serde_json::from_str(line).expect("a complete event per line");
        if e["ph"] == "M" && e["name"] == "process_name" {
            starts.push(Vec::new());
        } else if e["ph"] == "X" && e["name"] == "step" {
            let step = e["args"]["step"].as_u64().expect("a step number");
            starts
                .last_mut()
                .expect("a step after the start's process_name")
                .push(step);
        }
    }
    starts
}

/// Asserts that one start ran the steps `first..=last` exactly, each once, in order.
pub fn assert_ran(what: &str, steps: &[u64], first: u64, last: u64) {
    let want: Vec<u64> = (first..=last).collect();
    if steps != want.as_slice() {
        let (a, b) = (steps.first(), steps.last());
        panic!(
            "{what}: ran {} step spans from {a:?} to {b:?}, expected exactly {first}..={last}: {steps:?}",
            steps.len()
        );
    }
}

/// `<out>/summary.json`.
pub fn summary(out: &Path) -> serde_json::Value {
    let path = out.join("summary.json");
    serde_json::from_slice(&std::fs::read(&path).expect("summary.json")).expect("JSON")
}

/// The number right after `before` in every line of `log` containing it, in order.
pub fn numbers_after(log: &str, before: &str) -> Vec<u64> {
    log.lines()
        .filter_map(|l| l.split(before).nth(1))
        .map(|rest| {
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            digits
                .parse()
                .unwrap_or_else(|_| panic!("a number after {before:?}: {rest}"))
        })
        .collect()
}
