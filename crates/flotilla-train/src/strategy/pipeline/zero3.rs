//! ZeRO-3 among the replicas of a pipeline's stage (`allreduce.zero: 3` with `arch: pipeline`
//! and `data_parallel` above 1): each of a stage's `D` replicas keeps only its shard of each
//! of the stage's parameter groups ([`flotilla_engine::StageEngine::param_groups`]: a spec
//! stage's backward groups of at most `bucket_mb`, a program's stage module one group), with
//! that shard's gradient and optimizer state ([`super::zero::ReplicaShard`]).
//!
//! Each micro-batch's forward gathers every group just before it runs and releases it
//! after; its backward gathers each group again, recomputes it and hands its gradient here
//! ([`ReplicaParams`] as the engine's [`ShardedPass`]): once the group's last parameter's
//! gradient is in, the group's gradient is reduce-scattered among the replicas and this
//! replica adds its shard of the sum to its shard of the step's gradient. So no replica holds
//! its whole stage: at most one group's parameters and gradient beside its shards, the
//! groups' inputs of the micro-batches in flight, and one group's activations. The step
//! averages the shard, clips it (its squares summed over the world, as ZeRO-2's) and steps
//! the shard in place; the next forward gathers the new values. The next group's all-gather
//! starts in the background as soon as a group's own has ended (`allreduce.prefetch`, on by
//! default), so that it runs while the group computes.
//!
//! A step moves two all-gathers and one reduce-scatter of the stage per micro-batch (ZeRO-2:
//! one reduce-scatter and one all-gather a step); the sums over replicas come before the sums
//! over micro-batches, so with one micro-batch the parameters are zero 0's bit for bit, and
//! with more they agree to rounding. Between steps, what needs the whole stage (saving the
//! model, checking the replicas agree) gathers it into the stage
//! ([`ReplicaParams::materialize`]); the next forward releases it again. A checkpoint
//! gathers one group at a time instead ([`ReplicaParams::for_each_group`]), the stage's
//! replicas writing its weights a share each (`state.rs`). A spec's stage starts released,
//! each replica keeping its shard as the stage draws its initial values one layer at a time
//! ([`ReplicaParams::take_drawn`]); a resumed replica reads its pieces of the stage's
//! weights file one tensor at a time ([`ReplicaParams::load_values`]), from the checkpoint
//! where it sees it, else from a scratch copy spooled as rank 0 sends it (`restore.rs`), and
//! at another cut from the new stage's file it writes into a scratch directory (`recut.rs`),
//! or, where it does not see the checkpoint, that file as rank 0 re-cuts and sends it,
//! spooled; a program's stage module, built by the program, starts whole and keeps its shard
//! ([`ReplicaParams::take_shard`]).

use std::ops::Range;
use std::sync::Arc;

use flotilla_engine::{EngineError, ParamLayout, ShardedPass, StageEngine};
use flotilla_tcp::{PendingAllReduce, ProcessGroup, shard};

use crate::error::{Result, TrainError};

/// What takes each gathered group ([`ReplicaParams::for_each_group`]): its parameters
/// (indices into the layout) and values.
pub(super) type GroupSink<'a> = dyn FnMut(Range<usize>, &[f32]) -> Result<()> + 'a;

/// The flat range of `layout`'s parameters `params` (a group), empty for none.
pub(super) fn group_flat(layout: &ParamLayout, params: &Range<usize>) -> Range<usize> {
    match layout.params.get(params.clone()) {
        Some([first, .., last]) => first.offset..last.offset + last.len,
        Some([one]) => one.offset..one.offset + one.len,
        _ => 0..0,
    }
}

/// Replica `rank` of `replicas`' pieces of the groups whose flat ranges are `flats`: its
/// shard of each, as flat ranges of the stage, in the order of `flats`.
pub(super) fn group_pieces<'a>(
    flats: impl IntoIterator<Item = &'a Range<usize>>,
    replicas: usize,
    rank: usize,
) -> Vec<Range<usize>> {
    (flats.into_iter())
        .map(|flat| {
            let s = shard(flat.len(), replicas, rank);
            flat.start + s.start..flat.start + s.end
        })
        .collect()
}

