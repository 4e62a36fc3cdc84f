//! ZeRO in an elastic job: every shard's optimizer state lives on two ranks, so that losing
//! any one rank loses none of it, and a new generation re-cuts the state among its members.
//!
//! Rank `r` of `N` steps its own shard and a *spare*: its successor's (`(r + 1) % N`),
//! stepped on the successor's shard of the averaged gradient, which the successor sends it
//! after the reduce (one message of 1/N of the gradient per step). burn's optimizers are
//! element-wise and deterministic, so the spare's state is bitwise the owner's. A rank holds
//! 2/N of the optimizer state and steps it twice: the price of losing a rank without a
//! restart. Two neighbours lost in one change (a shard and its spare) lose that shard's state:
//! the job stops and says so (a fixed-size job restarts from its checkpoint).
//!
//! Each step keeps the state from before it ([`ShardOptimizer::keep_undo`]) until its
//! all-gather finished here. A step's optimizer updates happen on every rank before any rank
//! can finish its all-gather, so when a member is lost in a step, either some member
//! finished that step (then every live member's shards hold it: the generation goes on from
//! it) or none did (then every member that stepped takes it back).
//!
//! At a generation's start ([`Zero::recut`], collective) every member says which shards it
//! holds (the cut, index and steps of each) and the steps it finished; the generation's step
//! is the most finished. For the first cut of which some member holds every shard at that
//! step, the lowest-ranked holder of each broadcasts it; every member folds each into its own
//! shard and spare of the new cut as it comes ([`ShardRecut`]), so that no member holds the
//! whole optimizer state, and a joining process takes its shards from the members over the
//! wire, not from a disk.

use std::sync::Arc;
use std::time::Instant;

use flotilla_engine::{OptimizerSpec, ParamLayout, ShardOptimizer, ShardRecut};
use flotilla_tcp::{ProcessGroup, Tag, tags};

use super::{Zero, owned_ranges, slots};
use crate::bucket::BucketPlan;
use crate::error::{Result, TrainError};

/// Tag of a shard's averaged gradient sent to the rank holding its spare.
const SPARE_TAG: Tag = tags::RESERVED + 0x103;

/// Shard `index` of the cut of the flat parameters among `world` ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Cut {
    pub(crate) world: usize,
    pub(crate) index: usize,
}

/// An elastic ZeRO rank's second shard and what its shards' state holds.
pub(crate) struct Redundancy {
    /// The successor's shard and its gradient buffer (`None` on one rank, and from a
    /// resume until the start's re-cut).
    spare: Option<(Cut, ShardOptimizer, Vec<f32>)>,
    /// Steps applied to the shards' state.
    applied: u64,
    /// Whether the last applied step finished here (its all-gather went through).
    finished: bool,
    spec: OptimizerSpec,
    device: String,
}

/// A shard one member holds, as it says at a generation's start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Holding {
    pub(crate) cut: Cut,
    /// Steps its state holds.
    pub(crate) steps: u64,
    /// Whether it can take its last step back.
    pub(crate) undoable: bool,
}

/// What one member says at a generation's start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Header {
    /// Steps it finished.
    pub(crate) finished: u64,
    pub(crate) holdings: Vec<Holding>,
}

/// Where the generation takes the optimizer state from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Choice {
    /// The generation's step: what the state holds.
    pub(crate) step: u64,
    /// The cut the shards come from.
    pub(crate) world: usize,
    /// For each shard of that cut, the member holding it and which of its holdings it is.
    pub(crate) holders: Vec<(usize, usize)>,
}

impl Holding {
    /// Whether the holding can give its state at `step`.
    fn at(&self, step: u64) -> bool {
        self.steps == step || (self.undoable && self.steps == step + 1)
    }
}

