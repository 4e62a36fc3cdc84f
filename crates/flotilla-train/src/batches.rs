//! This rank's training batches, epoch after epoch: its interleaved shard of every epoch's
//! shared permutation ([`DistributedSampler`]), loaded alone at each epoch start and
//! gathered into flat buffers ahead of the step on a background thread
//! ([`flotilla_data::Prefetcher`]); the time a step waits for its batch is measured
//! (`flotilla_data_wait_seconds`, and the mean of each epoch for its line).

use std::sync::Arc;
use std::time::{Duration, Instant};

use flotilla_data::{DataError, DistributedSampler, Prefetcher, Samples};
use flotilla_engine::BatchRef;

use crate::error::{Result, TrainError};

/// Where a batch source stands: the epoch and the batches of it already taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Position {
    /// 0-based epoch.
    pub epoch: u32,
    /// Batches of that epoch already taken.
    pub step_in_epoch: u64,
}

impl Position {
    /// Where a source of `steps_per_epoch` batches per epoch stands after `steps` batches.
    pub fn after(steps: u64, steps_per_epoch: u64) -> Self {
        let per = steps_per_epoch.max(1);
        Position {
            epoch: u32::try_from(steps / per).unwrap_or(u32::MAX),
            step_in_epoch: steps % per,
        }
    }

    /// This position read as [`Position::after`] reads it: an epoch used up (its
    /// `steps_per_epoch` batches taken) is the next epoch's start.
    pub fn rolled_over(self, steps_per_epoch: u64) -> Self {
        if self.step_in_epoch >= steps_per_epoch {
            Position {
                epoch: self.epoch + 1,
                step_in_epoch: 0,
            }
        } else {
            self
        }
    }
}

/// Batches of shard `rank` of `world` over a training set. The prefetch thread starts with
/// the first batch drawn, so a strategy that draws none (a server) loads nothing.
pub struct Batches {
    train: Arc<dyn Samples>,
    sampler: DistributedSampler,
    batch_size: usize,
    /// The global batch this rank's is a share of ([`Batches::sliced`]).
    global: Option<usize>,
    steps_per_epoch: u64,
    at: Position,
    feed: Option<Prefetcher>,
    images: Vec<f32>,
    labels: Vec<i64>,
    /// Time waited for batches since [`Batches::take_wait`] last read it, and their count.
    waited: (Duration, u64),
    /// Time waited for every batch of the run, and their count.
    waited_run: (Duration, u64),
    /// The most sample bytes held at a batch ([`Batches::held_bytes`]).
    peak_held: usize,
}

impl Batches {
    /// Shard `rank` of `world` with `batch_size` samples per batch, shuffled per epoch from
    /// `seed`, starting at `start` (a resumed run's position).
    pub fn new(
        train: Arc<dyn Samples>,
        (world, rank): (usize, usize),
        seed: u64,
        batch_size: usize,
        start: Position,
    ) -> Result<Self> {
        let sampler = DistributedSampler::new(train.len(), world, rank, seed, true)?;
        Self::of(train, sampler, batch_size, start)
    }

    /// Shard `rank` of `world` of every global batch of `global_batch` samples (an elastic
    /// job's: [`DistributedSampler::with_global_batch`]), each rank's a whole number of
    /// `micro` micro-batches (gradient accumulation's:
    /// [`DistributedSampler::with_micro_batches`]): the ranks' batches differ by at most one
    /// sample (`micro` samples with accumulation), and the global batches are the same
    /// whatever `world` is.
    pub fn sliced(
        train: Arc<dyn Samples>,
        (world, rank): (usize, usize),
        seed: u64,
        (global_batch, micro): (usize, usize),
        start: Position,
    ) -> Result<Self> {
        let sampler = DistributedSampler::new(train.len(), world, rank, seed, true)?
            .with_global_batch(global_batch)
            .with_micro_batches(micro);
        let batch_size = sampler.rank_batch().unwrap_or(global_batch);
        if batch_size == 0 {
            return Err(TrainError::config(
                "config",
                format!("{world} ranks share a global batch of only {global_batch} samples"),
            ));
        }
        let mut b = Self::of(train, sampler, batch_size, start)?;
        b.global = Some(global_batch);
        Ok(b)
    }

    fn of(
        train: Arc<dyn Samples>,
        sampler: DistributedSampler,
        batch_size: usize,
        start: Position,
    ) -> Result<Self> {
        let world = sampler.world_size();
        let steps_per_epoch = sampler.steps_per_epoch(batch_size) as u64;
        if steps_per_epoch == 0 {
            return Err(TrainError::config(
                "config",
                format!(
                    "`batch_size` {batch_size} x {world} ranks is larger than the {} training samples",
                    train.len()
                ),
            ));
        }
        let mut b = Self {
            train,
            sampler,
            batch_size,
            global: None,
            steps_per_epoch,
            at: start,
            feed: None,
            images: Vec::new(),
            labels: Vec::new(),
            waited: (Duration::ZERO, 0),
            waited_run: (Duration::ZERO, 0),
            peak_held: 0,
        };
        b.roll_over();
        Ok(b)
    }