/// This replica's shard of its stage's parameters and of the step's gradient.
pub(super) struct ReplicaParams {
    replicas: Arc<dyn ProcessGroup>,
    /// Each group's parameters (indices into the layout), and their flat values.
    groups: Vec<(Range<usize>, Range<usize>)>,
    /// Where each group's piece starts in `values` and `grad`.
    at: Vec<usize>,
    /// Each parameter's flat offset.
    offsets: Vec<usize>,
    /// This replica's values of its pieces, one after the other in flat order.
    values: Vec<f32>,
    /// Their gradient, summed over the replicas and the step's micro-batches.
    grad: Vec<f32>,
    /// The group whose gradient is coming in, and its values so far.
    incoming: Option<(usize, Vec<f32>)>,
    /// This replica's share of the step's samples (`None`: equal batches, the plain mean).
    share: Option<f32>,
    /// Whether the stage holds its parameters released (else whole: materialized).
    released: bool,
    /// What a collective met inside the engine's pass, with its peer named.
    error: Option<TrainError>,
    /// Whether the next group's all-gather starts while the current one computes
    /// (`allreduce.prefetch`).
    prefetch: bool,
    /// The all-gather started ahead, and its group.
    prefetched: Option<(usize, PendingAllReduce)>,
}

impl ReplicaParams {
    /// This replica's shard of `stage`'s parameter groups among `replicas`; the stage's
    /// values are taken by [`ReplicaParams::take_shard`].
    pub(super) fn new(
        stage: &dyn StageEngine,
        replicas: Arc<dyn ProcessGroup>,
        prefetch: bool,
    ) -> Self {
        let layout = stage.layout();
        let offsets: Vec<usize> = layout.params.iter().map(|p| p.offset).collect();
        let groups: Vec<_> = (stage.param_groups().into_iter())
            .map(|p| {
                let flat = group_flat(layout, &p);
                (p, flat)
            })
            .collect();
        let (d, r) = (replicas.size(), replicas.rank());
        let mut at = Vec::with_capacity(groups.len());
        let mut len = 0;
        for (_, flat) in &groups {
            at.push(len);
            len += shard(flat.len(), d, r).len();
        }
        Self {
            replicas,
            groups,
            at,
            offsets,
            values: Vec::new(),
            grad: vec![0.0; len],
            incoming: None,
            share: None,
            released: false,
            error: None,
            prefetch,
            prefetched: None,
        }
    }

    /// The flat ranges of the stage's groups (for [`super::zero::owned`]).
    pub(super) fn group_ranges(&self) -> Vec<Range<usize>> {
        self.groups.iter().map(|(_, flat)| flat.clone()).collect()
    }

    /// Keeps this replica's shard of `stage`'s parameters (whole on every replica: built
    /// from the seed or loaded) and releases them in the stage.
    pub(super) fn take_shard(&mut self, stage: &mut dyn StageEngine) -> Result<()> {
        let mut whole = vec![0.0; stage.layout().total];
        stage.read_params(&mut whole)?;
        self.values = Vec::with_capacity(self.grad.len());
        for piece in self.owned() {
            self.values.extend_from_slice(&whole[piece]);
        }
        drop(whole);
        stage.release_params()?;
        self.released = true;
        Ok(())
    }

    /// This replica's pieces of the stage's flat parameters: its shard of each group, in
    /// flat order (the layout of its values).
    pub(super) fn owned(&self) -> Vec<Range<usize>> {
        let (d, r) = (self.replicas.size(), self.replicas.rank());
        group_pieces(self.groups.iter().map(|(_, flat)| flat), d, r)
    }

    /// Keeps `values`, this replica's shard of the stage's parameters read from a checkpoint
    /// ([`ReplicaParams::owned`]'s pieces), in place of its shard; the stage stays released.
    pub(super) fn load_values(&mut self, values: Vec<f32>) -> Result<()> {
        if values.len() != self.grad.len() || !self.released {
            return Err(TrainError::Divergence(format!(
                "ZeRO-3: {} values loaded into a shard of {} (released: {})",
                values.len(),
                self.grad.len(),
                self.released
            )));
        }
        self.values = values;
        Ok(())
    }

