//! The end of a run: every rank's [`RankReport`] goes to rank 0 (which writes the job's
//! summary), point to point. Not a collective, so that a rank lost on the way (an async
//! server's worker) or one that rejoined the running job (whose links carry no collectives)
//! costs only its own report: rank 0 takes what arrives, and names what did not.

use std::time::{Duration, Instant};

use flotilla_tcp::{CommError, ProcessGroup, Tag, tags};

use crate::history::RankReport;

/// The tag of the reports.
pub const REPORT_TAG: Tag = tags::RESERVED + 0x101;

/// What rank 0 gathered: the reports by rank, and why each missing one is missing.
#[derive(Debug, Default)]
pub struct Gathered {
    /// Reports, rank 0's first, then by rank.
    pub reports: Vec<RankReport>,
    /// `(rank, why)` of every rank whose report did not come.
    pub missing: Vec<(usize, String)>,
}

/// Sends `mine` to rank 0 (every other rank: `None`), or, on rank 0, gathers everybody's
/// within `timeout`.
pub fn to_root(comm: &dyn ProcessGroup, mine: RankReport, timeout: Duration) -> Option<Gathered> {
    if comm.rank() != 0 {
        let sent = serde_json::to_vec(&mine)
            .map_err(|e| e.to_string())
            .and_then(|b| comm.send(0, REPORT_TAG, &b).map_err(|e| e.to_string()));
        if let Err(e) = sent {
            tracing::warn!("the end-of-run report did not reach rank 0: {e}");
        }
        return None;
    }
    let mut out = Gathered {
        reports: vec![mine],
        missing: Vec::new(),
    };
    let mut waiting: Vec<usize> = (1..comm.size()).collect();
    let deadline = Instant::now() + timeout;
    while !waiting.is_empty() {
        match comm.recv_any(&waiting, REPORT_TAG, deadline) {
            Ok((peer, bytes)) => {
                waiting.retain(|&p| p != peer);
                match serde_json::from_slice::<RankReport>(&bytes) {
                    Ok(r) => out.reports.push(r),
                    Err(e) => out.missing.push((peer, format!("malformed report: {e}"))),
                }
            }
            Err(CommError::Deadline { .. }) => {
                let why = format!("no report within {timeout:?}");
                out.missing
                    .extend(waiting.drain(..).map(|p| (p, why.clone())));
            }
            Err(e) => {
                let peer = e
                    .blamed_rank()
                    .and_then(|w| comm.group_rank(w))
                    .filter(|p| waiting.contains(p))
                    .unwrap_or(waiting[0]);
                waiting.retain(|&p| p != peer);
                out.missing.push((peer, e.to_string()));
            }
        }
    }
    out.reports.sort_by_key(|r| r.rank);
    out.missing.sort_by_key(|&(r, _)| r);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_tcp::{CommConfig, TcpGroup};
    use std::sync::Arc;

    fn report(rank: usize) -> RankReport {
        RankReport {
            rank,
            role: "peer".into(),
            bytes_sent: rank as u64,
            bytes_received: 0,
            shm_bytes: 0,
            bytes_sent_inter_host: 0,
            figures: Default::default(),
        }
    }

    #[test]
    fn rank_0_gets_every_report_and_names_a_lost_rank() {
        let cfg = CommConfig::default().with_timeout(Duration::from_secs(5));
        let mut comms: Vec<Arc<TcpGroup>> = TcpGroup::in_memory(4, cfg)
            .expect("world")
            .into_iter()
            .map(Arc::new)
            .collect();
        // Rank 3 is gone before the end.
        drop(comms.pop());
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(r, c)| {
                std::thread::spawn(move || to_root(&*c, report(r), Duration::from_secs(5)))
            })
            .collect();
        let results: Vec<Option<Gathered>> = handles
            .into_iter()
            .map(|h| h.join().expect("thread"))
            .collect();
        assert!(results[1].is_none() && results[2].is_none());
        let g = results[0].as_ref().expect("rank 0 gathers");
        let ranks: Vec<usize> = g.reports.iter().map(|r| r.rank).collect();
        assert_eq!(ranks, vec![0, 1, 2]);
        assert_eq!(g.missing.len(), 1);
        assert_eq!(g.missing[0].0, 3);
    }
}
