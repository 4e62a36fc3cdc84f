//! ZeRO stage 3 (PyTorch FSDP's full sharding): besides the optimizer state and the averaged
//! gradient, each rank keeps only its shard of the **parameters** — the values of
//! [`super::owned_ranges`], one after the other in flat order, as its optimizer steps them. The
//! engine's model holds none between uses ([`Engine::release_params`]): a step runs
//! [`Engine::forward_backward_sharded`], which gathers each backward group's parameters (one
//! bucket's all-gather: the buckets are the engine's backward groups) before its forward and
//! again before its recomputed forward in backward, and hands its gradients to the
//! reduce-scatter of stage 2 (`scatter.rs`) as its backward ends. The next group's all-gather
//! starts in the background as soon as a group's own has ended ([`Zero::prefetch_group`],
//! `allreduce.prefetch`), so that it runs while the group computes (FSDP's forward and
//! backward prefetch); one wire buffer serves every all-gather, since a gather first waits for
//! the one in flight. The optimizer then steps the shard in place
//! ([`ShardOptimizer::step_shard`]): no all-gather after the step; the next step's forward
//! gathers the new values.
//!
//! The update is stage 2's (the same reduce-scatter, the same shard step) and the gathered
//! parameters are the values stage 2's all-gather writes, so stage 3 equals stage 2, and
//! zero 0 where stage 2 does, bit for bit.
//!
//! No rank holds the whole parameters at any point of a fresh run: the start keeps the
//! shard as the initial model is drawn one layer at a time (`initial.rs`); evaluation, the
//! parameters' hash and a checkpoint's `model.safetensors` go one bucket at a time
//! ([`Zero::evaluate`], [`Zero::param_hash`], [`Zero::save_sharded`]). What asks for the whole
//! model between steps ([`crate::strategy::Strategy::prepare_model`], a library user's) gets
//! every bucket gathered into the engine ([`Zero::materialize`]); the next step releases them
//! again. A resumed run starts released too, each rank loading its own shard of the
//! checkpoint (`shard_load.rs`).
//! Batch norm's running statistics are never sharded: every rank holds them whole, the peers
//! average them before an evaluation, the hash and a checkpoint (as zero 0 does), and the
//! first writer of `model.safetensors` writes them after the parameters.
//!
//! [`ShardOptimizer::step_shard`]: flotilla_engine::ShardOptimizer::step_shard

use std::ops::Range;
use std::path::{Path, PathBuf};

use flotilla_data::Samples;
use flotilla_engine::{BatchRef, Engine, EngineError, EvalStats, ModelState, ShardedPass};
use flotilla_tcp::shard;

use super::initial::{InitialShard, check_same_draw};
use super::{Zero, shard_files, wire_len};
use crate::bucket::{Bucket, BucketPlan};
use crate::checkpoint::{self, CheckpointState};
use crate::error::{Result, TrainError};
use crate::strategy::accumulate::GradSink;

impl Zero {
    /// Whether the parameters are sharded too (stage 3).
    pub fn shards_params(&self) -> bool {
        self.stage == 3
    }

    /// Stage 3's start from the shard this rank kept as its released engine drew the
    /// initial model (`initial.rs`): the engine holds no parameter already.
    pub fn keep_initial_shard(&mut self, shard: InitialShard) -> Result<()> {
        let (values, hash) = shard.finish()?;
        if values.len() != self.optimizer.len() {
            return Err(TrainError::Divergence(format!(
                "ZeRO-3: an initial shard of {} values for a shard of {}",
                values.len(),
                self.optimizer.len()
            )));
        }
        self.params = values;
        self.released = true;
        self.drawn = Some(hash);
        Ok(())
    }

    /// Whether this rank started without the whole model; then the start checks that every
    /// rank drew the same ([`Zero::check_initial`]) instead of broadcasting rank 0's.
    pub fn started_released(&self) -> bool {
        self.drawn.is_some()
    }

