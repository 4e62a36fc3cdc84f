//! What a server saw of its replaced workers: for each rejoin, the rank, the parameter
//! version the server held when it took the replacement back, and how many of the
//! replacement's pushes it accepted since — the replacement's contribution, as a number.
//! The root and local servers log one line per rejoin when they stop.

use std::fmt;

/// One rejoin of a replaced worker, as its server saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerRejoin {
    /// The worker's rank.
    pub rank: usize,
    /// Which rejoin of this rank it is (1 for its first replacement).
    pub nth: u32,
    /// The parameter version the server held when it took the replacement back.
    pub version: u64,
    /// Pushes of the replacement the server accepted since (until the rank's next rejoin).
    pub accepted: u64,
}

impl fmt::Display for WorkerRejoin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rejoin {} of rank {} at version {}: {} pushes accepted since",
            self.nth, self.rank, self.version, self.accepted
        )
    }
}

/// Every rejoin a server saw, in order, with the pushes it accepted from each replacement.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rejoins {
    list: Vec<WorkerRejoin>,
}

impl Rejoins {
    /// `rank` came back while the server held parameters of `version`.
    pub fn back(&mut self, rank: usize, version: u64) -> WorkerRejoin {
        let nth = self.list.iter().filter(|r| r.rank == rank).count() as u32 + 1;
        let r = WorkerRejoin {
            rank,
            nth,
            version,
            accepted: 0,
        };
        self.list.push(r);
        r
    }

    /// The server accepted a push of `rank`: it counts for the rank's latest rejoin (a rank
    /// that never rejoined is not counted).
    pub fn accepted(&mut self, rank: usize) {
        if let Some(r) = self.list.iter_mut().rev().find(|r| r.rank == rank) {
            r.accepted += 1;
        }
    }

    /// Every rejoin so far, in order.
    pub fn all(&self) -> &[WorkerRejoin] {
        &self.list
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pushes_count_for_the_latest_rejoin_of_their_rank_only() {
        let mut r = Rejoins::default();
        r.accepted(2);
        r.back(2, 1200);
        r.accepted(2);
        r.accepted(1);
        r.accepted(2);
        r.back(2, 3600);
        r.accepted(2);
        assert_eq!(
            r.all(),
            [
                WorkerRejoin {
                    rank: 2,
                    nth: 1,
                    version: 1200,
                    accepted: 2
                },
                WorkerRejoin {
                    rank: 2,
                    nth: 2,
                    version: 3600,
                    accepted: 1
                }
            ]
        );
        assert_eq!(
            r.all()[1].to_string(),
            "rejoin 2 of rank 2 at version 3600: 1 pushes accepted since"
        );
    }
}
