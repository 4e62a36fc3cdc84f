//! burn's `Dataset` cut by rank ([`ShardedDataset`]): for burn's `DataLoader` what PyTorch's
//! `DistributedSampler` is for its `DataLoader`. At each epoch every rank draws the same
//! permutation of the whole data set from the seed and takes its interleaved share of it —
//! the rule a config job's data is sharded by ([`flotilla_data::DistributedSampler`]), so a
//! program on burn's loader and a config job see the same samples in the same order.
//!
//! The loader must not shuffle again (no `.shuffle(seed)` on its builder): the order is the
//! shard's. With `num_workers(0)` or `(1)` the batches are bitwise reproducible; with more
//! workers, every sample of the shard still comes once per epoch, in the order the workers
//! deliver them. The epoch is set at each epoch's start ([`ShardedDataset::set_epoch`], or
//! through an [`EpochHandle`] kept by whoever runs the epochs), as PyTorch's
//! `sampler.set_epoch(e)`; without it every epoch has epoch 0's order.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use burn::data::dataset::Dataset;
use flotilla_data::DistributedSampler;

use crate::error::Result;

/// The epoch a [`ShardedDataset`] orders its samples for, shared by its clones: set it at
/// each epoch's start.
#[derive(Debug, Clone, Default)]
pub struct EpochHandle(Arc<AtomicU64>);

impl EpochHandle {
    /// Orders the data set for `epoch` (0-based) from now on.
    pub fn set(&self, epoch: u64) {
        self.0.store(epoch, Ordering::SeqCst);
    }

    /// The epoch the data set is ordered for.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

/// One rank's shard of a burn `Dataset`, reshuffled per epoch from a seed every rank shares.
///
/// Rank `r` of `N` gets `perm[r], perm[r + N], ...` of epoch `e`'s permutation `perm` of the
/// whole set (`ChaCha8` seeded with `seed + e`). `drop_last = true` drops the last
/// `len % N` of `perm` (every rank has `len / N` samples); `false` pads by wrapping around
/// to the start of `perm` (every rank has `ceil(len / N)`, a few samples twice), as
/// PyTorch's sampler does. N ranks at batch `b` see, batch by batch, what 1 rank at batch
/// `N × b` sees.
pub struct ShardedDataset<D> {
    inner: D,
    sampler: DistributedSampler,
    epoch: EpochHandle,
    /// This rank's indices into `inner` for the epoch they were drawn for.
    order: Mutex<Option<(u64, Arc<Vec<usize>>)>>,
}

impl<D> ShardedDataset<D> {
    /// Shard `rank` of `world` of `inner`, shuffled per epoch from `seed`.
    ///
    /// # Errors
    /// [`crate::DistError::Data`] if `world` is 0 or `rank` is not below it.
    pub fn new<I, E>(
        inner: D,
        rank: usize,
        world: usize,
        seed: u64,
        drop_last: bool,
    ) -> Result<Self>
    where
        D: Dataset<I, E>,
        E: std::error::Error + Send + Sync + 'static,
    {
        let len = inner.len();
        let sampler = DistributedSampler::new(len, world, rank, seed, drop_last)?;
        Ok(ShardedDataset {
            inner,
            sampler,
            epoch: EpochHandle::default(),
            order: Mutex::new(None),
        })
    }

    /// The same shard without shuffling: epoch after epoch, rank `r` takes samples
    /// `r, r + N, ...` of the data set in its order.
    pub fn without_shuffle(mut self) -> Self {
        self.sampler = self.sampler.with_shuffle(false);
        self
    }

    /// Orders the shard for `epoch` (0-based) from now on.
    pub fn set_epoch(&self, epoch: u64) {
        self.epoch.set(epoch);
    }

    /// A handle that sets the epoch of this data set (and of the loader built on it).
    pub fn epoch_handle(&self) -> EpochHandle {
        self.epoch.clone()
    }

    /// This rank's indices into the whole data set, in the order of the current epoch.
    pub fn indices(&self) -> Arc<Vec<usize>> {
        let epoch = self.epoch.get();
        let mut cached = self.order.lock().unwrap_or_else(PoisonError::into_inner);
        match &*cached {
            Some((e, order)) if *e == epoch => Arc::clone(order),
            _ => {
                let order = Arc::new(self.sampler.indices(epoch));
                *cached = Some((epoch, Arc::clone(&order)));
                order
            }
        }
    }
}

impl<D, I, E> Dataset<I, E> for ShardedDataset<D>
where
    D: Dataset<I, E>,
    E: std::error::Error + Send + Sync + 'static,
{
    /// Sample `index` of this rank's shard in the current epoch's order. An index past the
    /// shard's end is passed on past the whole set's end, to fail as the set fails it.
    fn get(&self, index: usize) -> std::result::Result<I, E> {
        let at = self.indices().get(index).copied();
        self.inner.get(at.unwrap_or(self.inner.len()))
    }

    fn len(&self) -> usize {
        self.sampler.num_samples()
    }
}

/// Every `world`-th sample of a dataset from `rank` on (`rank`, `rank + world`, ...), in
/// order: a validation set cut by rank with every sample in exactly one part (the parts differ
/// by at most one sample; nothing is shuffled or repeated).
#[derive(Debug, Clone)]
pub struct StridedDataset<D> {
    inner: D,
    rank: usize,
    world: usize,
}

impl<D> StridedDataset<D> {
    /// Rank `rank`'s part of `inner` among `world` ranks.
    pub fn new(inner: D, rank: usize, world: usize) -> Self {
        Self {
            inner,
            rank,
            world: world.max(1),
        }
    }

    /// No sample of `inner` (a rank that validates nothing).
    pub fn none_of(inner: D) -> Self {
        Self {
            inner,
            rank: usize::MAX,
            world: 1,
        }
    }
}

impl<D, I, E> Dataset<I, E> for StridedDataset<D>
where
    D: Dataset<I, E>,
    E: std::error::Error + Send + Sync + 'static,
{
    fn get(&self, index: usize) -> std::result::Result<I, E> {
        let at = index
            .checked_mul(self.world)
            .and_then(|i| i.checked_add(self.rank))
            .filter(|_| index < self.len());
        self.inner.get(at.unwrap_or(self.inner.len()))
    }

    fn len(&self) -> usize {
        let n = self.inner.len();
        if self.rank >= n {
            0
        } else {
            (n - self.rank).div_ceil(self.world)
        }
    }
}