impl Header {
    /// The header as little-endian words.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut words = vec![self.finished, self.holdings.len() as u64];
        for h in &self.holdings {
            let undo = u64::from(h.undoable);
            words.extend([h.cut.world as u64, h.cut.index as u64, h.steps, undo]);
        }
        words.iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    /// A member's header from its bytes; `None` when they are not one.
    pub(crate) fn decode(bytes: &[u8]) -> Option<Self> {
        let words: Vec<u64> = bytes
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
            .collect();
        let (&finished, rest) = words.split_first()?;
        let (&n, rest) = rest.split_first()?;
        if !bytes.len().is_multiple_of(8) || rest.len() as u64 != n.checked_mul(4)? {
            return None;
        }
        let holdings = rest
            .chunks_exact(4)
            .map(|h| {
                let cut = Cut {
                    world: usize::try_from(h[0]).ok()?,
                    index: usize::try_from(h[1]).ok()?,
                };
                (cut.index < cut.world).then_some(Holding {
                    cut,
                    steps: h[2],
                    undoable: h[3] == 1,
                })
            })
            .collect::<Option<_>>()?;
        Some(Self { finished, holdings })
    }
}

/// Where the members of `headers` (by rank) take the optimizer state from: the most
/// finished steps, and the first cut (newest first: the largest member count) of which some
/// member holds every shard at that step.
pub(crate) fn choose(headers: &[Header]) -> Result<Choice> {
    let step = headers.iter().map(|h| h.finished).max().unwrap_or(0);
    let mut worlds: Vec<usize> = headers
        .iter()
        .flat_map(|h| h.holdings.iter().map(|x| x.cut.world))
        .collect();
    worlds.sort_unstable_by(|a, b| b.cmp(a));
    worlds.dedup();
    let mut missing = Vec::new();
    for &world in &worlds {
        let holder = |index: usize| {
            headers.iter().enumerate().find_map(|(m, h)| {
                let k = h
                    .holdings
                    .iter()
                    .position(|x| x.cut == Cut { world, index } && x.at(step))?;
                Some((m, k))
            })
        };
        let holders: Vec<Option<(usize, usize)>> = (0..world).map(holder).collect();
        if let Some(holders) = holders.iter().copied().collect::<Option<Vec<_>>>() {
            return Ok(Choice {
                step,
                world,
                holders,
            });
        }
        let lost = (0..world).filter(|&i| holders[i].is_none());
        missing.push(format!(
            "shard(s) {} of the {world}-rank cut",
            lost.map(|i| i.to_string()).collect::<Vec<_>>().join(", ")
        ));
    }
    Err(TrainError::ShardsLost(format!(
        "{} at step {step} held only by ranks that left (each shard lives on its rank and the \
         one before it); the job cannot go on without a restart from its checkpoint",
        if missing.is_empty() {
            "every shard".to_string()
        } else {
            missing.join("; ")
        }
    )))
}

impl Redundancy {
    /// Nothing spare yet (the start's re-cut makes it), the state at step 0.
    pub(crate) fn new(spec: &OptimizerSpec, device: &str) -> Self {
        Self {
            spare: None,
            applied: 0,
            finished: true,
            spec: spec.clone(),
            device: device.to_string(),
        }
    }

    /// Bytes of the spare's optimizer state.
    pub(crate) fn spare_bytes(&self) -> Result<u64> {
        match &self.spare {
            Some((_, o, _)) => Ok(o.state_bytes()?),
            None => Ok(0),
        }
    }
}

impl Zero {
    /// Makes this run keep every shard on two ranks ([`Redundancy`]): an elastic job's.
    pub(crate) fn make_elastic(&mut self, spec: &OptimizerSpec, device: &str) {
        self.optimizer.keep_undo(true);
        self.elastic = Some(Redundancy::new(spec, device));
    }

    /// The shards' state holds `step` steps (a resume's); the spare is not loaded until the
    /// start's re-cut.
    pub(crate) fn resumed_at(&mut self, step: u64) {
        if let Some(e) = &mut self.elastic {
            e.applied = step;
            e.finished = true;
            e.spare = None;
        }
    }