    /// Keeps `values`, this replica's shard of `stage`'s initial parameters as the stage
    /// drew them released ([`super::initial_shard::StageShard`]: the pieces
    /// [`ReplicaParams::take_shard`] takes of a whole stage), and lets the stage's whole
    /// gradient buffer go.
    pub(super) fn take_drawn(
        &mut self,
        stage: &mut dyn StageEngine,
        values: Vec<f32>,
    ) -> Result<()> {
        if values.len() != self.grad.len() {
            return Err(TrainError::Divergence(format!(
                "ZeRO-3: a stage drew {} values of its shard, whose groups hold {}",
                values.len(),
                self.grad.len()
            )));
        }
        self.values = values;
        stage.release_params()?;
        self.released = true;
        Ok(())
    }

    /// Gathers every group into `stage` (collective over the replicas), for what needs the
    /// whole stage between steps; [`ReplicaParams::release`] lets it go.
    pub(super) fn materialize(&mut self, stage: &mut dyn StageEngine) -> Result<()> {
        if !self.released {
            return Ok(());
        }
        let mut whole = vec![0.0; stage.layout().total];
        for g in 0..self.groups.len() {
            let flat = self.groups[g].1.clone();
            self.gather_flat(g, &mut whole[flat])?;
        }
        stage.write_params(&whole)?;
        self.released = false;
        Ok(())
    }

    /// Gathers each group in turn, in flat order (collective over the replicas), and hands
    /// `f` its parameters (indices into the layout) and values, one group in memory at a
    /// time; the stage is left as it was. A failed `f` stops it only
    /// after every group is gathered, so the replicas' collectives stay in step: the outer
    /// result is the gathers', the inner `f`'s first error.
    pub(super) fn for_each_group(&mut self, f: &mut GroupSink<'_>) -> Result<Result<()>> {
        let mut first = Ok(());
        let mut values = Vec::new();
        let mut order: Vec<usize> = (0..self.groups.len()).collect();
        order.sort_by_key(|&g| self.groups[g].1.start);
        for g in order {
            let (params, flat) = self.groups[g].clone();
            values.clear();
            values.resize(flat.len(), 0.0);
            self.gather_flat(g, &mut values)?;
            if first.is_ok() {
                first = f(params, &values);
            }
        }
        Ok(first)
    }

    /// Releases a materialized stage's parameters (before a forward).
    pub(super) fn release(&mut self, stage: &mut dyn StageEngine) -> Result<()> {
        if !self.released {
            stage.release_params()?;
            self.released = true;
        }
        Ok(())
    }

    /// Scales each micro-batch's gradient by this replica's share of the step's samples
    /// before the replicas sum it (`None`: the sum is divided by the replicas at the step).
    pub(super) fn set_share(&mut self, share: Option<f32>) {
        self.share = share;
    }

    /// The step's gradient of this replica's pieces, averaged over the replicas (in place;
    /// the caller clips and steps it, then [`ReplicaParams::zero_grad`]).
    pub(super) fn averaged(&mut self) -> &mut [f32] {
        if self.share.is_none() {
            let d = self.replicas.size() as f32;
            self.grad.iter_mut().for_each(|g| *g /= d);
        }
        &mut self.grad
    }

    /// The shard's values and its gradient, for the optimizer's step.
    pub(super) fn values_and_grad(&mut self) -> (&mut [f32], &[f32]) {
        (&mut self.values, &self.grad)
    }

    /// Zeroes the step's gradient (after the step, or a failed batch).
    pub(super) fn zero_grad(&mut self) {
        self.grad.fill(0.0);
        self.incoming = None;
    }

    /// What the engine's pass met, as the error a collective gave (its peer named) when one
    /// did; else the engine's.
    pub(super) fn error_of(&mut self, e: flotilla_engine::EngineError) -> TrainError {
        self.error.take().unwrap_or(TrainError::Engine(e))
    }