    /// The start's check that every rank drew the same initial model (collective).
    pub fn check_initial(&self) -> Result<()> {
        match self.drawn {
            Some(hash) => check_same_draw(&*self.comm, hash),
            None => Ok(()),
        }
    }

    /// Releases the parameters a whole-model operation gathered ([`Zero::materialize`]),
    /// before a step.
    pub fn release(&mut self, engine: &mut dyn Engine) -> Result<()> {
        if !self.released {
            engine.release_params()?;
            self.released = true;
        }
        Ok(())
    }

    /// Gathers every bucket's parameters into `engine` (collective), for a whole-model
    /// operation between steps; the next step releases them.
    pub fn materialize(&mut self, engine: &mut dyn Engine, plan: &BucketPlan) -> Result<()> {
        if !self.released {
            return Ok(());
        }
        let mut whole = vec![0.0; self.total];
        for (k, bucket) in plan.buckets.iter().enumerate() {
            self.gather_bucket(plan, k, &mut whole[bucket.start..bucket.end])?;
        }
        engine.write_params(&whole)?;
        self.released = false;
        Ok(())
    }

    /// Whether each group's all-gather starts while the group before it computes
    /// (`allreduce.prefetch`, on by default): the same values either way.
    pub fn set_prefetch(&mut self, on: bool) {
        self.prefetch = on;
    }

    /// The values of the parameters `params` (a backward group: one bucket's parameters)
    /// into `out`, from every rank's shard (collective): the all-gather
    /// [`Zero::prefetch_group`] started, or one now.
    pub fn gather_group(
        &mut self,
        plan: &BucketPlan,
        params: Range<usize>,
        out: &mut [f32],
    ) -> Result<()> {
        let k = bucket_of_group(plan, &params)?;
        self.gather_bucket(plan, k, out)
    }

    /// Starts the all-gather of the parameters `params` (the group the pass gathers next) in
    /// the background, into the wire buffer, when prefetching (collective: every rank
    /// starts the same ones in the same order).
    pub fn prefetch_group(&mut self, plan: &BucketPlan, params: Range<usize>) -> Result<()> {
        if !self.prefetch || self.prefetched.is_some() {
            return Ok(());
        }
        let k = bucket_of_group(plan, &params)?;
        let mut wire = std::mem::take(&mut self.wire);
        self.fill_wire(plan, k, &mut wire);
        self.prefetched = Some((k, self.comm.all_gather_bucket(wire, k)));
        Ok(())
    }

    /// Bucket `k`'s parameter values into `out` (its length): this rank's piece put in its
    /// place of the bucket's wire buffer, which one all-gather fills (the one started ahead
    /// when it was this bucket's).
    fn gather_bucket(&mut self, plan: &BucketPlan, k: usize, out: &mut [f32]) -> Result<()> {
        let len = plan.buckets[k].len();
        if out.len() != len {
            return Err(TrainError::Divergence(format!(
                "ZeRO-3: {} values asked of bucket {k}, which has {len}",
                out.len()
            )));
        }
        if let Some((j, pending)) = self.prefetched.take() {
            // Waited for whichever bucket it was (it holds its place in the group's order).
            let wire = pending.wait()?;
            if j == k {
                out.copy_from_slice(&wire[..len]);
                self.wire = wire;
                return Ok(());
            }
            self.wire = wire;
        }
        // No all-gather is in flight now: the one wire buffer is free for this one.
        let mut wire = std::mem::take(&mut self.wire);
        self.fill_wire(plan, k, &mut wire);
        let gathered = self.comm.all_gather_f32(&mut wire);
        out.copy_from_slice(&wire[..len]);
        self.wire = wire;
        Ok(gathered?)
    }

    /// `wire` as bucket `k`'s all-gather buffer: its length, this rank's piece in its place.
    /// Its capacity is the largest bucket's from its first use, so that it never grows
    /// after it.
    fn fill_wire(&self, plan: &BucketPlan, k: usize, wire: &mut Vec<f32>) {
        let slot = &self.slots[k];
        wire.clear();
        wire.reserve_exact(self.max_wire);
        wire.resize(wire_len(plan, k), 0.0);
        wire[slot.wire.clone()].copy_from_slice(&self.params[slot.at..slot.at + slot.wire.len()]);
    }

