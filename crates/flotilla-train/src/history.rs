//! What a rank remembers of its run for the report written at the end (`summary.json`, the
//! plots, `flotilla compare`): the training loss of every step and every evaluation, each
//! with its step and wall time; and, gathered from every rank at the end, each rank's role,
//! figures and traffic.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The training loss of one step (or server round).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LossPoint {
    /// Steps (or rounds) done, this one included.
    pub step: u64,
    /// Seconds since the rank started.
    pub wall_s: f64,
    /// The step's training loss (global mean for peers, the round's mean at a server).
    pub loss: f64,
}

/// One record of the run's progress: an epoch's end (data parallel, pipeline) or an
/// evaluation (a parameter-server root), with the test figures when it evaluated.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct EvalPoint {
    /// Steps (or rounds) done.
    pub step: u64,
    /// Seconds since the rank started.
    pub wall_s: f64,
    /// Mean training loss since the previous record.
    pub train_loss: Option<f64>,
    /// Test loss, when evaluated.
    pub test_loss: Option<f64>,
    /// Test accuracy, when evaluated.
    pub test_acc: Option<f64>,
    /// Training samples per second (all ranks) since the previous record.
    pub samples_per_s: Option<f64>,
}

/// A rank's history of the run: every step's loss and every record.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct History {
    /// Loss per step, in order.
    pub losses: Vec<LossPoint>,
    /// Records (epoch ends, evaluations), in order.
    pub records: Vec<EvalPoint>,
}

impl History {
    /// The records that carry a test accuracy, with it.
    pub fn evaluations(&self) -> impl Iterator<Item = (&EvalPoint, f64)> {
        self.records
            .iter()
            .filter_map(|r| r.test_acc.map(|a| (r, a)))
    }
}

/// What each rank tells rank 0 at the end of the run (see [`crate::gather`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankReport {
    /// The rank.
    pub rank: usize,
    /// Its role (`peer`, `root`, `worker`, ...).
    pub role: String,
    /// Bytes it wrote to sockets, all groups, frame headers included.
    pub bytes_sent: u64,
    /// Bytes it read from sockets.
    pub bytes_received: u64,
    /// Bytes it copied into shared-memory segments (ranks of one host).
    #[serde(default)]
    pub shm_bytes: u64,
    /// The part of `bytes_sent` it wrote to ranks on another host.
    #[serde(default)]
    pub bytes_sent_inter_host: u64,
    /// Its run figures (see [`crate::RunSummary::figures`]).
    pub figures: BTreeMap<String, f64>,
}

/// The traffic of a whole job, from every rank's [`RankReport`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JobTraffic {
    /// Bytes sent by all ranks: the bytes on the wire (each byte counted once, by its sender).
    pub bytes_sent: u64,
    /// Bytes received by all ranks (equal to `bytes_sent` once every frame has arrived).
    pub bytes_received: u64,
    /// Bytes all ranks copied into shared-memory segments instead of sending them.
    pub shm_bytes: u64,
    /// The part of `bytes_sent` that went to ranks on another host (the network's share).
    pub bytes_sent_inter_host: u64,
}

impl JobTraffic {
    /// Sums the ranks' counters.
    pub fn of(ranks: &[RankReport]) -> Self {
        Self {
            bytes_sent: ranks.iter().map(|r| r.bytes_sent).sum(),
            bytes_received: ranks.iter().map(|r| r.bytes_received).sum(),
            shm_bytes: ranks.iter().map(|r| r.shm_bytes).sum(),
            bytes_sent_inter_host: ranks.iter().map(|r| r.bytes_sent_inter_host).sum(),
        }
    }

    /// Bytes moved between ranks: sent over sockets or copied into shared memory.
    pub fn moved(&self) -> u64 {
        self.bytes_sent + self.shm_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traffic_sums_every_rank_and_evaluations_skip_plain_epochs() {
        let rank = |rank, sent, received| RankReport {
            rank,
            role: "peer".into(),
            bytes_sent: sent,
            bytes_received: received,
            shm_bytes: sent / 5,
            bytes_sent_inter_host: sent / 2,
            figures: BTreeMap::new(),
        };
        let t = JobTraffic::of(&[rank(0, 10, 7), rank(1, 5, 8)]);
        assert_eq!((t.bytes_sent, t.bytes_received, t.shm_bytes), (15, 15, 3));
        assert_eq!(t.bytes_sent_inter_host, 7);
        assert_eq!(t.moved(), 18);
        let point = |step: u64, acc: Option<f64>| EvalPoint {
            step,
            wall_s: step as f64,
            train_loss: Some(1.0),
            test_loss: acc.map(|_| 0.5),
            test_acc: acc,
            samples_per_s: None,
        };
        let h = History {
            losses: Vec::new(),
            records: vec![point(1, None), point(2, Some(0.9))],
        };
        let evals: Vec<_> = h.evaluations().map(|(r, a)| (r.step, a)).collect();
        assert_eq!(evals, vec![(2, 0.9)]);
    }
}