    /// Batches in one epoch.
    pub fn steps_per_epoch(&self) -> u64 {
        self.steps_per_epoch
    }

    /// Samples in one batch (images, or text windows: a window's labels are one sample's).
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// The samples of one step over every rank, when batches are shares of global batches
    /// ([`Batches::sliced`]): this rank's batch is its share of it.
    pub fn global_batch(&self) -> Option<usize> {
        self.global
    }

    /// Where the source stands: after the last batch of an epoch, that epoch with all its
    /// batches taken (the run's epoch line and checkpoint name it); the source moves to the
    /// next epoch when it draws ([`Batches::next_position`]).
    pub fn position(&self) -> Position {
        self.at
    }

    /// Where the next batch comes from: after the last batch of an epoch, the next epoch's
    /// start, as [`Position::after`] counts a position from steps (a joiner's, a resume's).
    pub fn next_position(&self) -> Position {
        self.at.rolled_over(self.steps_per_epoch)
    }

    /// Moves to the next epoch once this one is used up.
    fn roll_over(&mut self) {
        self.at = self.next_position();
    }

    /// The next batch, and the position it was taken at. The wait for it is the `data`
    /// span's time (strategies open it around this call) and `flotilla_data_wait_seconds`.
    pub fn next_batch(&mut self) -> Result<(Position, BatchRef<'_>)> {
        self.roll_over();
        let taken = self.at;
        let waiting = Instant::now();
        let feed = match &mut self.feed {
            Some(feed) => feed,
            None => self.feed.insert(Prefetcher::start(
                Arc::clone(&self.train),
                self.sampler.clone(),
                self.batch_size,
                (u64::from(taken.epoch), taken.step_in_epoch as usize),
            )?),
        };
        let done = (
            std::mem::take(&mut self.images),
            std::mem::take(&mut self.labels),
        );
        let filled = feed.next(done)?;
        let wait = waiting.elapsed();
        metrics::histogram!("flotilla_data_wait_seconds").record(wait.as_secs_f64());
        for (total, n) in [&mut self.waited, &mut self.waited_run] {
            *total += wait;
            *n += 1;
        }
        self.peak_held = self.peak_held.max(self.held_bytes());
        if (filled.epoch, filled.step as u64) != (u64::from(taken.epoch), taken.step_in_epoch) {
            return Err(DataError::Prefetch(format!(
                "gave batch {} of epoch {} for batch {} of epoch {}",
                filled.step, filled.epoch, taken.step_in_epoch, taken.epoch
            ))
            .into());
        }
        (self.images, self.labels) = (filled.inputs, filled.labels);
        self.at.step_in_epoch += 1;
        Ok((
            taken,
            BatchRef {
                images: &self.images,
                labels: &self.labels,
            },
        ))
    }

    /// Whether the last batch taken finished its epoch.
    pub fn epoch_done(&self) -> bool {
        self.at.step_in_epoch == self.steps_per_epoch
    }

    /// The mean wait for a batch since the last call (`None` if none was drawn), and
    /// starts the next count.
    pub fn take_wait(&mut self) -> Option<Duration> {
        mean(std::mem::replace(&mut self.waited, (Duration::ZERO, 0)))
    }

    /// The mean wait for a batch over the run (`None` if none was drawn).
    pub fn run_wait(&self) -> Option<Duration> {
        mean(self.waited_run)
    }

    /// The most bytes of sample data this rank held when it drew a batch
    /// ([`Batches::held_bytes`]).
    pub fn peak_held_bytes(&self) -> usize {
        self.peak_held
    }

    /// The bytes of sample data this rank holds: the set's own ([`Samples::held_bytes`]:
    /// labels, for a set read from its file) and the current epoch's shard.
    pub fn held_bytes(&self) -> usize {
        self.train.held_bytes() + self.feed.as_ref().map_or(0, Prefetcher::shard_bytes)
    }
}