    /// Stage 3's step: the optimizer moves this rank's shard of the parameters by its shard
    /// of the averaged gradient at `lr`, in place; returns the global loss, which the rank
    /// whose shard holds the loss slot (its `slot_loss`) tells every rank.
    pub fn step_sharded(&mut self, slot_loss: f32, lr: f64, plan: &BucketPlan) -> Result<f32> {
        self.optimizer
            .step_shard(&mut self.params, &self.grad, lr)?;
        let last = plan.buckets.len().saturating_sub(1);
        let w = wire_len(plan, last);
        let (n, rank) = (self.comm.size(), self.comm.rank());
        let mut loss = [0.0f32];
        if shard(w, n, rank).contains(&(w - 1)) {
            loss[0] = slot_loss;
        }
        self.comm.all_reduce_sum(&mut loss)?;
        Ok(loss[0])
    }

    /// Evaluates `engine` on `test` split across the ranks, group by group through the
    /// shards ([`crate::eval::distributed_sharded`], `batch` samples at a time): no rank
    /// holds the whole parameters.
    pub fn evaluate(
        &mut self,
        engine: &mut dyn Engine,
        plan: &BucketPlan,
        test: &dyn Samples,
        batch: usize,
    ) -> Result<EvalStats> {
        self.release(engine)?;
        let comm = self.comm.clone();
        let mut pass = Gathering {
            zero: self,
            plan,
            ready: None,
            error: None,
        };
        let stats = crate::eval::distributed_sharded(engine, &*comm, test, batch, &mut pass);
        match pass.error.take() {
            Some(e) => Err(e),
            None => stats,
        }
    }

    /// Forward and backward of `batch` through the shards (collective: every group
    /// gathered), each parameter's gradient handed to `each` on this rank and none reduced:
    /// an accumulated step's earlier micro-batch (FSDP's `no_sync`). Returns its loss.
    pub fn local_pass(
        &mut self,
        engine: &mut dyn Engine,
        plan: &BucketPlan,
        batch: BatchRef<'_>,
        each: &mut GradSink<'_>,
    ) -> Result<f32> {
        self.release(engine)?;
        let mut pass = Gathering {
            zero: self,
            plan,
            ready: Some(each),
            error: None,
        };
        let loss = engine.forward_backward_sharded(batch, &mut pass);
        match (loss, pass.error.take()) {
            (_, Some(e)) => Err(e),
            (loss, None) => Ok(loss?),
        }
    }

    /// XXH3 of the whole parameters in flat order (as [`crate::eval::param_hash`] of the
    /// model would give), gathered one bucket at a time (collective).
    pub fn param_hash(&mut self, plan: &BucketPlan) -> Result<u64> {
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        self.gather_in_flat_order(plan, &mut |_, values| {
            for v in values {
                hasher.update(&v.to_le_bytes());
            }
            Ok(())
        })?;
        Ok(hasher.digest())
    }

    /// Stage 3's checkpoint (collective): the parameters are gathered one bucket at a time
    /// in flat order (every rank receives every bucket) and each rank that sees rank 0's
    /// checkpoint in progress writes its share of the tensors into `model.safetensors` at
    /// their places as they come ([`ModelState::weights_plan`]: the file
    /// [`ModelState::save_weights`] writes), rank 0 the first share; every rank writes its
    /// optimizer shard into that directory where it sees it (else over the wire to rank 0:
    /// `zero/shard_files.rs`). No rank holds the whole parameters. Returns the directory on
    /// rank 0.
    ///
    /// The shard of the averaged gradient is not read between steps (each step's
    /// reduce-scatter writes all of it): it is let go while the checkpoint holds burn's
    /// record of the optimizer shard, and comes back zeroed for the next step.
    pub fn save_sharded(
        &mut self,
        output: &Path,
        model: &dyn ModelState,
        plan: &BucketPlan,
        state: &CheckpointState,
    ) -> Result<Option<PathBuf>> {
        let grad = self.grad.len();
        self.grad = Vec::new();
        let saved = self.save_parts(output, model, plan, state);
        self.grad = vec![0.0; grad];
        saved
    }

