use std::collections::BTreeMap;

use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::{Dataset, InMemDataset};
use burn::prelude::Device;
use flotilla_data::DistributedSampler;

use super::*;

/// A batch is its items (sample numbers), as they came.
#[derive(Clone)]
struct Items;

impl Batcher<usize, Vec<usize>> for Items {
    fn batch(&self, items: Vec<usize>, _device: &Device) -> Vec<usize> {
        items
    }
}

/// Samples `0..len`, sample `i` being the number `i`.
fn numbers(len: usize) -> InMemDataset<usize> {
    InMemDataset::new((0..len).collect())
}

fn shard(
    len: usize,
    rank: usize,
    world: usize,
    drop_last: bool,
) -> ShardedDataset<InMemDataset<usize>> {
    ShardedDataset::new(numbers(len), rank, world, 7, drop_last).expect("shard")
}

/// Every batch burn's loader gives for the shard's current epoch (`workers` threads).
fn batches(
    data: ShardedDataset<InMemDataset<usize>>,
    batch: usize,
    workers: usize,
) -> Vec<Vec<usize>> {
    let loader = DataLoaderBuilder::new(Items)
        .batch_size(batch)
        .num_workers(workers)
        .build(data);
    loader.iter().map(|b| b.expect("a batch")).collect()
}

/// With `drop_last`, the ranks' shards of an epoch are disjoint and cover the epoch's
/// permutation but its last `len % N`; padded, every sample comes, and only the first
/// `N - len % N` of the permutation come twice.
#[test]
fn every_sample_comes_once_per_epoch_across_the_ranks() {
    let (len, world) = (103, 4);
    for drop_last in [true, false] {
        for epoch in [0, 1, 5] {
            let mut seen: BTreeMap<usize, usize> = BTreeMap::new();
            for rank in 0..world {
                let s = shard(len, rank, world, drop_last);
                s.set_epoch(epoch);
                assert_eq!(s.len(), if drop_last { 25 } else { 26 });
                for i in 0..s.len() {
                    *seen.entry(s.get(i).expect("in range")).or_default() += 1;
                }
            }
            let perm = DistributedSampler::new(len, 1, 0, 7, true)
                .expect("one rank")
                .permutation(epoch);
            let want: BTreeMap<usize, usize> = match drop_last {
                true => perm[..100].iter().map(|&i| (i, 1)).collect(),
                false => perm
                    .iter()
                    .enumerate()
                    .map(|(k, &i)| (i, 1 + usize::from(k < 1)))
                    .collect(),
            };
            assert_eq!(seen, want, "drop_last {drop_last}, epoch {epoch}");
        }
    }
}

/// Through burn's loader with one worker (or none), N ranks at batch `b` give, batch by
/// batch, the samples 1 rank gives at batch `N × b`: the same epoch order, bitwise
/// reproducible; another epoch gives another order.
#[test]
fn n_ranks_at_batch_b_are_one_rank_at_batch_n_times_b() {
    let (len, world, b) = (96, 3, 4);
    for workers in [0, 1] {
        for epoch in [0, 2] {
            let one = shard(len, 0, 1, true);
            one.set_epoch(epoch);
            let whole = batches(one, world * b, workers);
            let ranks: Vec<Vec<Vec<usize>>> = (0..world)
                .map(|r| {
                    let s = shard(len, r, world, true);
                    s.set_epoch(epoch);
                    batches(s, b, workers)
                })
                .collect();
            assert_eq!(whole.len(), len / (world * b));
            for (k, global) in whole.iter().enumerate() {
                // Rank r's batch k interleaves into the global batch k element by element.
                let mut interleaved = Vec::new();
                for j in 0..b {
                    for rank in &ranks {
                        interleaved.push(rank[k][j]);
                    }
                }
                assert_eq!(
                    &interleaved, global,
                    "batch {k}, epoch {epoch}, {workers} workers"
                );
            }
        }
    }
    let (first, again, other) = (
        shard(len, 1, world, true),
        shard(len, 1, world, true),
        shard(len, 1, world, true),
    );
    other.set_epoch(1);
    assert_eq!(
        batches(first, b, 1),
        batches(again, b, 1),
        "the same epoch twice"
    );
    assert_ne!(
        batches(shard(len, 1, world, true), b, 1),
        batches(other, b, 1),
        "epochs 0 and 1"
    );
}

