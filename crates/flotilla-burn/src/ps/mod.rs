//! Parameter servers for a user's own burn model: a worker that pulls parameters and pushes
//! gradients from the user's loop ([`Worker`]), and the server loop a user program runs on its
//! server rank(s) with its own model and optimizer ([`serve`]).
//!
//! The job's ranks are `0..servers` servers then the workers, as in `flotilla train`'s flat
//! topology, and they speak its protocol (`flotilla-ps`: [`flotilla_ps::PsMessage`]s point to
//! point, each naming the parameter version it was computed from; pushes checked by
//! [`flotilla_ps::admit`] before they touch anything, their weight bounded by the batch size
//! ([`PsConfig::batch_size`]) and their weighted sum by `f32`'s range; a sync round's pushes
//! summed in worker order by [`flotilla_ps::Accumulator`], sample-weighted; an update whose
//! new parameters would not be finite refused). With several servers each owns a
//! contiguous run of whole parameter tensors, balanced by size ([`shards`]), steps the user's
//! optimizer on those tensors alone, and workers pull and push each its part; rank 0 gathers
//! the others' parts at the end, so [`serve`] returns the whole trained model there.
//!
//! - [`Aggregation::Sync`]: every round waits for one push from every worker, applies their
//!   sample-weighted mean with one optimizer step and sends the new version to all: a run equals
//!   one process training on the global batch.
//! - [`Aggregation::Async`]: one server applies each push on arrival, at the learning rate
//!   divided by `1 + staleness` (versions behind) unless `staleness_lr` is off, refusing pushes
//!   more than `max_staleness` behind; a lost worker is dropped and training goes on.

mod server;
mod worker;

use std::ops::Range;
use std::time::Duration;

use flotilla_engine::ParamLayout;

pub use server::{ServeStats, serve};
pub use worker::Worker;

/// How servers combine the workers' pushes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Aggregation {
    /// One push from every worker per round, averaged, one optimizer step.
    Sync,
    /// Each push applied on arrival (one server only).
    Async {
        /// Largest staleness accepted (versions behind); `None`: any.
        max_staleness: Option<u64>,
        /// Scale each update's learning rate by `1 / (1 + staleness)`.
        staleness_lr: bool,
    },
}

/// The layout of a parameter-server job, the same on every rank.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PsConfig {
    /// Server ranks (`0..servers`); the other ranks are workers.
    pub servers: usize,
    /// How the servers combine pushes.
    pub aggregation: Aggregation,
    /// Longest wait for any peer; the error names who was waited for.
    pub timeout: Duration,
    /// The workers' batch size: the most samples a push may claim ([`Worker::push`]'s
    /// `samples`, its weight in a round's mean). A push claiming more is refused, naming the
    /// worker.
    pub batch_size: u32,
}

impl Default for PsConfig {
    /// One sync server, a 60 s deadline, batches of up to 64 samples.
    fn default() -> Self {
        Self {
            servers: 1,
            aggregation: Aggregation::Sync,
            timeout: Duration::from_secs(60),
            batch_size: 64,
        }
    }
}

impl PsConfig {
    /// Checks the layout against a group of `size` ranks.
    fn check(&self, size: usize) -> crate::Result<()> {
        let why = if self.servers == 0 {
            Some("a parameter-server job needs at least one server".to_string())
        } else if self.servers >= size {
            Some(format!(
                "{} servers leave no worker among {size} ranks",
                self.servers
            ))
        } else if self.servers > 1 && self.aggregation != Aggregation::Sync {
            Some("asynchronous aggregation runs on one server (servers: 1)".to_string())
        } else {
            None
        };
        why.map_or(Ok(()), |w| Err(crate::DistError::Config(w)))
    }

    /// The worker ranks.
    fn workers(&self, size: usize) -> Vec<usize> {
        (self.servers..size).collect()
    }
}

/// One server's part of the parameters: tensors `params` (indices in flat order), whose values
/// are `values` of the flat buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shard {
    /// Parameter tensor indices.
    pub params: Range<usize>,
    /// Flat value range.
    pub values: Range<usize>,
}

/// `servers` contiguous runs of whole tensors of `layout`, each closing once it holds its
/// share of the values (a server may hold none when there are more servers than tensors).
pub fn shards(layout: &ParamLayout, servers: usize) -> Vec<Shard> {
    let mut out = Vec::with_capacity(servers);
    let (mut start, mut at) = (0usize, 0usize);
    for s in 0..servers {
        let target = layout.total * (s + 1) / servers.max(1);
        let mut end = start;
        while end < layout.params.len() && (s + 1 == servers || at < target) {
            at += layout.params[end].len;
            end += 1;
        }
        let from = layout.params.get(start).map_or(layout.total, |p| p.offset);
        out.push(Shard {
            params: start..end,
            values: from..at.max(from),
        });
        start = end;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::shards;
    use flotilla_engine::ParamLayout;

    fn layout(lens: &[usize]) -> ParamLayout {
        ParamLayout::of_lengths(lens)
    }

    #[test]
    fn shards_are_contiguous_whole_tensors_covering_everything() {
        let l = layout(&[4, 4, 4, 4]);
        let s = shards(&l, 2);
        assert_eq!((s[0].params.clone(), s[0].values.clone()), (0..2, 0..8));
        assert_eq!((s[1].params.clone(), s[1].values.clone()), (2..4, 8..16));
        let s = shards(&layout(&[10, 1, 1]), 2);
        assert_eq!((s[0].params.clone(), s[0].values.clone()), (0..1, 0..10));
        assert_eq!((s[1].params.clone(), s[1].values.clone()), (1..3, 10..12));
        let s = shards(&layout(&[5]), 3);
        assert_eq!(s[0].values, 0..5);
        assert!(s[1].values.is_empty() && s[2].params.is_empty());
        assert_eq!(shards(&layout(&[3, 3]), 1)[0].values, 0..6);
    }
}
