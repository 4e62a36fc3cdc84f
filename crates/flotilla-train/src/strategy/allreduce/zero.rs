//! ZeRO stages 1 and 2 of sync data parallel (`allreduce.zero`): each rank keeps the
//! optimizer state of its shard of the parameters only, steps burn's optimizer on that
//! shard ([`ShardOptimizer`]) and all-gathers the parameters.
//!
//! The shard is cut bucket by bucket, as the ring cuts each bucket's buffer: rank `r` owns
//! [`shard`]`(wire_len, n, r)` of bucket `k`, where a bucket's wire buffer is its gradient
//! values plus, in the last bucket, the loss slot. Stage 2 reduce-scatters each bucket
//! instead of all-reducing it, so the rank's shard holds exactly the bits the ring
//! all-reduce would have left there, and the update is bitwise that of zero 0 (when the
//! all-reduce takes the ring: buckets above `comm.mid_all_reduce_kb`, or above
//! `comm.small_all_reduce_kb` on a world that is not a power of two; the doubling and
//! Rabenseifner's halving below them sum in other orders). After the update, one all-gather per bucket (in bucket order)
//! brings every rank the whole parameters; the last one carries the loss slot, so with
//! stage 2 every rank learns the global loss from the rank that owns it.
//!
//! Memory: a rank keeps, of the averaged gradient, only its shard's values (one after the
//! other in flat order, 1/N of the model: [`Zero::keep_shard`]), and one bucket-sized wire
//! buffer reused bucket after bucket — by stage 2's reduce-scatters (`scatter.rs`, which
//! waits for bucket *k*'s before bucket *k+1* is copied in) and by the all-gathers. Stage 1
//! keeps its buckets' buffers (all-reduced in place) besides. The parameters live in the
//! engine alone: a step reads them into a flat buffer, steps the shard in it, all-gathers
//! into it, writes it back and frees it (a second whole copy kept between steps cost a
//! model's size on every rank, measured by `tests/zero_memory.rs`). On one rank there is
//! nothing to shard and the strategy takes the unsharded path (`SyncAllReduce::build`), with
//! its bits and its memory.
//!
//! Checkpoints by shard: rank 0 writes `model.safetensors` and, received point to point
//! one rank at a time, every rank's `optimizer-shard-<r>.bpk`, with a [`ZeroManifest`]
//! (world, stage, each rank's flat ranges) in `state.json`; resume sends each rank its
//! file. Checkpoints re-shard: from one written on another number of ranks, or by an
//! unsharded run (`optimizer.bpk`), each rank's shard is cut by this run's ranges out of its
//! state files, reading only the tensors that meet it (`zero/shard_source.rs`,
//! [`flotilla_engine::recut_shard`]: every field of burn's optimizer records, Adam's step
//! counts included), never the whole state on one rank; an unsharded run resumes a ZeRO
//! checkpoint by putting it together ([`flotilla_engine::FlatOptimizerState`],
//! `checkpoint::load`). Stages 1 and 2 shard alike, so either
//! resumes the other's files as they are.
//!
//! In an elastic job every shard also lives on the rank before its owner and the state is
//! re-cut among a new generation's members (`zero/elastic.rs`). Stage 3 keeps only the
//! shard of the parameters too, gathered bucket by bucket in each pass (`zero/stage3.rs`).

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use flotilla_engine::{Engine, ModelState, OptimizerSpec, ParamLayout, ShardOptimizer};
use flotilla_tcp::{PendingAllReduce, ProcessGroup, shard};

use crate::bucket::BucketPlan;
use crate::checkpoint::{self, CheckpointState, ZeroManifest};
use crate::error::{Result, TrainError};
use crate::strategy::accumulate::MicroBatches;

pub(crate) mod by_param;
pub(super) mod elastic;
pub(super) mod initial;
mod shard_files;
mod shard_load;
mod shard_source;
mod stage3;

use elastic::{Cut, Redundancy};
use shard_files::SHARD_TAG;
use shard_source::ShardSource;