    /// [`Zero::save_sharded`]'s files. The weights file is written by every rank that sees
    /// rank 0's checkpoint in progress at once, each its share of the tensors at their
    /// places (`WeightsPlan::write_at`) as the gathered buckets arrive, which every rank
    /// receives anyway; rank 0 makes the file at its whole length first.
    fn save_parts(
        &mut self,
        output: &Path,
        model: &dyn ModelState,
        plan: &BucketPlan,
        state: &CheckpointState,
    ) -> Result<Option<PathBuf>> {
        if self.comm.rank() != 0 {
            let offered = crate::checkpoint_offer::Offered::receive(&*self.comm)?;
            let target = offered.dir.as_ref().map(|d| d.join("model.safetensors"));
            // A failed part is reported with the shard (the gather went on for the others).
            let part = self.write_share(model, plan, (&offered.writers, target.as_deref()))?;
            let answer = (offered.dir, part);
            return shard_files::send_shard_to(&*self.comm, &self.optimizer, output, answer)
                .map(|()| None);
        }
        let state = CheckpointState {
            num_params: model.num_params(),
            zero: Some(self.manifest(plan)),
            ..state.clone()
        };
        checkpoint::save_with(output, &state, |tmp| {
            let path = tmp.join("model.safetensors");
            drop(model.weights_plan()?.create(&path)?);
            // The other ranks write their shards once the parameters are gathered.
            let offer = crate::checkpoint_offer::offer(&*self.comm, tmp)?;
            let writers = offer.writers(&*self.comm)?;
            self.write_share(model, plan, (&writers, Some(&path)))??;
            checkpoint::sync_part(&path)?;
            shard_files::collect(offer, &*self.comm, &self.optimizer)
        })
        .map(Some)
    }

    /// Gathers every bucket's parameters in flat order (collective) and writes this rank's
    /// share of the tensors into the weights file at `path` (made by rank 0 at its whole
    /// length), when this rank is one of `writers`: the tensors cut among them in flat order
    /// by bytes. The outer result is the gather's; the inner, this rank's writes' (every
    /// bucket is gathered even after a failed write).
    fn write_share(
        &mut self,
        model: &dyn ModelState,
        plan: &BucketPlan,
        (writers, path): (&[usize], Option<&Path>),
    ) -> Result<Result<()>> {
        let me = self.comm.rank();
        let (Some(path), Some(k)) = (path, writers.iter().position(|&r| r == me)) else {
            self.gather_in_flat_order(plan, &mut |_, _| Ok(()))?;
            return Ok(Ok(()));
        };
        let layout = model.layout().clone();
        let mine = layout.writer_share(writers.len(), k);
        let mut target = model
            .weights_plan()
            .map_err(TrainError::from)
            .and_then(|w| {
                let file = std::fs::OpenOptions::new()
                    .write(true)
                    .open(path)
                    .map_err(|e| TrainError::io(path, e))?;
                Ok((w, file))
            });
        self.gather_in_flat_order(plan, &mut |bucket, values| {
            if let Ok((weights, file)) = target.as_ref() {
                let written = layout.params[bucket.params.clone()]
                    .iter()
                    .enumerate()
                    .filter(|(j, _)| mine.contains(&(bucket.params.start + j)))
                    .try_for_each(|(j, p)| {
                        let at = p.offset - bucket.start;
                        let values = &values[at..at + p.len];
                        weights.write_at((file, path), bucket.params.start + j, values)
                    });
                if let Err(e) = written {
                    target = Err(e.into());
                }
            }
            Ok(())
        })?;
        if k == 0 {
            // The buffers (batch norm's statistics, the same on every rank once averaged)
            // are the first writer's, after the parameters.
            target = target.and_then(|(weights, file)| {
                crate::model_file::each_buffer_tensor(model, &mut |j, values| {
                    Ok(weights.write_at((&file, path), j, values)?)
                })?;
                Ok((weights, file))
            });
        }
        Ok(target.and_then(|(_, file)| file.sync_all().map_err(|e| TrainError::io(path, e))))
    }

