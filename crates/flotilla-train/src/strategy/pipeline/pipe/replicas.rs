//! What a stage's replicas do together at the end of a batch: average the gradient
//! (all-reduced, or reduce-scattered under ZeRO-2), clip it by the global norm, step (the
//! stage's optimizer, a ZeRO shard's, or under ZeRO-3 the shard in place), and put the
//! stage's state together for a checkpoint or take a shard of a loaded one.

use std::ops::Range;
use std::time::Instant;

use flotilla_engine::{FlatOptimizerState, ShardRecut, WeightsPlan, WeightsReader, shard_pieces};
use flotilla_tcp::shard;

use super::Pipeline;
use crate::checkpoint::ZeroManifest;
use crate::error::Result;
use crate::model_file;
use crate::strategy::allreduce::clip;
use crate::strategy::pipeline::state::{OptimizerPart, StageOptimizer};
use crate::strategy::pipeline::zero;
use crate::strategy::pipeline::zero3::{GroupSink, ReplicaParams};

impl Pipeline {
    /// Averages the gradient over the replicas of this stage (when `data_parallel > 1`; under
    /// ZeRO-2 each replica keeps its shard of the average only), clips it by the global norm
    /// over every stage (when set; collective over the world), and applies one optimizer step.
    pub fn step(&mut self) -> Result<()> {
        if self.params.is_some() {
            return self.step_sharded();
        }
        let (owned, summed) = self.average()?;
        if let Some(max) = self.opts.clip_grad_norm {
            // Each rank's share is the squares of its replica's shard of its stage's gradient
            // (what ZeRO-2 leaves it), summed over the world in rank order: the same norm,
            // bit for bit, whether the average is whole on every replica or scattered.
            let grads = self.stage.grads_mut();
            let mine = clip::square_sum(&grads[owned]);
            let norm = clip::gathered_norm(mine, &*self.world, 0..self.world.size())?;
            clip::scale_to(&mut grads[summed], norm, max);
        }
        let started = Instant::now();
        match (&mut self.zero, &self.replicas) {
            (Some(zero), Some(group)) => zero.step(&mut *self.stage, &**group, self.opts.lr)?,
            _ => self.stage.step(self.opts.lr)?,
        }
        self.compute += started.elapsed();
        Ok(())
    }

    /// ZeRO-3's step: the shard's gradient (reduce-scattered as each group's backward ended)
    /// averaged and clipped as ZeRO-2's, and the shard stepped in place.
    fn step_sharded(&mut self) -> Result<()> {
        let (Some(params), Some(zero)) = (&mut self.params, &mut self.zero) else {
            return Err(self.usage("ZeRO-3 without its shards"));
        };
        let grad = params.averaged();
        if let Some(max) = self.opts.clip_grad_norm {
            let mine = clip::square_sum(grad);
            let norm = clip::gathered_norm(mine, &*self.world, 0..self.world.size())?;
            clip::scale_to(grad, norm, max);
        }
        let started = Instant::now();
        let (values, grad) = params.values_and_grad();
        zero.step_shard(values, grad, self.opts.lr)?;
        params.zero_grad();
        self.compute += started.elapsed();
        Ok(())
    }

    /// Gathers a ZeRO-3 stage's parameters into it (collective over the stage's replicas),
    /// for what needs the whole stage between steps (a checkpoint, saving the model, checking
    /// the replicas agree); the next forward releases them. Nothing without ZeRO-3.
    pub fn gather_stage(&mut self) -> Result<()> {
        match &mut self.params {
            Some(p) => p.materialize(&mut *self.stage),
            None => Ok(()),
        }
    }

    /// Averages the gradient over the replicas of this stage: all-reduced, or under ZeRO-2
    /// reduce-scattered (the same sums, bit for bit, in this replica's shard; the rest of the
    /// buffer unspecified: the sharded step reads its shard only). Returns the ranges of the
    /// gradient that hold this replica's shard of the average (among the replicas; the whole
    /// of it with one replica) and the average at all (the shard under ZeRO-2, else all).
    fn average(&mut self) -> Result<(Range<usize>, Range<usize>)> {
        let total = self.stage.layout().total;
        let Some(group) = &self.replicas else {
            return Ok((0..total, 0..total));
        };
        let _span = tracing::info_span!(target: "flotilla::pipeline", "allreduce").entered();
        let (d, scatter) = (group.size(), self.opts.zero >= 2);
        let owned = shard(total, d, group.rank());
        let grads = self.stage.grads_mut();
        if let Some(w) = self.share {
            grads.iter_mut().for_each(|g| *g *= w);
        }
        let summed = match scatter {
            true => {
                group.reduce_scatter_sum_f32(grads)?;
                owned.clone()
            }
            false => {
                group.all_reduce_sum(grads)?;
                0..total
            }
        };
        if self.share.is_none() {
            grads[summed.clone()]
                .iter_mut()
                .for_each(|g| *g /= d as f32);
        }
        Ok((owned, summed))
    }