/// This rank's part of a ZeRO run.
pub struct Zero {
    stage: u8,
    comm: Arc<dyn ProcessGroup>,
    /// The buckets' flat ranges.
    buckets: Vec<Range<usize>>,
    /// Where each bucket's shard lies: in its wire buffer and in `grad`.
    slots: Vec<Slot>,
    optimizer: ShardOptimizer,
    /// The length of the flat parameters.
    total: usize,
    /// This rank's shard of the averaged gradient: the pieces of every bucket's shard one
    /// after the other in flat order, as [`ShardOptimizer::step`] takes them (1/N of the
    /// model).
    grad: Vec<f32>,
    /// The one bucket-sized wire buffer, reused bucket after bucket: stage 2's gradient
    /// buckets on their way through the reduce-scatter, then the all-gather's parameters.
    staging: Vec<f32>,
    /// The largest bucket's wire length (the staging buffer's capacity).
    max_wire: usize,
    /// Which shard `optimizer` holds: this rank's of its group, except between an elastic
    /// job's change of members and the start's re-cut (the old cut's).
    cut: Cut,
    /// An elastic job's second copy of a shard ([`Redundancy`]); `None`: a fixed-size job.
    elastic: Option<Redundancy>,
    /// Stage 3: this rank's shard of the parameters, its pieces one after the other in flat
    /// order as `grad` (empty before the start and at stages 1 and 2).
    params: Vec<f32>,
    /// Stage 3: the wire buffer of the parameters' all-gathers (one bucket's), while no
    /// all-gather started ahead has it: one is enough, since a gather first waits for the
    /// one in flight.
    wire: Vec<f32>,
    /// Stage 3: start each group's all-gather while the group before it computes
    /// (`allreduce.prefetch`).
    prefetch: bool,
    /// Stage 3: the bucket whose all-gather was started ahead, with the wire buffer.
    prefetched: Option<(usize, PendingAllReduce)>,
    /// Stage 3: whether the engine's parameters are released (they are gathered whole for a
    /// whole-model operation between steps).
    released: bool,
    /// Stage 3 started without the whole model: the hash of the initial model this rank
    /// drew, for the start's check (`initial.rs`).
    drawn: Option<u64>,
    /// Tests: the next step fails after its optimizer update, before its all-gather (a rank
    /// lost there).
    #[cfg(test)]
    pub(super) fail_before_gather: bool,
}

/// Where one bucket's shard lies.
struct Slot {
    /// Its values in the bucket's wire buffer (the loss slot left out).
    wire: Range<usize>,
    /// Where they start in the shard's gradient.
    at: usize,
}

/// Rank `rank` of `n`'s flat parameter ranges: its shard of each bucket's wire buffer
/// (the last bucket's loss slot left out).
pub fn owned_ranges(plan: &BucketPlan, n: usize, rank: usize) -> Vec<Range<usize>> {
    let last = plan.buckets.len().saturating_sub(1);
    plan.buckets
        .iter()
        .enumerate()
        .map(|(k, b)| {
            let s = shard(b.len() + usize::from(k == last), n, rank);
            b.start + s.start.min(b.len())..b.start + s.end.min(b.len())
        })
        .collect()
}

/// The wire length of `plan`'s bucket `k`: its values, and the loss slot in the last one.
pub fn wire_len(plan: &BucketPlan, k: usize) -> usize {
    plan.buckets[k].len() + usize::from(k + 1 == plan.buckets.len())
}

/// Each bucket's [`Slot`] for the flat ranges `owned` (one per bucket): the pieces'
/// gradient is in flat order, so a bucket's shard starts after every range below it.
fn slots(plan: &BucketPlan, owned: &[Range<usize>]) -> Vec<Slot> {
    owned
        .iter()
        .zip(&plan.buckets)
        .map(|(r, b)| Slot {
            wire: r.start - b.start..r.end - b.start,
            at: owned
                .iter()
                .filter(|o| o.start < r.start)
                .map(|o| o.len())
                .sum(),
        })
        .collect()
}

impl Zero {
    /// Stage `stage` (1, 2 or 3) over `comm` for a model of `layout` cut into `plan`'s buckets,
    /// with the optimizer of `spec` on the named device.
    pub fn new(
        stage: u8,
        comm: Arc<dyn ProcessGroup>,
        plan: &BucketPlan,
        layout: &ParamLayout,
        spec: &OptimizerSpec,
        device: &str,
    ) -> Result<Self> {
        let owned = owned_ranges(plan, comm.size(), comm.rank());
        let optimizer = ShardOptimizer::new(spec, layout, &owned, device)?;
        let max_wire = (0..plan.buckets.len())
            .map(|k| wire_len(plan, k))
            .max()
            .unwrap_or(0);
        Ok(Self {
            stage,
            buckets: plan.buckets.iter().map(|b| b.start..b.end).collect(),
            slots: slots(plan, &owned),
            grad: vec![0.0; optimizer.len()],
            optimizer,
            total: layout.total,
            staging: Vec::with_capacity(max_wire),
            max_wire,
            cut: Cut {
                world: comm.size(),
                index: comm.rank(),
            },
            elastic: None,
            params: Vec::new(),
            wire: Vec::new(),
            prefetch: true,
            prefetched: None,
            released: false,
            drawn: None,
            #[cfg(test)]
            fail_before_gather: false,
            comm,
        })
    }

