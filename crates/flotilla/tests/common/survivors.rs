//! How the ranks that outlive a killed rank end, when no launcher stops them: each must exit
//! non-zero within a bound of the kill, its error naming the rank it lost with
//! `flotilla-tcp`'s own phrase ([`LOST`]: `CommError::PeerLost`'s Display, "connection to
//! rank R lost during OP: REASON", also inside "collective aborted by rank A: ...").
#![allow(dead_code)]

use std::process::ExitStatus;
use std::time::{Duration, Instant};

use crate::running::Running;

/// The phrase of `CommError::PeerLost` before and after the rank.
pub const LOST: (&str, &str) = ("connection to rank ", " lost during ");

/// How one surviving rank ended.
#[derive(Debug, Clone)]
pub struct Ending {
    /// Its rank.
    pub rank: usize,
    /// Its exit status (`None`: it still ran at the limit).
    pub status: Option<ExitStatus>,
    /// Seconds from the kill to its exit.
    pub after_s: Option<f64>,
    /// Its last `error: ...` line.
    pub error: Option<String>,
    /// The rank its error names with [`LOST`] (the first such phrase).
    pub names: Option<usize>,
}

/// The rank the first `connection to rank R lost during` of `text` names.
pub fn named_rank(text: &str) -> Option<usize> {
    let (before, after) = LOST;
    text.match_indices(before).find_map(|(i, _)| {
        let rest = &text[i + before.len()..];
        let digits = rest.chars().take_while(char::is_ascii_digit).count();
        let rank = rest[..digits].parse().ok()?;
        rest[digits..].starts_with(after).then_some(rank)
    })
}

/// Waits (at most `limit` after `t0`) for every process of `ranks` (rank, process) to exit,
/// polling them all so that each exit is timed; how each ended.
pub fn wait_endings(ranks: &mut [(usize, Running)], t0: Instant, limit: Duration) -> Vec<Ending> {
    while t0.elapsed() < limit && ranks.iter_mut().any(|(_, p)| p.exited().is_none()) {
        std::thread::sleep(Duration::from_millis(10));
    }
    ranks
        .iter_mut()
        .map(|(rank, p)| {
            let status = p.exited();
            let text = p.text();
            let error = text.lines().rev().find(|l| l.starts_with("error: "));
            Ending {
                rank: *rank,
                status,
                after_s: p
                    .ended()
                    .map(|e| e.saturating_duration_since(t0).as_secs_f64()),
                names: error.and_then(named_rank),
                error: error.map(str::to_string),
            }
        })
        .collect()
}

/// Whether every survivor ended as it must after `dead` was killed: exit non-zero within
/// `bound_s`, its error naming `dead` itself (a failed collective tells every peer why; a
/// failed parameter-server rank tells its peers with an `Abort` carrying its error). A
/// summary, or what was wrong.
pub fn judge_endings(endings: &[Ending], dead: usize, bound_s: f64) -> Result<String, String> {
    let mut problems = Vec::new();
    for e in endings {
        let what = format!("rank {}", e.rank);
        match e.status {
            None => problems.push(format!("{what} still ran {bound_s} s after the kill")),
            Some(s) if s.success() => problems.push(format!("{what} exited 0")),
            Some(_) => {}
        }
        if e.after_s.is_some_and(|t| t > bound_s) {
            problems.push(format!(
                "{what} exited {:.1} s after the kill, beyond {bound_s} s",
                e.after_s.unwrap_or_default()
            ));
        }
        if e.names != Some(dead) {
            problems.push(format!(
                "{what}'s error does not name rank {dead} (\"{}{dead}{}\"): {:?}",
                LOST.0, LOST.1, e.error
            ));
        }
    }
    if !problems.is_empty() {
        return Err(problems.join("; "));
    }
    let slowest = endings.iter().filter_map(|e| e.after_s).fold(0.0, f64::max);
    let ranks: Vec<String> = endings.iter().map(|e| e.rank.to_string()).collect();
    Ok(format!(
        "every survivor ({}) exit ≠ 0 within {slowest:.1} s, naming rank {dead}",
        ranks.join(", ")
    ))
}