    /// This stage's weights (safetensors bytes) and whole optimizer state on replica 0 (which
    /// with ZeRO gathers the replicas' shards of the state); `None` on the other replicas.
    /// Collective over the stage's replicas. Tests only: a checkpoint's parts are each
    /// rank's own (`state.rs`).
    #[cfg(test)]
    pub fn stage_state(&mut self) -> Result<Option<[Vec<u8>; 2]>> {
        self.gather_stage()?;
        let optimizer = match (&self.zero, &self.replicas) {
            (Some(zero), Some(group)) => {
                let groups = self.params.as_ref().map(ReplicaParams::group_ranges);
                zero.whole_state(&*self.stage, &**group, groups.as_deref())?
            }
            _ if self.replica != 0 => None,
            _ => Some(self.stage.optimizer_state()?),
        };
        match optimizer {
            Some(o) => Ok(Some([self.stage.weights_bytes()?, o])),
            None => Ok(None),
        }
    }

    /// Replaces this stage's weights and optimizer state with `parts`: the stage's
    /// safetensors weights and its whole optimizer state (with ZeRO, this replica keeps its
    /// shard of the state).
    pub fn load_stage_state(&mut self, parts: &[Vec<u8>; 2]) -> Result<()> {
        self.load_stage(&parts[0], StageOptimizer::Whole(&parts[1]))
    }

    /// Replaces this stage's weights with `weights` (safetensors bytes) and its optimizer
    /// state with `optimizer`'s (with ZeRO, this replica's shard of it).
    pub(in crate::strategy::pipeline) fn load_stage(
        &mut self,
        weights: &[u8],
        optimizer: StageOptimizer<'_>,
    ) -> Result<()> {
        if let Some(p) = &mut self.params {
            // A released stage loads into whole parameters, then keeps its shard again.
            self.stage
                .write_params(&vec![0.0; self.stage.layout().total])?;
            self.stage.load_weights_bytes(weights)?;
            p.take_shard(&mut *self.stage)?;
        } else {
            self.stage.load_weights_bytes(weights)?;
        }
        self.load_optimizer(optimizer)
    }

    /// Under ZeRO-3, [`Pipeline::load_stage`] from the stage's weights file at `path`
    /// without the whole stage: this replica's pieces read one tensor at a time, the running
    /// statistics whole.
    pub(in crate::strategy::pipeline) fn load_stage_file(
        &mut self,
        path: &std::path::Path,
        optimizer: StageOptimizer<'_>,
    ) -> Result<()> {
        let Some(p) = &mut self.params else {
            return Err(self.usage("reading a stage's shard without ZeRO-3"));
        };
        let reader = WeightsReader::open(path)?;
        let (weights, layout) = (self.stage.weights_plan()?, self.stage.layout().clone());
        let pieces = shard_pieces(&layout, &p.owned())?;
        p.load_values(model_file::shard_values(
            &reader, &weights, &layout, &pieces,
        )?)?;
        let buffers = model_file::buffer_values(&reader, &weights, &layout)?;
        self.stage.write_buffers(&buffers)?;
        self.load_optimizer(optimizer)
    }

    /// Loads `optimizer` into the stage's optimizer, or its shard's under ZeRO.
    fn load_optimizer(&mut self, optimizer: StageOptimizer<'_>) -> Result<()> {
        let layout = self.stage.layout();
        let recut = self.shard_recut()?;
        if let (Some(mut recut), Some(zero)) = (recut, self.zero.as_mut()) {
            // Under ZeRO: this replica's shard alone, cut out of what came.
            match optimizer {
                StageOptimizer::Own(bytes) => return zero.load_shard(bytes),
                StageOptimizer::Flat(_) => return Err(self.usage("a whole state under ZeRO")),
                StageOptimizer::Whole(bytes) => recut.read_bytes(None, bytes.to_vec())?,
                StageOptimizer::Shards(parts) => {
                    for (ranges, bytes) in parts {
                        recut.read_bytes(ranges, bytes.to_vec())?;
                    }
                }
            }
            return zero.load_shard(recut.finish()?);
        }
        let flat = match optimizer {
            StageOptimizer::Whole(bytes) => return Ok(self.stage.load_optimizer_state(bytes)?),
            StageOptimizer::Own(_) => return Err(self.usage("a shard without ZeRO")),
            StageOptimizer::Shards(parts) => FlatOptimizerState::gather(layout, &parts)?,
            StageOptimizer::Flat(flat) => flat,
        };
        Ok(self.stage.load_optimizer_state(&flat.whole(layout)?)?)
    }

    /// Whether this stage's replicas shard its parameters (ZeRO-3 among them).
    pub(in crate::strategy::pipeline) fn shards_params(&self) -> bool {
        self.params.is_some()
    }

    /// This replica's optimizer shard under ZeRO, to cut out of the state files of a
    /// checkpoint sharded otherwise (`None` without ZeRO).
    pub(in crate::strategy::pipeline) fn shard_recut(&self) -> Result<Option<ShardRecut>> {
        (self.zero.as_ref())
            .map(|z| z.recut(&*self.stage))
            .transpose()
    }