/// The mean of `n` waits that took `total`.
fn mean((total, n): (Duration, u64)) -> Option<Duration> {
    (n > 0).then(|| total.div_f64(n as f64))
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_data::{ImageDataset, Normalization};

    #[test]
    fn position_after_steps() {
        assert_eq!(Position::after(0, 40), Position::default());
        let p = Position::after(85, 40);
        assert_eq!((p.epoch, p.step_in_epoch), (2, 5));
        let p = Position::after(80, 40);
        assert_eq!((p.epoch, p.step_in_epoch), (2, 0));
    }

    /// After an epoch's last batch the source still stands in that epoch, and its next
    /// batch comes from the next epoch's start: where [`Position::after`] puts that many
    /// steps (a joiner of an elastic job starts there; a `Learner` ends the epoch there).
    #[test]
    fn the_next_batch_after_an_epochs_last_comes_from_where_the_step_count_says() {
        let mut b =
            Batches::new(Arc::new(data(40)), (2, 0), 5, 4, Position::default()).expect("batches");
        for step in 1..=12u64 {
            b.next_batch().expect("batch");
            assert_eq!(
                b.next_position(),
                Position::after(step, 5),
                "after step {step}"
            );
        }
        let ended = Batches::new(Arc::new(data(40)), (2, 0), 5, 4, Position::after(4, 5));
        let mut ended = ended.expect("batches");
        ended.next_batch().expect("batch");
        assert!(ended.epoch_done());
        assert_eq!(
            ended.position(),
            Position {
                epoch: 0,
                step_in_epoch: 5
            }
        );
        assert_eq!(
            ended.next_position(),
            Position {
                epoch: 1,
                step_in_epoch: 0
            }
        );
    }

    fn data(n: usize) -> ImageDataset {
        ImageDataset::new(
            vec![0; n * 4],
            (0..n).map(|i| (i % 10) as u8).collect(),
            2,
            2,
            Normalization::UNIT,
        )
        .expect("data")
    }

    #[test]
    fn a_resumed_source_continues_with_the_same_batches() {
        let d = data(40);
        let mut straight =
            Batches::new(Arc::new(d.clone()), (2, 1), 5, 4, Position::default()).expect("b");
        assert_eq!(straight.steps_per_epoch(), 5);
        let mut labels = Vec::new();
        for _ in 0..13 {
            let (_, b) = straight.next_batch().expect("batch");
            labels.push(b.labels.to_vec());
        }
        // Resume after 7 batches (epoch 1, 2 in) and after exactly one epoch.
        for (skip, at) in [(7, (1, 2)), (5, (1, 0)), (5, (0, 5))] {
            let start = Position {
                epoch: at.0,
                step_in_epoch: at.1,
            };
            let mut resumed = Batches::new(Arc::new(d.clone()), (2, 1), 5, 4, start).expect("b");
            for (i, want) in labels.iter().enumerate().skip(skip).take(5) {
                let (pos, b) = resumed.next_batch().expect("batch");
                assert_eq!(b.labels, want.as_slice(), "batch {i} from {at:?}");
                assert_eq!(pos.epoch as usize, i / 5);
            }
        }
    }

    #[test]
    fn too_large_a_batch_is_an_error() {
        let d = data(10);
        assert!(Batches::new(Arc::new(d.clone()), (2, 0), 1, 8, Position::default()).is_err());
    }
}

#[cfg(test)]
mod text_tests {
    use std::path::Path;

    use flotilla_data::{DistributedSampler, TextSplits};

    use super::*;

    #[test]
    fn text_batches_are_each_ranks_windows_with_a_label_per_position() {
        // 100 bytes, 10 validate: 86 training windows of 4 tokens.
        let text: Vec<u8> = (0..100u8).collect();
        let s = TextSplits::from_bytes(text, 4, 0.1, Path::new("t")).expect("splits");
        let (world, batch) = (2, 3);
        let mut seen = Vec::new();
        for rank in 0..world {
            let mut b = Batches::new(
                Arc::new(s.train.clone()),
                (world, rank),
                7,
                batch,
                Position::default(),
            )
            .expect("batches");
            // 43 windows per rank: 14 batches of 3.
            assert_eq!((b.steps_per_epoch(), b.batch_size()), (14, 3));
            let sampler = DistributedSampler::new(86, world, rank, 7, true).expect("sampler");
            let want = sampler.batches(0, batch);
            for indices in want.iter().take(2) {
                let (_, got) = b.next_batch().expect("batch");
                assert_eq!((got.images.len(), got.labels.len()), (12, 12));
                // Window `i` starts at byte `i`: its tokens are i..i+4, its targets i+1..i+5.
                for (k, &i) in indices.iter().enumerate() {
                    let x: Vec<f32> = (i..i + 4).map(|t| t as f32).collect();
                    let y: Vec<i64> = (i + 1..i + 5).map(|t| t as i64).collect();
                    assert_eq!(&got.images[k * 4..k * 4 + 4], x.as_slice());
                    assert_eq!(&got.labels[k * 4..k * 4 + 4], y.as_slice());
                }
                seen.extend_from_slice(indices);
            }
        }
        // The two ranks' windows are disjoint.
        let n = seen.len();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), n);
    }
}
