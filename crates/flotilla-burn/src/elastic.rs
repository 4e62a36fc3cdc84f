//! An elastic job for a program's own loop (`flotilla launch -n MIN:MAX -- PROGRAM`), as
//! Horovod's `hvd.elastic.run` gives a Python loop: the program's state ([`TrainState`]: its
//! model, optimizer, step and bytes of its own) is committed after each step
//! ([`ElasticRun::commit`]); when a member is lost, the survivors go back to their last
//! commit, join the next generation of the job (the launcher's lighthouse keeps the
//! membership, [`flotilla_train::elastic`]) and take the state of its rank 0 (the member
//! that committed the most steps); a process that joins (a replacement, a scale-up) takes
//! it the same way before its first step. The training closure then runs again with the
//! new members ([`ElasticRun::changes`] counts the changes; what the closure does before its
//! loop is the membership callback: cut the data anew, rescale a learning rate).
//!
//! The same program runs in a job of fixed size (`-n N`): [`run`] then calls the closure
//! once and a commit costs nothing.

use burn::module::Module;
use burn::optim::ModuleOptimizer;
use flotilla_engine::{ParamLayout, any_module};
use flotilla_group::ProcessGroup;
use flotilla_train::elastic::{Elastic, survivable, survivable_comm};
use std::sync::Arc;

use crate::data_parallel::DataParallel;
use crate::error::{DistError, Result};

/// The most bytes of its own a program's state may carry ([`TrainState::extra`]).
const EXTRA_BOUND: usize = 64 << 20;

/// What an elastic job keeps of a program's run, and hands to a process that joins it.
#[derive(Clone)]
pub struct TrainState<M> {
    /// The model.
    pub model: M,
    /// Its optimizer (moments, step counts).
    pub optimizer: ModuleOptimizer,
    /// Steps taken: where the data and schedule stand.
    pub step: u64,
    /// Anything else of the program's (an RNG's state, a scheduler's), as bytes.
    pub extra: Vec<u8>,
}

impl<M: Module> TrainState<M> {
    /// A state at step 0 with no bytes of its own.
    pub fn new(model: M, optimizer: ModuleOptimizer) -> Self {
        Self {
            model,
            optimizer,
            step: 0,
            extra: Vec::new(),
        }
    }
}

/// A program's run inside the job's current members: its state and the data parallelism
/// among them (fields, so that `r.dp.average(grads, &r.state.model)` borrows both).
pub struct ElasticRun<M> {
    /// The state, the same on every member after each commit.
    pub state: TrainState<M>,
    /// Gradient averaging among the current members.
    pub dp: DataParallel,
    committed: Option<TrainState<M>>,
    membership: Option<Elastic>,
    changes: u32,
}

impl<M: Module> ElasticRun<M> {
    /// After each step: keeps the state as it is now (what a lost member's loss rolls back
    /// to) and asks the members whether the membership changes; if it does, every member
    /// gets [`DistError::MembershipChanged`] after the same step — return it (`?`) and
    /// [`run`] goes on in the next generation. Collective in an elastic job; in a fixed one
    /// it does nothing.
    pub fn commit(&mut self) -> Result<()> {
        let Some(e) = &self.membership else {
            return Ok(());
        };
        self.committed = Some(self.state.clone());
        let mut flag = [if e.changing() { 1.0 } else { 0.0 }];
        self.dp.group().all_reduce_sum(&mut flag)?;
        if flag[0] > 0.0 {
            return Err(DistError::MembershipChanged);
        }
        Ok(())
    }

    /// How many times the members changed so far (0 in the first generation).
    pub fn changes(&self) -> u32 {
        self.changes
    }

    /// The current generation's number and its members' slots by rank (`None` in a job of
    /// fixed size).
    pub fn generation(&self) -> Option<(u64, &[u64])> {
        let g = &self.membership.as_ref()?.generation;
        Some((g.number, &g.slots))
    }
}

/// Trains `state` with `train` in the job this process was started in, elastic or not
/// (see the module). `train` runs in every generation the process is a member of, until it
/// returns `Ok` — the run's end: its state and the last members' data parallelism are
/// returned, for collectives after training (an evaluation, a save) — or an error that is
/// not a lost member's (a lost member rolls back to the last commit and trains on with the
/// others).
pub fn run<M: Module>(
    state: TrainState<M>,
    mut train: impl FnMut(&mut ElasticRun<M>) -> Result<()>,
) -> Result<ElasticRun<M>> {
    let config = flotilla_train::program::settings()?;
    if config.topology.min_world_size.is_none() {
        let group =
            flotilla_train::program::join(&config, flotilla_train::program::launcher_rank()?)?;
        let (dp, state) = take_state(group, state, config.bucket_bytes())?;
        let mut r = ElasticRun {
            state,
            dp,
            committed: None,
            membership: None,
            changes: 0,
        };
        train(&mut r)?;
        return Ok(r);
    }
    let (group, membership) = Elastic::join(&config, config.shared_hash(None))?;
    let mut run = Generations {
        membership: Some(membership),
        committed: state,
        changes: 0,
        bucket_bytes: config.bucket_bytes(),
    };
    run.train(group, &mut train)
}

/// An elastic process between its generations: its membership (lent to the run during
/// one) and its last commit.
struct Generations<M> {
    membership: Option<Elastic>,
    committed: TrainState<M>,
    changes: u32,
    /// The job's fusion bucket size (`comm.bucket_mb`).
    bucket_bytes: usize,
}