    /// The whole model's parameters written to `path` by rank 0 alone (collective), as
    /// [`Zero::save_sharded`] writes a checkpoint's `model.safetensors` ([`Zero::write_share`]
    /// with one writer): gathered one bucket at a time, no rank holding them all. Returns the
    /// file on rank 0.
    pub fn save_model(
        &mut self,
        path: &Path,
        model: &dyn ModelState,
        plan: &BucketPlan,
    ) -> Result<Option<PathBuf>> {
        // Rank 0 the one writer: the path is the program's, which the others may not see.
        if self.comm.rank() != 0 {
            return self.write_share(model, plan, (&[0], None)).map(|_| None);
        }
        crate::model_file::write(path, |tmp| {
            drop(model.weights_plan()?.create(tmp)?);
            self.write_share(model, plan, (&[0], Some(tmp)))?
        })
        .map(Some)
    }

    /// Gathers every bucket's parameters in flat order, handing each to `f` (collective).
    fn gather_in_flat_order(
        &mut self,
        plan: &BucketPlan,
        f: &mut dyn FnMut(&Bucket, &[f32]) -> Result<()>,
    ) -> Result<()> {
        let mut order: Vec<usize> = (0..plan.buckets.len()).collect();
        order.sort_by_key(|&k| plan.buckets[k].start);
        let mut values = Vec::new();
        for k in order {
            values.clear();
            values.resize(plan.buckets[k].len(), 0.0f32);
            self.gather_bucket(plan, k, &mut values)?;
            f(&plan.buckets[k], &values)?;
        }
        Ok(())
    }

    /// Bytes of parameters this rank keeps between steps (its shard's).
    pub fn param_shard_bytes(&self) -> usize {
        self.params.capacity() * std::mem::size_of::<f32>()
    }
}

/// The bucket whose parameters are `params` (the buckets are the engine's backward groups).
fn bucket_of_group(plan: &BucketPlan, params: &Range<usize>) -> Result<usize> {
    plan.buckets
        .iter()
        .position(|b| b.params == *params)
        .ok_or_else(|| {
            TrainError::Divergence(format!(
                "ZeRO-3: parameters {params:?} are not one bucket's (the buckets are the \
                 engine's backward groups)"
            ))
        })
}

/// A [`ShardedPass`] that gathers groups from the shards and reduces nothing: an
/// evaluation's (no gradient) or an accumulated step's earlier micro-batch (gradients to
/// `ready`, on this rank).
struct Gathering<'a> {
    zero: &'a mut Zero,
    plan: &'a BucketPlan,
    ready: Option<&'a mut GradSink<'a>>,
    /// What stopped the pass (the engine returns only its text).
    error: Option<TrainError>,
}

impl ShardedPass for Gathering<'_> {
    fn gather(&mut self, params: Range<usize>, out: &mut [f32]) -> flotilla_engine::Result<()> {
        self.zero.gather_group(self.plan, params, out).map_err(|e| {
            let text = e.to_string();
            self.error = Some(e);
            EngineError::Callback(text)
        })
    }

    fn prefetch(&mut self, params: Range<usize>) -> flotilla_engine::Result<()> {
        self.zero.prefetch_group(self.plan, params).map_err(|e| {
            let text = e.to_string();
            self.error = Some(e);
            EngineError::Callback(text)
        })
    }

    fn ready(&mut self, param: usize, grad: &[f32]) -> flotilla_engine::Result<()> {
        match self.ready.as_mut() {
            Some(ready) => ready(param, grad),
            None => Err(EngineError::Callback(format!(
                "an evaluation got the gradient of parameter {param}"
            ))),
        }
    }
}