    /// Group `g`'s values into `out` (their length) from every replica's piece: the
    /// all-gather started ahead for it, or one now (collective; a group without values
    /// gathers nothing, on every replica).
    fn gather_flat(&mut self, g: usize, out: &mut [f32]) -> Result<()> {
        if let Some((k, pending)) = self.prefetched.take() {
            // Waited for whichever group it was: it holds its place in the replicas' order.
            let wire = pending.wait()?;
            if k == g && wire.len() == out.len() {
                out.copy_from_slice(&wire);
                return Ok(());
            }
        }
        let s = shard(out.len(), self.replicas.size(), self.replicas.rank());
        let at = self.at[g];
        out[s.clone()].copy_from_slice(&self.values[at..at + s.len()]);
        if !out.is_empty() {
            self.replicas.all_gather_f32(out)?;
        }
        Ok(())
    }

    /// Starts group `params`'s all-gather in the background when prefetching and none is
    /// under way (collective: every replica starts the same ones in the same order).
    fn start_prefetch(&mut self, params: &Range<usize>) -> Result<()> {
        if !self.prefetch || self.prefetched.is_some() {
            return Ok(());
        }
        let g = self.group_of(params)?;
        let flat = self.groups[g].1.clone();
        if flat.is_empty() {
            return Ok(());
        }
        let s = shard(flat.len(), self.replicas.size(), self.replicas.rank());
        let mut wire = vec![0.0; flat.len()];
        let at = self.at[g];
        wire[s.clone()].copy_from_slice(&self.values[at..at + s.len()]);
        self.prefetched = Some((g, self.replicas.all_gather_bucket(wire, g)));
        Ok(())
    }

    /// The group of the parameters `params`.
    fn group_of(&self, params: &Range<usize>) -> Result<usize> {
        (self.groups.iter().position(|(p, _)| p == params)).ok_or_else(|| {
            TrainError::Divergence(format!(
                "ZeRO-3: parameters {params:?} are not one of the stage's groups"
            ))
        })
    }

    /// Takes parameter `param`'s gradient; once its group's last is in, the group's gradient
    /// is reduce-scattered and this replica's shard of the sum added to its own.
    fn take_grad(&mut self, param: usize, grad: &[f32]) -> Result<()> {
        let Some(g) = self.groups.iter().position(|(p, _)| p.contains(&param)) else {
            return Err(TrainError::Divergence(format!(
                "ZeRO-3: no group holds parameter {param}"
            )));
        };
        let (params, flat) = self.groups[g].clone();
        let mut buf = match self.incoming.take() {
            Some((k, buf)) if k == g => buf,
            _ => vec![0.0; flat.len()],
        };
        let at = self.offsets[param] - flat.start;
        buf[at..at + grad.len()].copy_from_slice(grad);
        if param + 1 < params.end {
            self.incoming = Some((g, buf));
            return Ok(());
        }
        if let Some(w) = self.share {
            buf.iter_mut().for_each(|v| *v *= w);
        }
        self.replicas.reduce_scatter_sum_f32(&mut buf)?;
        let s = shard(buf.len(), self.replicas.size(), self.replicas.rank());
        let mine = &mut self.grad[self.at[g]..self.at[g] + s.len()];
        for (a, v) in mine.iter_mut().zip(&buf[s]) {
            *a += v;
        }
        Ok(())
    }

    /// Keeps `e` for the caller and gives the engine its text.
    fn keep(&mut self, e: TrainError) -> EngineError {
        let text = e.to_string();
        self.error = Some(e);
        EngineError::Callback(text)
    }
}

impl ShardedPass for ReplicaParams {
    fn gather(&mut self, params: Range<usize>, out: &mut [f32]) -> flotilla_engine::Result<()> {
        let gathered = self
            .group_of(&params)
            .and_then(|g| self.gather_flat(g, out));
        gathered.map_err(|e| self.keep(e))
    }

    fn prefetch(&mut self, params: Range<usize>) -> flotilla_engine::Result<()> {
        self.start_prefetch(&params).map_err(|e| self.keep(e))
    }

    fn ready(&mut self, param: usize, grad: &[f32]) -> flotilla_engine::Result<()> {
        self.take_grad(param, grad).map_err(|e| self.keep(e))
    }
}