    /// Moves this rank's shard of the optimizer state into files under `base`
    /// (`allreduce.offload`, [`ShardOptimizer::offload_to`]).
    pub fn offload_optimizer(&mut self, base: &std::path::Path) -> Result<()> {
        Ok(self.optimizer.offload_to(base)?)
    }

    /// The directory this rank's optimizer state is in, when offloaded.
    pub fn offloaded_to(&self) -> Option<&std::path::Path> {
        self.optimizer.offloaded_to()
    }

    /// The staging buffer, to fill with a bucket's gradient (stage 2); give it back with
    /// [`Zero::return_staging`]. A new one if the last step lost it (a failed collective).
    pub fn take_staging(&mut self) -> Vec<f32> {
        match std::mem::take(&mut self.staging) {
            v if v.capacity() >= self.max_wire => v,
            _ => Vec::with_capacity(self.max_wire),
        }
    }

    /// Gives back the buffer of [`Zero::take_staging`].
    pub fn return_staging(&mut self, buffer: Vec<f32>) {
        self.staging = buffer;
    }

    /// Keeps this rank's shard of bucket `k`'s summed wire buffer, scaled by `scale` (1/N),
    /// as its gradient, as `micro` says (written, or added to the earlier micro-batches'
    /// reductions: [`MicroBatches::keep`]); the rest of `summed` is not read.
    pub fn keep_shard(&mut self, k: usize, summed: &[f32], scale: f32, micro: &MicroBatches) {
        let slot = &self.slots[k];
        let dst = &mut self.grad[slot.at..slot.at + slot.wire.len()];
        micro.keep(dst, &summed[slot.wire.clone()], scale);
    }

    /// This rank's shard of the averaged gradient (its owned ranges, in flat order), as
    /// [`Zero::keep_shard`] left it: what its optimizer step applies.
    pub fn grad_mut(&mut self) -> &mut [f32] {
        &mut self.grad
    }

    /// Bytes of gradient this rank keeps for its optimizer step (its shard's: 1/N).
    pub fn gradient_bytes(&self) -> usize {
        self.grad.capacity() * std::mem::size_of::<f32>()
    }

    /// Bytes of its wire buffers (one bucket's; stage 3's parameter all-gathers have one
    /// more, which the all-gather prefetched takes in turn).
    pub fn staging_bytes(&self) -> usize {
        let values = self.staging.capacity() + self.wire.capacity();
        values * std::mem::size_of::<f32>()
    }

    /// Whether buckets are reduce-scattered (stage 2) rather than all-reduced.
    pub fn scatters(&self) -> bool {
        self.stage >= 2
    }

    /// One sharded step: burn's optimizer moves this rank's shard of the parameters by its
    /// shard of the averaged gradient (kept by [`Zero::keep_shard`]) at `lr`, the buckets'
    /// parameters are all-gathered through the staging buffer into `engine`, and the loss
    /// slot's value as the rank owning it gave it (`loss` on that rank) is returned.
    pub fn step(&mut self, engine: &mut dyn Engine, loss: f32, lr: f64) -> Result<f32> {
        let mut params = vec![0.0; self.total];
        engine.read_params(&mut params)?;
        self.begin_step();
        self.optimizer.step(&mut params, &self.grad, lr)?;
        self.step_spare(&mut params, lr)?;
        #[cfg(test)]
        if self.fail_before_gather {
            return Err(TrainError::Divergence("lost before the all-gather".into()));
        }
        engine.drop_grads();
        let last = self.buckets.len().saturating_sub(1);
        let mut global_loss = loss;
        let mut wire = self.take_staging();
        for (k, bucket) in self.buckets.iter().enumerate() {
            let len = bucket.len();
            wire.clear();
            wire.extend_from_slice(&params[bucket.clone()]);
            if k == last {
                wire.push(loss);
            }
            self.comm.all_gather_f32(&mut wire)?;
            params[bucket.clone()].copy_from_slice(&wire[..len]);
            if k == last {
                global_loss = wire[len];
            }
        }
        self.staging = wire;
        engine.write_params(&params)?;
        self.finish_step();
        Ok(global_loss)
    }

    /// Bytes of optimizer state this rank holds (its shard's momenta or moments, and in an
    /// elastic job its spare's).
    pub fn state_bytes(&self) -> Result<u64> {
        let spare = match &self.elastic {
            Some(e) => e.spare_bytes()?,
            None => 0,
        };
        Ok(self.optimizer.state_bytes()? + spare)
    }