    /// This replica's shard of its stage's flat parameters under ZeRO (`None` without):
    /// what a re-cut of its optimizer state cuts for it.
    pub(in crate::strategy::pipeline) fn zero_owned(&self) -> Option<&[Range<usize>]> {
        self.zero.as_ref().map(|z| z.owned_ranges())
    }

    /// Whether this stage's replicas shard its optimizer state (ZeRO among them): each
    /// writes its own shard into a checkpoint.
    pub(in crate::strategy::pipeline) fn shards_optimizer(&self) -> bool {
        self.zero.is_some()
    }

    /// How this stage's replicas shard its optimizer state, as a checkpoint records it
    /// (`None` without ZeRO).
    pub(in crate::strategy::pipeline) fn zero_manifest(&self) -> Option<ZeroManifest> {
        let (group, _) = (self.replicas.as_ref()?, self.zero.as_ref()?);
        let groups = self.params.as_ref().map(ReplicaParams::group_ranges);
        let (total, d) = (self.stage.layout().total, group.size());
        let shards = (0..d)
            .map(|r| {
                let owned = zero::owned(total, groups.as_deref(), d, r);
                owned.iter().map(|r| [r.start, r.end]).collect()
            })
            .collect();
        Some(ZeroManifest {
            stage: self.opts.zero,
            world: d,
            shards,
        })
    }

    /// Whether this stage's replicas shard its optimizer state under ZeRO as `m` records
    /// (as many replicas, the same ranges each): this replica's own file of a checkpoint's
    /// optimizer state is then its state.
    pub(in crate::strategy::pipeline) fn holds_shard(&self, m: &ZeroManifest) -> bool {
        self.zero_manifest()
            .is_some_and(|mine| mine.world == m.world && mine.shards == m.shards)
    }

    /// Under ZeRO-3, the layout of this stage's weights file, from its structure alone (the
    /// parameters stay released): its replicas write it a share each as they gather its
    /// groups ([`Pipeline::gather_groups`]). `None` without ZeRO-3.
    pub(in crate::strategy::pipeline) fn sharded_weights_plan(
        &self,
    ) -> Result<Option<WeightsPlan>> {
        match &self.params {
            Some(_) => Ok(Some(self.stage.weights_plan()?)),
            None => Ok(None),
        }
    }

    /// Under ZeRO-3, gathers each of the stage's groups in turn (collective over its
    /// replicas) and hands `f` its parameters and values, one group in memory at a time; the
    /// outer result is the gathers', the inner `f`'s (every group gathered even after it
    /// failed).
    pub(in crate::strategy::pipeline) fn gather_groups(
        &mut self,
        f: &mut GroupSink<'_>,
    ) -> Result<Result<()>> {
        match &mut self.params {
            Some(p) => p.for_each_group(f),
            None => Err(self.usage("gathering the groups of a stage without ZeRO-3")),
        }
    }

    /// XXH3 of this stage's parameters in flat order (what `crate::eval::param_hash` of the
    /// whole stage gives); under ZeRO-3 gathered one group at a time (collective over the
    /// stage's replicas), never whole.
    pub fn param_hash(&mut self) -> Result<u64> {
        if self.params.is_none() {
            return crate::eval::param_hash(&*self.stage);
        }
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        self.gather_groups(&mut |_, values| {
            values.iter().for_each(|v| hasher.update(&v.to_le_bytes()));
            Ok(())
        })??;
        Ok(hasher.digest())
    }

    /// This stage's weights as safetensors bytes on replica 0 (a ZeRO-3 stage gathered
    /// first: collective over the replicas); `None` on the others.
    pub(in crate::strategy::pipeline) fn stage_weights(&mut self) -> Result<Option<Vec<u8>>> {
        self.gather_stage()?;
        match self.replica {
            0 => Ok(Some(self.stage.weights_bytes()?)),
            _ => Ok(None),
        }
    }

    /// This rank's part of its stage's optimizer state in a checkpoint: with ZeRO its shard
    /// (on every replica), else the whole state on replica 0.
    pub(in crate::strategy::pipeline) fn optimizer_part(&self) -> Result<OptimizerPart<'_>> {
        Ok(match &self.zero {
            Some(zero) => OptimizerPart::Shard(zero.optimizer()),
            None if self.replica == 0 => OptimizerPart::Whole(self.stage.optimizer_state()?),
            None => OptimizerPart::None,
        })
    }

    /// Bytes of optimizer state this rank holds: its stage's, or with ZeRO its shard's.
    pub fn optimizer_state_bytes(&self) -> Result<u64> {
        match &self.zero {
            Some(zero) => zero.state_bytes(),
            None => Ok(flotilla_engine::optimizer_state_bytes(
                &self.stage.optimizer_state()?,
            )?),
        }
    }
}
