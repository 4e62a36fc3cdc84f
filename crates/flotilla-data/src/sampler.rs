//! Deterministic, rank-aware sampling of dataset indices (like PyTorch's
//! `DistributedSampler`).
//!
//! # Sharding rule
//!
//! For epoch `e`, every rank computes the same global permutation `perm` of
//! `0..len`, by a Fisher–Yates shuffle driven by `ChaCha8Rng::seed_from_u64(seed + e)`
//! (wrapping add). The permutation is then cut or extended to `total_size`:
//!
//! * `drop_last = true`: truncated to `floor(len / world_size) * world_size` (the last
//!   `len % world_size` shuffled indices are skipped this epoch);
//! * `drop_last = false`: padded to `ceil(len / world_size) * world_size` by wrapping
//!   around to the start of `perm` (so a few samples are seen twice this epoch).
//!
//! Rank `r` takes the **interleaved** shard `perm[r], perm[r + N], perm[r + 2N], ...`
//! (`N = world_size`). Shards are disjoint (up to the padding repeats), every rank gets
//! exactly `num_samples = total_size / N` indices, and hence the same number of steps.
//!
//! # Batches and the N-rank / 1-rank equivalence
//!
//! A rank cuts its shard into consecutive batches of `b` and drops a final partial
//! batch ([`DistributedSampler::steps_per_epoch`] is `num_samples / b`). With the
//! interleaved rule, rank `r`'s batch `k` is `perm[(k*b + j)*N + r]` for `j in 0..b`, so
//! the union over all ranks of batch `k` is exactly `perm[k*N*b .. (k+1)*N*b]`: batch `k`
//! of a 1-rank sampler with batch size `N*b` and the same seed. (Interleaving the rank
//! batches element by element even reproduces its order.) With `drop_last = true` both
//! samplers also have the same number of steps, `floor(len / (N*b))`; with
//! `drop_last = false` the equivalence holds for the first `floor(len / (N*b))` batches,
//! after which the N-rank sampler may still run batches containing wrapped-around padding.

use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

use crate::error::{DataError, Result};

/// Splits a dataset's indices into equal, disjoint, per-rank shards, reshuffled every
/// epoch from a seed shared by all ranks. See the [module docs](self) for the exact rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistributedSampler {
    len: usize,
    world_size: usize,
    rank: usize,
    seed: u64,
    drop_last: bool,
    shuffle: bool,
    /// Elastic: every global batch of this many samples cut among the ranks
    /// ([`DistributedSampler::with_global_batch`]).
    global_batch: Option<usize>,
    /// Samples a rank's share of a global batch is a multiple of
    /// ([`DistributedSampler::with_micro_batches`]).
    micro_batches: usize,
}

impl DistributedSampler {
    /// Creates the sampler of rank `rank` out of `world_size` over a dataset of `len`
    /// samples. Shuffling is on; see [`DistributedSampler::with_shuffle`].
    ///
    /// # Errors
    /// [`DataError::InvalidSampler`] if `world_size == 0` or `rank >= world_size`.
    pub fn new(
        len: usize,
        world_size: usize,
        rank: usize,
        seed: u64,
        drop_last: bool,
    ) -> Result<Self> {
        if world_size == 0 {
            return Err(DataError::InvalidSampler(
                "world_size must be at least 1".into(),
            ));
        }
        if rank >= world_size {
            return Err(DataError::InvalidSampler(format!(
                "rank {rank} out of range for world_size {world_size}"
            )));
        }
        Ok(DistributedSampler {
            len,
            world_size,
            rank,
            seed,
            drop_last,
            shuffle: true,
            global_batch: None,
            micro_batches: 1,
        })
    }

    /// Enables or disables shuffling. Without it the global order is `0..len` every
    /// epoch (useful for evaluation); sharding, padding and truncation are unchanged.
    #[must_use]
    pub fn with_shuffle(mut self, shuffle: bool) -> Self {
        self.shuffle = shuffle;
        self
    }