    /// The manifest of this run's shards (every rank's flat ranges).
    fn manifest(&self, plan: &BucketPlan) -> ZeroManifest {
        let n = self.comm.size();
        ZeroManifest {
            stage: self.stage,
            world: n,
            shards: (0..n)
                .map(|r| {
                    owned_ranges(plan, n, r)
                        .into_iter()
                        .map(|x| [x.start, x.end])
                        .collect()
                })
                .collect(),
        }
    }

    /// Writes a checkpoint (collective): rank 0 writes `model`'s weights, and every rank its
    /// optimizer shard into rank 0's checkpoint directory where it sees it (else over the
    /// wire to rank 0: `zero/shard_files.rs`); returns the directory on rank 0.
    pub fn save(
        &self,
        output: &Path,
        model: &dyn ModelState,
        plan: &BucketPlan,
        state: &CheckpointState,
    ) -> Result<Option<PathBuf>> {
        if self.comm.rank() != 0 {
            shard_files::send_shard(&*self.comm, &self.optimizer, output)?;
            return Ok(None);
        }
        let state = CheckpointState {
            num_params: model.num_params(),
            zero: Some(self.manifest(plan)),
            ..state.clone()
        };
        checkpoint::save_with(output, &state, |tmp| {
            let offer = crate::checkpoint_offer::offer(&*self.comm, tmp)?;
            let weights = tmp.join("model.safetensors");
            model.save_weights(&weights)?;
            shard_files::collect(offer, &*self.comm, &self.optimizer)
        })
        .map(Some)
    }

    /// Rank 0's check of checkpoint `dir` for a resume under ZeRO-3 ([`Zero::load_released`]
    /// loads it): its state, refused when it holds another number of parameters than `model`.
    pub fn check_checkpoint(&self, dir: &Path, model: &dyn ModelState) -> Result<CheckpointState> {
        let state = checkpoint::read_state(dir)?;
        if state.num_params != model.num_params() {
            return Err(TrainError::Checkpoint {
                path: dir.to_path_buf(),
                message: format!(
                    "holds {} parameters ({}) but the model has {}",
                    state.num_params,
                    state.model,
                    model.num_params()
                ),
            });
        }
        Ok(state)
    }

    /// Rank 0's part of a resume from `dir`: loads the weights into `model` and returns the
    /// state and where every rank's optimizer shard comes from: the checkpoint's files as
    /// they are when it is sharded as this run, else cut for each rank out of its state
    /// files (another world size, an unsharded run's `optimizer.bpk`).
    pub(crate) fn read(
        &self,
        dir: &Path,
        model: &mut dyn ModelState,
        plan: &BucketPlan,
    ) -> Result<(CheckpointState, ShardSource)> {
        let state = self.check_checkpoint(dir, &*model)?;
        let want = self.manifest(plan);
        let same = state.zero.as_ref().is_some_and(|z| z.shards == want.shards);
        let source = ShardSource::new(dir, &state, same)?;
        model.load_weights(&dir.join("model.safetensors"))?;
        Ok((state, source))
    }

    /// Every rank's part of a resume: rank 0 reads each rank's optimizer shard from `source`
    /// (from [`Zero::read`]; `None` on the others, and everywhere for a fresh start) and
    /// sends it, one rank at a time; each loads its own. `resumed` says (on every rank)
    /// whether there is a checkpoint.
    pub(crate) fn restore_shards(
        &mut self,
        source: Option<ShardSource>,
        (layout, plan): (&ParamLayout, &BucketPlan),
        resumed: bool,
    ) -> Result<()> {
        if !resumed {
            return Ok(());
        }
        let n = self.comm.size();
        let mine = match source {
            Some(source) if self.comm.rank() == 0 => {
                for r in 1..n {
                    let bytes = source.shard(r, layout, &owned_ranges(plan, n, r))?;
                    self.comm.send_large(r, SHARD_TAG, &bytes)?;
                }
                source.shard(0, layout, &owned_ranges(plan, n, 0))?
            }
            None if self.comm.rank() > 0 => {
                let deadline = Instant::now() + self.comm.timeout();
                self.comm.recv_large(0, SHARD_TAG, deadline)?
            }
            _ => {
                return Err(TrainError::config(
                    "resume",
                    "rank 0 alone has the checkpoint",
                ));
            }
        };
        self.optimizer.load_state(mine)?;
        Ok(())
    }
}