/// With several workers the batches come in the order the workers finish them, but every
/// sample of the rank's shard still comes once an epoch.
#[test]
fn with_several_workers_every_sample_of_the_shard_still_comes_once() {
    let (len, world) = (250, 2);
    for epoch in [0, 3] {
        let s = shard(len, 1, world, true);
        s.set_epoch(epoch);
        let mut want: Vec<usize> = s.indices().to_vec();
        let mut got: Vec<usize> = batches(s, 5, 3).into_iter().flatten().collect();
        want.sort_unstable();
        got.sort_unstable();
        assert_eq!(got, want, "epoch {epoch}");
    }
}

/// The epoch handle a strategy keeps sets the order of the loader built on the data set.
#[test]
fn the_epoch_handle_orders_the_loader_built_on_the_data_set() {
    let s = shard(64, 0, 2, true);
    let handle = s.epoch_handle();
    let loader = DataLoaderBuilder::new(Items).batch_size(8).build(s);
    let epoch = |e: u64| -> Vec<usize> {
        handle.set(e);
        loader.iter().flat_map(|b| b.expect("a batch")).collect()
    };
    let want = |e: u64| {
        DistributedSampler::new(64, 2, 0, 7, true)
            .expect("sampler")
            .indices(e)
    };
    assert_eq!(epoch(0), want(0));
    assert_eq!(epoch(4), want(4));
    assert_ne!(want(0), want(4));
}

/// A rank outside the world is refused, naming it; without shuffling the shard is
/// `r, r + N, ...` every epoch.
#[test]
fn a_bad_rank_is_refused_and_an_unshuffled_shard_strides_the_set() {
    let e = ShardedDataset::new(numbers(10), 2, 2, 0, true)
        .err()
        .expect("rank 2 of 2");
    assert!(e.to_string().contains("rank 2"), "{e}");
    let s = shard(10, 1, 3, true).without_shuffle();
    s.set_epoch(9);
    assert_eq!(s.indices().as_slice(), [1, 4, 7]);
}

/// A resumed run builds its loader afresh and sets the epoch it resumes in: with one worker it
/// gives that epoch's batches in the order the run that went through the earlier epochs gave.
#[test]
fn a_resumed_loader_gives_the_epochs_batches_in_the_same_order() {
    let s = shard(90, 1, 3, false);
    let handle = s.epoch_handle();
    let loader = DataLoaderBuilder::new(Items)
        .batch_size(7)
        .num_workers(1)
        .build(s);
    let mut went_through = Vec::new();
    for e in 0..4 {
        handle.set(e);
        went_through.push(
            loader
                .iter()
                .map(|b| b.expect("a batch"))
                .collect::<Vec<_>>(),
        );
    }
    let resumed = shard(90, 1, 3, false);
    resumed.set_epoch(3);
    assert_eq!(batches(resumed, 7, 1), went_through[3]);
    assert_ne!(went_through[2], went_through[3]);
}

/// A validation set cut by [`StridedDataset`]: every sample in exactly one rank's part, in
/// order, the parts differing by at most one sample.
#[test]
fn a_strided_validation_set_gives_every_sample_once() {
    let (len, world) = (103, 4);
    let mut seen = Vec::new();
    for rank in 0..world {
        let part = StridedDataset::new(numbers(len), rank, world);
        assert_eq!(part.len(), if rank < 3 { 26 } else { 25 }, "rank {rank}");
        let items: Vec<usize> = (0..part.len())
            .map(|i| part.get(i).expect("in the part"))
            .collect();
        assert!(
            items.windows(2).all(|w| w[1] == w[0] + world),
            "rank {rank}: {items:?}"
        );
        seen.extend(items);
    }
    seen.sort_unstable();
    assert_eq!(seen, (0..len).collect::<Vec<_>>());
    assert_eq!(StridedDataset::new(numbers(2), 3, 4).len(), 0);
}