    /// Cuts each global batch of `global_batch` samples (the epoch's permutation in
    /// consecutive slices, the last partial one dropped) among the ranks, whatever their
    /// number: rank `r` of `N` takes the slice's samples `r, r + N, r + 2N, ...`, so the
    /// ranks' batches differ by at most one sample ([`DistributedSampler::rank_batch`]) and
    /// their union is the global batch, for every `N`. Where `N` divides `global_batch`
    /// this is exactly the unsliced rule with batches of `global_batch / N` (the module's
    /// equivalence). An elastic job's sampler: the members change, the global batches do not.
    #[must_use]
    pub fn with_global_batch(mut self, global_batch: usize) -> Self {
        self.global_batch = Some(global_batch.max(1));
        self
    }

    /// Cuts each rank's share of a global batch into `k` equal micro-batches (gradient
    /// accumulation): where the ranks' shares of the [`DistributedSampler::with_global_batch`]
    /// rule are not multiples of `k`, the global batch is cut in groups of `k` consecutive
    /// samples instead, rank `r` of `N` taking `ceil((global_batch / k - r) / N)` of them in
    /// one run after the lower ranks' (shares differing by `k` samples at most; `k` must
    /// divide the global batch). Elsewhere nothing changes.
    #[must_use]
    pub fn with_micro_batches(mut self, k: usize) -> Self {
        self.micro_batches = k.max(1);
        self
    }

    /// With a global batch ([`DistributedSampler::with_global_batch`]): this rank's share
    /// of each, `ceil((global_batch - rank) / world_size)` samples (0 for a rank beyond the
    /// global batch), or its groups' ([`DistributedSampler::with_micro_batches`]).
    pub fn rank_batch(&self) -> Option<usize> {
        let b = self.global_batch?;
        Some(match self.groups() {
            Some((_, len)) => len,
            None => b.saturating_sub(self.rank).div_ceil(self.world_size),
        })
    }

