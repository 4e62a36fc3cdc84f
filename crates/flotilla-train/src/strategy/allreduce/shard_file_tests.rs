//! Two in-memory ranks of the production [`SyncAllReduce`] that read only their shard of
//! each epoch from an IDX file, gathered ahead on the prefetch thread, against serial SGD on
//! the mean gradient of the batches gathered as they were before shards and prefetch: by
//! index from the whole set in memory (`fill_batch` over the sampler's batches), on one
//! thread. Bit for bit: a two-rank all-reduce is `(a + b) / 2` ([`mean2`]).

use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::thread;

use flotilla_data::{DistributedSampler, ImageDataset, ImageFile, fill_batch};
use flotilla_engine::BatchRef;

use super::SyncAllReduce;
use crate::batches::{Batches, Position};
use crate::strategy::Strategy;
use crate::testkit::{
    BATCH, DATA_SEED, Oracle, Rank, SgdRef, assert_bitwise, config, dataset, mean2, params,
    relative_error, sgd, world,
};

/// 6 batches per rank and epoch: 14 steps cross two epoch starts (two shards loaded).
const SAMPLES: usize = 48;
const STEPS: u64 = 14;
const LR: f64 = 0.3;
const MOMENTUM: f64 = 0.9;

/// `data`'s pixels as an IDX images file in `dir`.
fn idx_file(dir: &Path, data: &ImageDataset) -> std::path::PathBuf {
    let path = dir.join("train-images-idx3-ubyte");
    let mut bytes = 0x0803u32.to_be_bytes().to_vec();
    for d in [data.len(), data.rows(), data.cols()] {
        bytes.extend_from_slice(&u32::try_from(d).expect("dim").to_be_bytes());
    }
    bytes.extend_from_slice(data.pixels());
    std::fs::File::create(&path)
        .and_then(|mut f| f.write_all(&bytes))
        .expect("write");
    path
}

/// Every rank's parameters after `STEPS` steps, reading from `file`.
fn run(file: &Path) -> Vec<Vec<f32>> {
    let data = dataset(SAMPLES);
    let handles: Vec<_> = world(2)
        .into_iter()
        .map(|comm| {
            let file =
                ImageFile::open(file, data.labels().to_vec(), data.normalization()).expect("open");
            thread::spawn(move || {
                let mut c = config(sgd(LR, MOMENTUM));
                c.topology.world_size = 2;
                let topology = c.topology().expect("topology");
                let mut rank = Rank::new(comm.clone(), c, SAMPLES);
                let mut peer = rank.build(&topology, SyncAllReduce::build);
                let mut shard = Batches::new(
                    Arc::new(file),
                    (2, comm.rank()),
                    DATA_SEED,
                    BATCH,
                    Position::default(),
                )
                .expect("batches");
                peer.start(&mut rank.cx()).expect("start");
                for done in 0..STEPS {
                    peer.step(&mut rank.cx(), &mut shard, done).expect("step");
                }
                // Each rank held its labels and one epoch's shard: half the pixels.
                assert_eq!(shard.peak_held_bytes(), SAMPLES + (SAMPLES / 2) * (4 + 1));
                params(&mut peer)
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread"))
        .collect()
}

/// Serial SGD on the mean gradient of the two ranks' batches, each gathered by index from
/// the whole set in memory.
fn reference() -> Vec<f32> {
    let data = dataset(SAMPLES);
    let samplers: Vec<DistributedSampler> = (0..2)
        .map(|r| DistributedSampler::new(SAMPLES, 2, r, DATA_SEED, true).expect("sampler"))
        .collect();
    let per_epoch = samplers[0].steps_per_epoch(BATCH) as u64;
    let (mut oracle, mut w) = Oracle::new();
    let mut opt = SgdRef::new(MOMENTUM);
    for step in 0..STEPS {
        let (epoch, k) = (step / per_epoch, (step % per_epoch) as usize);
        let grads: Vec<Vec<f32>> = samplers
            .iter()
            .map(|s| {
                let (mut x, mut y) = (Vec::new(), Vec::new());
                fill_batch(&data, &s.batches(epoch, BATCH)[k], &mut x, &mut y).expect("fill");
                let batch = BatchRef {
                    images: &x,
                    labels: &y,
                };
                oracle.grad(&w, batch).0
            })
            .collect();
        opt.step(&mut w, &mean2(&grads[0], &grads[1]), LR);
    }
    w
}

#[test]
fn two_ranks_reading_their_shards_from_a_file_equal_serial_sgd_on_the_whole_set() {
    let dir = tempfile::tempdir().expect("dir");
    let file = idx_file(dir.path(), &dataset(SAMPLES));
    let want = reference();
    let (_, initial) = Oracle::new();
    assert!(
        relative_error(&initial, &want) > 1e-2,
        "the parameters moved"
    );
    for (r, got) in run(&file).iter().enumerate() {
        assert_bitwise(got, &want, &format!("rank {r}"));
    }
}