impl<M: Module> Generations<M> {
    /// The membership, which only a generation's run holds meanwhile.
    fn membership(&mut self) -> Result<&mut Elastic> {
        self.membership.as_mut().ok_or(DistError::MembershipChanged)
    }

    /// Trains in the generation of `group` and every one after it, until `train` ends.
    fn train(
        &mut self,
        mut group: Arc<dyn ProcessGroup>,
        train: &mut impl FnMut(&mut ElasticRun<M>) -> Result<()>,
    ) -> Result<ElasticRun<M>> {
        loop {
            let rank = group.rank();
            let started = take_state(group, self.committed.clone(), self.bucket_bytes);
            self.membership()?.started(started.is_ok(), rank);
            let why = match started {
                Ok((dp, state)) => match self.generation(dp, state, train)? {
                    Ok(done) => return Ok(done),
                    Err(why) => why,
                },
                Err(e) if lost(&e) => format!("the generation was lost while starting: {e}"),
                Err(e) => return Err(e),
            };
            self.changes += 1;
            let step = self.committed.step;
            let m = self.membership()?;
            println!(
                "left generation {} at step {step}: {why}; joining the next",
                m.generation.number
            );
            group = m.next(step)?;
        }
    }

    /// One generation: the members' state checked equal, then `train`; `Ok(Err(why))` when
    /// it ends by a change of members (the last commit kept for the next).
    fn generation(
        &mut self,
        dp: DataParallel,
        state: TrainState<M>,
        train: &mut impl FnMut(&mut ElasticRun<M>) -> Result<()>,
    ) -> Result<std::result::Result<ElasticRun<M>, String>> {
        let hash = match members_hash(&dp, &state.model) {
            Ok(h) => h,
            Err(e) if lost(&e) => return Ok(Err(e.to_string())),
            Err(e) => return Err(e),
        };
        let line = self
            .membership()?
            .generation_line(dp.rank(), state.step, hash);
        println!("{line}");
        let mut r = ElasticRun {
            committed: Some(state.clone()),
            state,
            dp,
            membership: self.membership.take(),
            changes: self.changes,
        };
        let result = train(&mut r);
        if let Ok(()) = result {
            if let Some(m) = r.membership.as_mut() {
                m.finished();
            }
            return Ok(Ok(r));
        }
        self.membership = r.membership.take();
        match result {
            Ok(()) => Ok(Ok(r)),
            Err(DistError::MembershipChanged) => {
                self.committed = r.state;
                Ok(Err("the membership changes".into()))
            }
            Err(e) if lost(&e) => {
                self.committed = r.committed.take().unwrap_or(r.state);
                Ok(Err(e.to_string()))
            }
            Err(e) => Err(e),
        }
    }
}

/// Whether `e` is a lost generation (a member gone), which the others survive.
fn lost(e: &DistError) -> bool {
    match e {
        DistError::Comm(c) => survivable_comm(c),
        DistError::Settings(t) => survivable(t),
        _ => false,
    }
}

/// Data parallelism over `group` (gradient buckets of about `bucket_bytes`) and `state`
/// made rank 0's: its parameters, buffers and optimizer state, its step and bytes.
/// Collective.
fn take_state<M: Module>(
    group: Arc<dyn ProcessGroup>,
    state: TrainState<M>,
    bucket_bytes: usize,
) -> Result<(DataParallel, TrainState<M>)> {
    let dp = DataParallel::with_bucket_bytes(group, &state.model, bucket_bytes)?;
    let model = dp.broadcast_model(state.model)?;
    let optimizer = dp.broadcast_optimizer(state.optimizer)?;
    let mut bytes = Vec::new();
    if dp.rank() == 0 {
        bytes.extend_from_slice(&state.step.to_le_bytes());
        bytes.extend_from_slice(&state.extra);
    }
    dp.group().broadcast_bytes(&mut bytes, 0, EXTRA_BOUND + 8)?;
    let (step, extra) = bytes
        .split_first_chunk::<8>()
        .ok_or_else(|| DistError::Output(format!("rank 0's step: {} bytes", bytes.len())))?;
    let state = TrainState {
        model,
        optimizer,
        step: u64::from_le_bytes(*step),
        extra: extra.to_vec(),
    };
    Ok((dp, state))
}

/// The hash of `model`'s parameters, checked the same on every member (an error naming
/// the members that differ). Collective.
fn members_hash<M: Module>(dp: &DataParallel, model: &M) -> Result<u64> {
    let layout: &ParamLayout = dp.layout();
    let mut flat = vec![0.0f32; layout.total];
    any_module::read_params(model, layout, &mut flat)?;
    let bytes: Vec<u8> = flat.iter().flat_map(|v| v.to_le_bytes()).collect();
    let hash = xxhash_rust::xxh3::xxh3_64(&bytes);
    let all = dp.group().all_gather_u64(hash)?;
    let differing: Vec<usize> = (0..all.len()).filter(|&r| all[r] != all[0]).collect();
    if differing.is_empty() {
        Ok(hash)
    } else {
        Err(DistError::ModelsDiffer(format!(
            "after taking rank 0's state, the parameters of ranks {differing:?} differ from \
             rank 0's"
        )))
    }
}