    /// Where the micro-batches' groups apply, this rank's run of a global batch: its first
    /// sample and its length. `None` where the interleaved rule gives every rank a multiple
    /// of the micro-batches.
    fn groups(&self) -> Option<(usize, usize)> {
        let (b, k, n) = (self.global_batch?, self.micro_batches, self.world_size);
        if k == 1 || b % (n * k) == 0 {
            return None;
        }
        let groups = b / k;
        let of = |r: usize| groups.saturating_sub(r).div_ceil(n);
        let before: usize = (0..self.rank).map(of).sum();
        Some((before * k, of(self.rank) * k))
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// This sampler's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The shared base seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Whether the tail is dropped (`true`) or padded by wrap-around (`false`).
    pub fn drop_last(&self) -> bool {
        self.drop_last
    }

    /// Whether indices are shuffled each epoch.
    pub fn shuffle(&self) -> bool {
        self.shuffle
    }

    /// Indices per rank per epoch (identical on every rank).
    pub fn num_samples(&self) -> usize {
        if self.drop_last {
            self.len / self.world_size
        } else {
            self.len.div_ceil(self.world_size)
        }
    }

    /// Indices per epoch over all ranks: `num_samples * world_size`.
    pub fn total_size(&self) -> usize {
        self.num_samples() * self.world_size
    }

    /// The global order of epoch `epoch` (a permutation of `0..len`), identical on every
    /// rank: shuffled with `ChaCha8Rng::seed_from_u64(seed.wrapping_add(epoch))`, or the
    /// identity if shuffling is off.
    pub fn permutation(&self, epoch: u64) -> Vec<usize> {
        let mut perm: Vec<usize> = (0..self.len).collect();
        if self.shuffle {
            let mut rng = ChaCha8Rng::seed_from_u64(self.seed.wrapping_add(epoch));
            perm.shuffle(&mut rng);
        }
        perm
    }

    /// This rank's indices for epoch `epoch`, in the order they should be visited:
    /// exactly [`num_samples`](Self::num_samples) of them (with a global batch: its share
    /// of each full global batch, [`DistributedSampler::with_global_batch`]).
    pub fn indices(&self, epoch: u64) -> Vec<usize> {
        let perm = self.permutation(epoch);
        if let Some(b) = self.global_batch {
            let steps = perm.len() / b;
            let slices = perm[..steps * b].chunks_exact(b);
            if let Some((first, len)) = self.groups() {
                return slices
                    .flat_map(|slice| &slice[first..first + len])
                    .copied()
                    .collect();
            }
            return slices
                .flat_map(|slice| slice.iter().skip(self.rank).step_by(self.world_size))
                .copied()
                .collect();
        }
        perm.iter()
            .copied()
            .cycle()
            .take(self.total_size())
            .skip(self.rank)
            .step_by(self.world_size)
            .collect()
    }

    /// Full batches per rank per epoch: `num_samples / batch_size`. A final partial
    /// batch is dropped, so every rank runs the same number of steps.
    ///
    /// # Panics
    /// If `batch_size == 0`.
    pub fn steps_per_epoch(&self, batch_size: usize) -> usize {
        assert!(batch_size > 0, "batch_size must be at least 1");
        if let Some(b) = self.global_batch {
            return self.len / b;
        }
        self.num_samples() / batch_size
    }

    /// This rank's batches for epoch `epoch`: [`indices`](Self::indices) cut into
    /// [`steps_per_epoch`](Self::steps_per_epoch) chunks of exactly `batch_size`.
    ///
    /// # Panics
    /// If `batch_size == 0`.
    pub fn batches(&self, epoch: u64, batch_size: usize) -> Vec<Vec<usize>> {
        assert!(batch_size > 0, "batch_size must be at least 1");
        self.indices(epoch)
            .chunks_exact(batch_size)
            .map(<[usize]>::to_vec)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    fn ranks(len: usize, n: usize, seed: u64, drop_last: bool) -> Vec<DistributedSampler> {
        (0..n)
            .map(|r| DistributedSampler::new(len, n, r, seed, drop_last).unwrap())
            .collect()
    }

    #[test]
    fn invalid_config_rejected() {
        assert!(matches!(
            DistributedSampler::new(10, 0, 0, 1, true),
            Err(DataError::InvalidSampler(_))
        ));
        let err = DistributedSampler::new(10, 2, 2, 1, true).unwrap_err();
        assert!(err.to_string().contains("rank 2"), "{err}");
    }

    #[test]
    fn drop_last_shards_disjoint_equal_and_truncated() {
        for (len, n) in [(103, 4), (100, 4), (7, 3), (60_000, 8), (2, 3)] {
            let samplers = ranks(len, n, 42, true);
            let shards: Vec<Vec<usize>> = samplers.iter().map(|s| s.indices(3)).collect();
            let per_rank = len / n;
            let mut seen = HashSet::new();
            for shard in &shards {
                assert_eq!(shard.len(), per_rank);
                for &i in shard {
                    assert!(i < len);
                    assert!(seen.insert(i), "index {i} in two shards");
                }
            }
            assert_eq!(seen.len(), per_rank * n);
        }
    }

    #[test]
    fn padded_shards_cover_everything_with_equal_lengths() {
        for (len, n) in [(103, 4), (100, 4), (7, 3), (2, 5)] {
            let samplers = ranks(len, n, 7, false);
            let shards: Vec<Vec<usize>> = samplers.iter().map(|s| s.indices(0)).collect();
            let per_rank = len.div_ceil(n);
            assert!(shards.iter().all(|s| s.len() == per_rank));
            let all: Vec<usize> = shards.concat();
            let distinct: HashSet<usize> = all.iter().copied().collect();
            assert_eq!(distinct, (0..len).collect(), "every sample seen");
            // Repeats come only from the padding.
            assert_eq!(all.len() - distinct.len(), per_rank * n - len);
        }
    }

    #[test]
    fn deterministic_and_epoch_dependent() {
        let a = DistributedSampler::new(1000, 4, 1, 9, true).unwrap();
        let b = DistributedSampler::new(1000, 4, 1, 9, true).unwrap();
        assert_eq!(a.indices(5), b.indices(5));
        assert_ne!(a.indices(5), a.indices(6));
        let c = DistributedSampler::new(1000, 4, 1, 10, true).unwrap();
        // Seeds are combined as seed + epoch (like PyTorch): (9, epoch 1) == (10, epoch 0).
        assert_eq!(a.indices(1), c.indices(0));
        assert_ne!(a.indices(0), c.indices(0));
        // Each epoch's global order is a permutation.
        let mut p = a.permutation(3);
        p.sort_unstable();
        assert_eq!(p, (0..1000).collect::<Vec<_>>());
    }

    #[test]
    fn golden_permutation_is_stable() {
        // Pins the shuffle so a dependency upgrade that changes it is noticed: runs
        // resumed across versions rely on the same epoch order.
        let s = DistributedSampler::new(10, 1, 0, 0, true).unwrap();
        assert_eq!(s.permutation(0), GOLDEN_SEED0_EPOCH0);
    }

    const GOLDEN_SEED0_EPOCH0: [usize; 10] = [2, 8, 6, 1, 9, 5, 7, 4, 0, 3];

    #[test]
    fn no_shuffle_is_identity_order() {
        let s = DistributedSampler::new(10, 3, 1, 0, false)
            .unwrap()
            .with_shuffle(false);
        assert_eq!(s.indices(4), vec![1, 4, 7, 0]);
    }

    #[test]
    fn steps_drop_partial_batch() {
        let s = DistributedSampler::new(103, 4, 0, 0, true).unwrap();
        assert_eq!(s.num_samples(), 25);
        assert_eq!(s.steps_per_epoch(8), 3);
        let batches = s.batches(0, 8);
        assert_eq!(batches.len(), 3);
        assert!(batches.iter().all(|b| b.len() == 8));
        let s = DistributedSampler::new(103, 4, 3, 0, false).unwrap();
        assert_eq!(s.num_samples(), 26);
        assert_eq!(s.steps_per_epoch(8), 3);
        assert_eq!(s.steps_per_epoch(26), 1);
        assert_eq!(s.steps_per_epoch(27), 0);
    }

    /// The union of the N ranks' batch k equals batch k of a 1-rank sampler with batch
    /// size N*b over the same seed, and interleaving reproduces its exact order.
    #[test]
    fn n_rank_batches_union_equals_one_rank_batch() {
        for &(len, n, b) in &[
            (1000, 4, 8),
            (1003, 3, 5),
            (60_000, 8, 32),
            (97, 2, 1),
            (50, 5, 10),
            (64, 1, 8),
        ] {
            for drop_last in [true, false] {
                for epoch in [0, 1, 17] {
                    let seed = 1234;
                    let single = DistributedSampler::new(len, 1, 0, seed, drop_last).unwrap();
                    let single_batches = single.batches(epoch, n * b);
                    let multi = ranks(len, n, seed, drop_last);
                    let multi_batches: Vec<Vec<Vec<usize>>> =
                        multi.iter().map(|s| s.batches(epoch, b)).collect();
                    let steps = multi[0].steps_per_epoch(b);
                    assert!(multi.iter().all(|s| s.steps_per_epoch(b) == steps));
                    if drop_last {
                        assert_eq!(steps, single.steps_per_epoch(n * b), "same step count");
                    }
                    let common = len / (n * b);
                    assert_eq!(single_batches.len(), common);
                    for k in 0..common {
                        let mut union: Vec<usize> =
                            multi_batches.iter().flat_map(|rb| rb[k].clone()).collect();
                        let interleaved: Vec<usize> = (0..b)
                            .flat_map(|j| multi_batches.iter().map(move |rb| rb[k][j]))
                            .collect();
                        assert_eq!(
                            interleaved, single_batches[k],
                            "order len={len} n={n} b={b} k={k}"
                        );
                        let mut want = single_batches[k].clone();
                        union.sort_unstable();
                        want.sort_unstable();
                        assert_eq!(union, want, "len={len} n={n} b={b} k={k}");
                    }
                }
            }
        }
    }

    /// A global batch cut among any number of ranks: where the number divides it, the
    /// batches of the unsliced rule; otherwise shares differing by one sample whose union
    /// is the slice of the permutation, each sample once per epoch.
    #[test]
    fn a_global_batch_is_cut_among_any_number_of_ranks() {
        let (len, seed, global) = (1000, 3, 96);
        for n in [1, 2, 4] {
            for r in 0..n {
                let plain = DistributedSampler::new(len, n, r, seed, true).unwrap();
                let sliced = plain.clone().with_global_batch(global);
                let b = global / n;
                assert_eq!(sliced.rank_batch(), Some(b));
                let steps = plain.steps_per_epoch(b);
                assert_eq!(sliced.steps_per_epoch(b), steps);
                assert_eq!(
                    sliced.indices(2),
                    plain.indices(2)[..steps * b],
                    "n {n} rank {r}"
                );
            }
        }
        for n in [3, 5, 7] {
            let ranks: Vec<DistributedSampler> = (0..n)
                .map(|r| {
                    DistributedSampler::new(len, n, r, seed, true)
                        .unwrap()
                        .with_global_batch(global)
                })
                .collect();
            let sizes: Vec<usize> = ranks.iter().map(|s| s.rank_batch().unwrap()).collect();
            assert_eq!(sizes.iter().sum::<usize>(), global);
            assert!(
                sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1,
                "{sizes:?}"
            );
            assert_eq!(ranks[0].steps_per_epoch(1), len / global);
            assert_each_global_batch_is_cut(&ranks, &sizes, 1, &format!("n {n}"));
        }
    }

    /// In epoch `epoch`, the ranks' batches of each step (`sizes` samples each) are together
    /// that step's global batch of the permutation: each sample once.
    fn assert_each_global_batch_is_cut(
        ranks: &[DistributedSampler],
        sizes: &[usize],
        epoch: u64,
        what: &str,
    ) {
        let global: usize = sizes.iter().sum();
        let perm = ranks[0].permutation(epoch);
        for step in 0..ranks[0].steps_per_epoch(1) {
            let mut union: Vec<usize> = ranks
                .iter()
                .zip(sizes)
                .flat_map(|(s, &c)| s.indices(epoch)[step * c..(step + 1) * c].to_vec())
                .collect();
            union.sort_unstable();
            let mut slice = perm[step * global..(step + 1) * global].to_vec();
            slice.sort_unstable();
            assert_eq!(union, slice, "{what} step {step}");
        }
    }

    /// With `k` micro-batches a rank: where the interleaved shares are multiples of `k`,
    /// they stand; otherwise runs of whole groups of `k`, differing by `k` samples at most,
    /// whose union is each global batch of the permutation, each sample once per epoch.
    #[test]
    fn shares_of_a_global_batch_are_whole_micro_batches() {
        let (len, seed, global) = (1000, 5, 96);
        for (n, k) in [(2, 4), (3, 4), (4, 8), (3, 8), (5, 4), (7, 2), (2, 2)] {
            let ranks: Vec<DistributedSampler> = (0..n)
                .map(|r| {
                    DistributedSampler::new(len, n, r, seed, true)
                        .unwrap()
                        .with_global_batch(global)
                        .with_micro_batches(k)
                })
                .collect();
            let sizes: Vec<usize> = ranks.iter().map(|s| s.rank_batch().unwrap()).collect();
            assert_eq!(sizes.iter().sum::<usize>(), global, "n {n} k {k}");
            assert!(sizes.iter().all(|c| c % k == 0), "n {n} k {k}: {sizes:?}");
            let (most, least) = (sizes.iter().max().unwrap(), sizes.iter().min().unwrap());
            assert!(most - least <= k, "n {n} k {k}: {sizes:?}");
            if global % (n * k) == 0 {
                let plain = ranks[1].clone().with_micro_batches(1);
                assert_eq!(ranks[1].indices(3), plain.indices(3), "n {n} k {k}");
            }
            assert_each_global_batch_is_cut(&ranks, &sizes, 2, &format!("n {n} k {k}"));
        }
    }
}
