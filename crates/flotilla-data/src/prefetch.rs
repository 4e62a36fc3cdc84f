//! A rank's batches gathered ahead on a background thread ([`Prefetcher`]).
//!
//! At the start of each epoch the thread asks the data set for exactly the samples this rank
//! visits in it ([`Samples::select`] of its [`DistributedSampler`] shard, in visiting
//! order: 1/N of the set), releases the previous epoch's, and gathers batch after batch
//! from that shard — batch `k` is its samples `k·b .. (k+1)·b`, so the batches are bitwise
//! those of gathering by index from the whole set. Up to [`Prefetcher::DEPTH`] batches wait
//! in a bounded channel while the step computes; the buffers the consumer is done with come
//! back to the thread, so a run allocates no batch buffer after the first few. The next
//! epoch's shard is loaded as soon as the last batch of the current one is queued, while
//! the consumer works through the queue.
//!
//! The thread only reads, copies and normalises (I/O and memory traffic); the model's
//! compute stays on the consumer's thread.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;

use crate::error::{DataError, Result};
use crate::sampler::DistributedSampler;
use crate::samples::Samples;

/// One batch gathered ahead: where it belongs and its flat buffers.
#[derive(Debug, Default)]
pub struct Filled {
    /// The 0-based epoch.
    pub epoch: u64,
    /// The batch's place in its epoch.
    pub step: usize,
    /// Inputs, `batch × values_per_sample`, row-major.
    pub inputs: Vec<f32>,
    /// Labels, `batch × labels_per_sample`.
    pub labels: Vec<i64>,
}

/// Buffers a consumer hands back for reuse.
type Spare = (Vec<f32>, Vec<i64>);

/// The consumer's end of the prefetch thread; see the [module docs](self). Dropping it
/// stops the thread (after the batch it is gathering) and joins it.
#[derive(Debug)]
pub struct Prefetcher {
    batches: Option<Receiver<Result<Filled>>>,
    spare: SyncSender<Spare>,
    thread: Option<JoinHandle<()>>,
    held: Arc<AtomicUsize>,
}

/// What the thread works from.
struct Plan {
    source: Arc<dyn Samples>,
    sampler: DistributedSampler,
    batch_size: usize,
    epoch: u64,
    step: usize,
}

impl Prefetcher {
    /// Batches gathered ahead of the consumer.
    pub const DEPTH: usize = 2;

    /// Starts the thread: batches of `batch_size` of `sampler`'s shard of `source`, from
    /// batch `step` of epoch `epoch` on (a resumed run's position), epoch after epoch.
    ///
    /// # Errors
    /// [`DataError::Prefetch`] if the thread cannot be started.
    pub fn start(
        source: Arc<dyn Samples>,
        sampler: DistributedSampler,
        batch_size: usize,
        (epoch, step): (u64, usize),
    ) -> Result<Self> {
        let (to_consumer, batches) = sync_channel(Self::DEPTH);
        let (spare, spares) = sync_channel(Self::DEPTH + 2);
        let held = Arc::new(AtomicUsize::new(0));
        let plan = Plan {
            source,
            sampler,
            batch_size: batch_size.max(1),
            epoch,
            step,
        };
        let shard_bytes = Arc::clone(&held);
        let thread = std::thread::Builder::new()
            .name(format!("data-prefetch-{}", plan.sampler.rank()))
            .spawn(move || plan.run(&to_consumer, &spares, &shard_bytes))
            .map_err(|e| DataError::Prefetch(format!("cannot start: {e}")))?;
        Ok(Prefetcher {
            batches: Some(batches),
            spare,
            thread: Some(thread),
            held,
        })
    }

    /// The next batch, waiting for it if the thread is behind. `done` are the buffers of
    /// the previous batch, for reuse (empty ones are fine).
    ///
    /// # Errors
    /// The thread's error (a failed read), or [`DataError::Prefetch`] if it ended.
    pub fn next(&mut self, done: (Vec<f32>, Vec<i64>)) -> Result<Filled> {
        // The thread may hold enough spares already: a full return channel drops them.
        let _ = self.spare.try_send(done);
        let batches = self
            .batches
            .as_ref()
            .ok_or_else(|| DataError::Prefetch("stopped".into()))?;
        batches
            .recv()
            .map_err(|_| DataError::Prefetch("the thread ended".into()))?
    }

    /// The bytes of sample data the thread's current shard holds
    /// ([`Samples::held_bytes`]; 0 between two epochs' shards).
    pub fn shard_bytes(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }
}