    /// Takes `comm`, a new generation's group, keeping the shards of the old cut until the
    /// start's [`Zero::recut`].
    pub(crate) fn regroup(&mut self, comm: Arc<dyn ProcessGroup>) {
        self.comm = comm;
    }

    /// Before a step's optimizer update: the step is not finished here until its all-gather.
    pub(super) fn begin_step(&mut self) {
        if let Some(e) = &mut self.elastic {
            e.finished = false;
        }
    }

    /// The step's all-gather went through here.
    pub(super) fn finish_step(&mut self) {
        if let Some(e) = &mut self.elastic {
            e.finished = true;
        }
    }

    /// The spare's update (elastic runs): this rank's shard of the averaged gradient goes to
    /// its predecessor, the successor's comes here and steps the spare on `params`.
    pub(super) fn step_spare(&mut self, params: &mut [f32], lr: f64) -> Result<()> {
        let Some(e) = &mut self.elastic else {
            return Ok(());
        };
        e.applied += 1;
        let Some((cut, optimizer, grad)) = &mut e.spare else {
            return Ok(());
        };
        let (n, r) = (self.comm.size(), self.comm.rank());
        self.comm
            .send_large((r + n - 1) % n, SPARE_TAG, bytemuck::cast_slice(&self.grad))?;
        let deadline = Instant::now() + self.comm.timeout();
        let bytes = self.comm.recv_large(cut.index, SPARE_TAG, deadline)?;
        if bytes.len() != grad.len() * 4 {
            return Err(TrainError::Protocol {
                peer: cut.index,
                message: format!(
                    "its shard's gradient has {} bytes, the spare {} values",
                    bytes.len(),
                    grad.len()
                ),
            });
        }
        for (g, b) in grad.iter_mut().zip(bytes.chunks_exact(4)) {
            *g = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
        optimizer.step(params, grad, lr)?;
        Ok(())
    }

    /// What this member says at a generation's start.
    fn header(&self, e: &Redundancy) -> Header {
        let steps = e.applied;
        let undoable = !e.finished;
        let mut holdings = vec![Holding {
            cut: self.cut,
            steps,
            undoable,
        }];
        if let Some((cut, _, _)) = &e.spare {
            holdings.push(Holding {
                cut: *cut,
                steps,
                undoable,
            });
        }
        Header {
            finished: steps.saturating_sub(u64::from(undoable)),
            holdings,
        }
    }

    /// The state of holding `k` (0: the own shard, 1: the spare) at `step`.
    fn holding_state(&self, e: &Redundancy, k: usize, step: u64) -> Result<Vec<u8>> {
        let optimizer = match (k, &e.spare) {
            (0, _) => &self.optimizer,
            (_, Some((_, o, _))) => o,
            (_, None) => {
                return Err(TrainError::ShardsLost(
                    "a spare this rank does not hold".into(),
                ));
            }
        };
        if e.applied == step {
            return Ok(optimizer.state()?);
        }
        match optimizer.state_before() {
            Some(state) => Ok(state?),
            None => Err(TrainError::ShardsLost(format!(
                "this rank's shards hold step {}, not step {step} before it",
                e.applied
            ))),
        }
    }

    /// A new generation's re-cut (collective, every member and joiner): the optimizer state
    /// put together from the members' shards at the generation's step and cut for this
    /// group, own shard and spare. Returns the cut the state came from and the step it
    /// holds; `None` in a run that is not elastic (nothing to do).
    pub(crate) fn recut(
        &mut self,
        plan: &BucketPlan,
        layout: &ParamLayout,
    ) -> Result<Option<(usize, u64)>> {
        let Some(e) = self.elastic.take() else {
            return Ok(None);
        };
        match self.recut_with(&e, plan, layout) {
            Ok((next, world)) => {
                let step = next.applied;
                self.elastic = Some(next);
                Ok(Some((world, step)))
            }
            Err(err) => {
                self.elastic = Some(e);
                Err(err)
            }
        }
    }

    fn recut_with(
        &mut self,
        e: &Redundancy,
        plan: &BucketPlan,
        layout: &ParamLayout,
    ) -> Result<(Redundancy, usize)> {
        let headers = self
            .comm
            .all_gather_bytes(&self.header(e).encode())?
            .iter()
            .enumerate()
            .map(|(m, b)| {
                Header::decode(b).ok_or_else(|| TrainError::Protocol {
                    peer: m,
                    message: "a malformed ZeRO shard header".into(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let choice = choose(&headers)?;
        let (n, r) = (self.comm.size(), self.comm.rank());
        let own = Cut { world: n, index: r };
        let spare = (n > 1).then_some(Cut {
            world: n,
            index: (r + 1) % n,
        });
        let cuts: Vec<Cut> = std::iter::once(own).chain(spare).collect();
        let states = self.gather_state(e, &choice, plan, layout, &cuts)?;
        let mut loaded = (cuts.iter().zip(states))
            .map(|(&cut, state)| Ok((cut, self.load_cut(e, cut, state, plan, layout)?)))
            .collect::<Result<Vec<_>>>()?
            .into_iter();
        let Some((_, optimizer)) = loaded.next() else {
            return Err(TrainError::Divergence("ZeRO's re-cut made no shard".into()));
        };
        let spare = loaded.next().map(|(cut, o)| {
            let len = o.len();
            (cut, o, vec![0.0; len])
        });
        let owned = owned_ranges(plan, n, r);
        self.slots = slots(plan, &owned);
        self.grad = vec![0.0; optimizer.len()];
        self.optimizer = optimizer;
        self.cut = own;
        let next = Redundancy {
            spare,
            applied: choice.step,
            finished: true,
            spec: e.spec.clone(),
            device: e.device.clone(),
        };
        Ok((next, choice.world))
    }

    /// The optimizer state of each of `cuts` (this member's new shards) at `choice`'s step:
    /// each shard of its cut broadcast by its holder and folded into them as it comes
    /// ([`ShardRecut`]), so that no member holds the whole state.
    fn gather_state(
        &self,
        e: &Redundancy,
        choice: &Choice,
        plan: &BucketPlan,
        layout: &ParamLayout,
        cuts: &[Cut],
    ) -> Result<Vec<Vec<u8>>> {
        let bound = flotilla_engine::optimizer_state_bound(layout);
        let me = self.comm.rank();
        let mut recuts = (cuts.iter())
            .map(|c| ShardRecut::new(layout, &owned_ranges(plan, c.world, c.index)))
            .collect::<flotilla_engine::Result<Vec<_>>>()?;
        for (i, &(member, k)) in choice.holders.iter().enumerate() {
            let mut bytes = if member == me {
                self.holding_state(e, k, choice.step)?
            } else {
                Vec::new()
            };
            self.comm.broadcast_bytes(&mut bytes, member, bound)?;
            let ranges = owned_ranges(plan, choice.world, i);
            for recut in &mut recuts {
                recut.read_bytes(Some(&ranges), bytes.clone())?;
            }
        }
        Ok(recuts
            .into_iter()
            .map(|r| r.finish())
            .collect::<flotilla_engine::Result<_>>()?)
    }

    /// A shard optimizer of `cut` holding `state` (its part), keeping each step's undo.
    fn load_cut(
        &self,
        e: &Redundancy,
        cut: Cut,
        state: Vec<u8>,
        plan: &BucketPlan,
        layout: &ParamLayout,
    ) -> Result<ShardOptimizer> {
        let owned = owned_ranges(plan, cut.world, cut.index);
        let mut o = ShardOptimizer::new(&e.spec, layout, &owned, &e.device)?;
        o.load_state(state)?;
        o.keep_undo(true);
        Ok(o)
    }
}