impl Drop for Prefetcher {
    fn drop(&mut self) {
        // Closing the channel makes the thread's next send fail, so it ends.
        drop(self.batches.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Plan {
    /// The thread's loop: one shard per epoch, its batches sent in order, until the
    /// consumer goes away or a read fails (the error is sent on).
    fn run(
        mut self,
        out: &SyncSender<Result<Filled>>,
        spares: &Receiver<Spare>,
        held: &AtomicUsize,
    ) {
        loop {
            if let Err(e) = self.epoch_batches(out, spares, held) {
                // A consumer gone away ends the thread too: it would not read the error.
                let _ = out.send(Err(e));
                return;
            }
            if self.step == usize::MAX {
                return;
            }
            self.epoch += 1;
            self.step = 0;
        }
    }

    /// Loads this epoch's shard (from `self.step` on) and sends its batches. Sets
    /// `self.step` to `usize::MAX` when the consumer has gone.
    fn epoch_batches(
        &mut self,
        out: &SyncSender<Result<Filled>>,
        spares: &Receiver<Spare>,
        held: &AtomicUsize,
    ) -> Result<()> {
        let b = self.batch_size;
        let steps = self.sampler.steps_per_epoch(b);
        let indices = self.sampler.indices(self.epoch);
        let wanted = indices.get(self.step * b..steps * b).unwrap_or(&[]);
        let shard = self.source.select(wanted)?;
        held.store(shard.held_bytes(), Ordering::Relaxed);
        drop(indices);
        let mut slots = Vec::with_capacity(b);
        for (k, step) in (self.step..steps).enumerate() {
            // A spare pair of the consumer's, or a new one while none came back yet.
            let (mut inputs, mut labels) = spares.try_recv().unwrap_or_default();
            slots.clear();
            slots.extend(k * b..(k + 1) * b);
            shard.fill(&slots, &mut inputs, &mut labels)?;
            let filled = Filled {
                epoch: self.epoch,
                step,
                inputs,
                labels,
            };
            if out.send(Ok(filled)).is_err() {
                self.step = usize::MAX;
                return Ok(());
            }
        }
        held.store(0, Ordering::Relaxed);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::idx::IMAGES_MAGIC;
    use crate::testutil::{idx_bytes, write_file};
    use crate::{ImageDataset, ImageFile, Normalization};

    /// 103 images of 2×3 with distinct pixels, in memory and as a file.
    fn sets(dir: &std::path::Path) -> (ImageDataset, ImageFile) {
        let n = 103u32;
        let pixels: Vec<u8> = (0..n * 6).map(|p| (p * 31 % 253) as u8).collect();
        let labels: Vec<u8> = (0..n).map(|i| (i * 7 % 10) as u8).collect();
        let path = write_file(
            dir,
            "images",
            &idx_bytes(IMAGES_MAGIC, &[n, 2, 3], &pixels),
            false,
        );
        let memory =
            ImageDataset::new(pixels, labels.clone(), 2, 3, Normalization::MNIST).expect("set");
        let file = ImageFile::open(&path, labels, Normalization::MNIST).expect("file");
        (memory, file)
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Every batch, over three epochs and from a resumed position, is bitwise the batch
    /// gathered by index from the whole set in memory (the path without prefetch).
    #[test]
    fn prefetched_shard_batches_are_bitwise_the_whole_sets() {
        let dir = tempfile::tempdir().expect("dir");
        let (memory, file) = sets(dir.path());
        let file: Arc<dyn Samples> = Arc::new(file);
        let (world, b) = (3, 5);
        for rank in 0..world {
            let sampler = DistributedSampler::new(103, world, rank, 9, true).expect("sampler");
            // 34 samples per rank: 6 batches of 5 per epoch.
            for start in [(0, 0), (1, 4)] {
                let mut feed =
                    Prefetcher::start(Arc::clone(&file), sampler.clone(), b, start).expect("feed");
                let mut done = Spare::default();
                for epoch in start.0..3 {
                    for (step, indices) in sampler.batches(epoch, b).iter().enumerate() {
                        if (epoch, step) < start {
                            continue;
                        }
                        let got = feed.next(done).expect("batch");
                        assert_eq!((got.epoch, got.step), (epoch, step));
                        let (mut x, mut y) = (Vec::new(), Vec::new());
                        crate::fill_batch(&memory, indices, &mut x, &mut y).expect("fill");
                        assert_eq!(bits(&got.inputs), bits(&x), "rank {rank} {epoch}/{step}");
                        assert_eq!(got.labels, y);
                        done = (got.inputs, got.labels);
                    }
                }
            }
        }
    }

    /// The shard a rank loads holds its samples of the epoch and nothing else: 1/N of the
    /// set's bytes.
    #[test]
    fn a_ranks_shard_holds_exactly_its_samples() {
        let dir = tempfile::tempdir().expect("dir");
        let (memory, file) = sets(dir.path());
        let sampler = DistributedSampler::new(103, 2, 1, 4, true).expect("sampler");
        let mine = sampler.indices(2);
        let shard = file.load(&mine).expect("shard");
        assert_eq!(shard.len(), 51);
        for (slot, &i) in mine.iter().enumerate() {
            assert_eq!(shard.image(slot), memory.image(i));
            assert_eq!(shard.label(slot), memory.label(i));
        }
        let held = Samples::held_bytes(&shard);
        assert_eq!(held, 51 * (6 + 1));
        assert_eq!(
            Samples::held_bytes(&file),
            103,
            "the file holds only its labels"
        );
        // The prefetch thread holds one such shard (of the batches it serves).
        let mut feed = Prefetcher::start(Arc::new(file), sampler, 10, (2, 0)).expect("feed");
        feed.next(Spare::default()).expect("batch");
        assert_eq!(feed.shard_bytes(), 50 * 7);
        assert!(feed.shard_bytes() * 2 <= Samples::held_bytes(&memory));
    }

    /// A failed read reaches the consumer as an error, not a hang.
    #[test]
    fn a_read_error_is_the_consumers() {
        let memory = ImageDataset::new(vec![0; 6], vec![1], 2, 3, Normalization::UNIT).expect("m");
        // A sampler over more samples than the set has: the shard cannot be selected.
        let sampler = DistributedSampler::new(10, 1, 0, 1, true).expect("sampler");
        let mut feed = Prefetcher::start(Arc::new(memory), sampler, 2, (0, 0)).expect("feed");
        assert!(matches!(
            feed.next(Spare::default()),
            Err(DataError::IndexOutOfRange { .. })
        ));
        assert!(matches!(
            feed.next(Spare::default()),
            Err(DataError::Prefetch(_))
        ));
    }
}
