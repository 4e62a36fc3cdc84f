//! A pipeline's replicas in an elastic job (`strategy: pipeline` under `-n MIN:MAX`, MIN and
//! MAX multiples of the stages): each generation has whole replicas (the lighthouse forms
//! them: `flotilla_tcp`'s `replicas.rs`), rank `r` runs stage `r % S` of replica `r / S`, and
//! a process that fills no replica stands by.
//!
//! At a generation's start every member says what it holds (`Header`): the steps the run
//! finished, its stage, the steps in that stage's state and whether it keeps the state from
//! before its last step (kept from a batch's start until its step finished everywhere: a
//! stage's optimizer step may have run on some stages of a step that failed on others), and
//! its lineage (one more than the most any member of its last generation brought: a process
//! that stood by while the others trained on has an older one, and its state, even at the
//! same count of steps, is not theirs). Only the members of the newest lineage count: the
//! generation's step is the most they finished; for each stage, the lowest-ranked of them
//! holding it at that step gives it to the members that run it and do not hold it
//! (weights and optimizer state, over the wire: no disk). A stage nobody holds at that step
//! ends the job, naming it (a fixed-size pipeline's checkpoint restart is the way back).

use std::ops::Range;
use std::sync::Arc;

use flotilla_engine::{StageCut, StageEngine};
use flotilla_tcp::ProcessGroup;

use super::source::StageSource;
use super::state::{load_parts, receive_parts, send_parts, stage_parts};
use super::{Pipeline, PipelineOptions};
use crate::error::{Result, TrainError};

/// Most stages a header may name (a bound on what a peer's header may size).
const MAX_STAGES: usize = 4096;

/// What this process's stage state holds, between generations.
#[derive(Debug, Default)]
pub(crate) struct Held {
    /// Steps the run finished here (the last step's loss was agreed by every member).
    pub(crate) committed: u64,
    /// Optimizer steps in the stage's state (`committed + 1` after an update whose step
    /// did not finish).
    pub(crate) at: u64,
    /// The stage's state before its last update (weights, optimizer state), kept until that
    /// step finished here.
    pub(crate) undo: Option<[Vec<u8>; 2]>,
    /// The lineage of the generation it last trained in (0 before any change of members).
    pub(crate) lineage: u64,
}

/// What a member says at a generation's start.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Header {
    /// Steps it finished.
    pub(crate) committed: u64,
    /// The stage it holds (`None`: a joiner).
    pub(crate) stage: Option<usize>,
    /// Optimizer steps in that stage's state.
    pub(crate) at: u64,
    /// Whether it keeps that state from before its last update.
    pub(crate) undoable: bool,
    /// The lineage of its state (see the module).
    pub(crate) lineage: u64,
    /// The pipeline's cut, as layer ranges (empty: a joiner's).
    pub(crate) cut: Vec<[usize; 2]>,
}

impl Header {
    /// Whether it can give stage `stage`'s state at `step`.
    pub(crate) fn gives(&self, stage: usize, step: u64) -> bool {
        self.stage == Some(stage) && (self.at == step || (self.undoable && self.at == step + 1))
    }

    /// The header as little-endian words.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let stage = self.stage.map_or(0, |s| s as u64 + 1);
        let mut words = vec![self.committed, stage, self.at, u64::from(self.undoable)];
        words.push(self.lineage);
        words.push(self.cut.len() as u64);
        words.extend(self.cut.iter().flat_map(|r| [r[0] as u64, r[1] as u64]));
        words.iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    /// Parses a header from `peer`.
    pub(crate) fn decode(bytes: &[u8], peer: usize) -> Result<Header> {
        let bad = |message: String| TrainError::Protocol { peer, message };
        if !bytes.len().is_multiple_of(8) || bytes.len() < 48 {
            return Err(bad(format!("a pipeline header of {} bytes", bytes.len())));
        }
        let words: Vec<u64> = bytes
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
            .collect();
        let n = usize::try_from(words[5]).unwrap_or(usize::MAX);
        if n > MAX_STAGES || words.len() != 6 + 2 * n || words[1] > MAX_STAGES as u64 {
            return Err(bad(format!(
                "a malformed pipeline header ({} words)",
                words.len()
            )));
        }
        let index = |w: u64| usize::try_from(w).map_err(|_| bad(format!("layer {w}")));
        let mut cut = Vec::with_capacity(n);
        for pair in words[6..].chunks_exact(2) {
            cut.push([index(pair[0])?, index(pair[1])?]);
        }
        Ok(Header {
            committed: words[0],
            stage: words[1].checked_sub(1).map(|s| s as usize),
            at: words[2],
            undoable: words[3] != 0,
            lineage: words[4],
            cut,
        })
    }
}

/// Where a generation takes each stage's state from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Handover {
    /// The generation's step.
    pub(crate) step: u64,
    /// For each stage, the member giving its state (`None` at step 0: built from the seed).
    pub(crate) holders: Vec<Option<usize>>,
    /// The newest lineage among the members: only theirs counts.
    pub(crate) newest: u64,
}

impl Handover {
    /// Whether the member that said `h` holds stage `stage` as this generation takes it.
    fn held_by(&self, h: &Header, stage: usize) -> bool {
        h.lineage == self.newest && h.gives(stage, self.step)
    }
}

/// The handover of a generation whose members said `headers`, of a pipeline of `stages`.
pub(crate) fn choose(headers: &[Header], stages: usize) -> Result<Handover> {
    let newest = headers.iter().map(|h| h.lineage).max().unwrap_or(0);
    let current = || headers.iter().filter(|h| h.lineage == newest);
    let step = current().map(|h| h.committed).max().unwrap_or(0);
    let mut holders = Vec::with_capacity(stages);
    for s in 0..stages {
        let holder = headers
            .iter()
            .position(|h| h.lineage == newest && h.gives(s, step));
        if holder.is_none() && step > 0 {
            return Err(TrainError::ShardsLost(format!(
                "no member holds pipeline stage {s} at step {step} (every process that ran it \
                 left); restart the job from its checkpoint"
            )));
        }
        holders.push(holder);
    }
    Ok(Handover {
        step,
        holders,
        newest,
    })
}

/// This member's stage state at a generation's start: what it holds (`held`, with its
/// current `stage`; `None` for a joiner) and the model to build another stage from.
pub(crate) struct Entering<'a> {
    pub(crate) source: &'a StageSource,
    pub(crate) opts: &'a PipelineOptions,
    pub(crate) held: Option<(&'a Held, &'a dyn StageEngine)>,
}

/// What a member takes into the generation: the stage to run when it is not the one it
/// holds (or a state to load into the one it holds), and the generation's step.
pub(crate) struct Entered {
    /// The cut (a joiner learns it here).
    pub(crate) cut: StageCut,
    /// A new stage to run, or `None`: the held stage, as it is (`reload: None`).
    pub(crate) stage: Option<Box<dyn StageEngine>>,
    /// The state to load into the held stage (its own from before its last update).
    pub(crate) reload: Option<[Vec<u8>; 2]>,
    pub(crate) step: u64,
    /// The generation's lineage (every member's from now on).
    pub(crate) lineage: u64,
}

/// The collective start of a generation (see the module's documentation), on `world`:
/// `cut` the pipeline's (`None`: a joiner's, which a member's header gives; when no member
/// holds one, every member is new and `fresh` plans it, collectively).
pub(crate) fn enter(
    world: &dyn ProcessGroup,
    e: &Entering<'_>,
    cut: Option<&StageCut>,
    fresh: &mut dyn FnMut() -> Result<StageCut>,
) -> Result<Entered> {
    let mine = match (e.held, cut) {
        (Some((held, stage)), Some(cut)) => Header {
            committed: held.committed,
            stage: Some(stage.index()),
            at: held.at,
            undoable: held.undo.is_some(),
            lineage: held.lineage,
            cut: cut.ranges.iter().map(|r| [r.start, r.end]).collect(),
        },
        _ => Header::default(),
    };
    let headers: Vec<Header> = (world.all_gather_bytes(&mine.encode())?.iter().enumerate())
        .map(|(r, b)| Header::decode(b, world.world_rank(r)))
        .collect::<Result<_>>()?;
    // A joiner learns the cut from a member and builds the stage it will run with it.
    let (cut, built) = match (cut, headers.iter().find(|h| !h.cut.is_empty())) {
        (Some(cut), _) => (cut.clone(), None),
        (None, Some(h)) => {
            let ranges: Vec<Range<usize>> = h.cut.iter().map(|r| r[0]..r[1]).collect();
            let index = world.rank() % ranges.len().max(1);
            let (cut, stage) = e.source.cut_and_stage(ranges, index, e.opts)?;
            (cut, Some(stage))
        }
        (None, None) => (fresh()?, None),
    };
    let stages = cut.stages();
    let plan = choose(&headers, stages)?;
    let rank = world.rank();
    // As a holder: each member that runs my stage and cannot give it itself gets it.
    let mut given = None;
    for (r, h) in headers.iter().enumerate() {
        let s = r % stages;
        if r != rank && plan.holders[s] == Some(rank) && !plan.held_by(h, s) {
            let parts = match &given {
                Some(p) => p,
                None => given.insert(state_at(e, plan.step)?),
            };
            send_parts(world, r, parts)?;
        }
    }
    let s = rank % stages;
    let lineage = plan.newest + 1;
    if plan.held_by(&headers[rank], s) {
        let reload = match headers[rank].at == plan.step {
            true => None,
            false => Some(state_at(e, plan.step)?),
        };
        return Ok(Entered {
            cut,
            stage: None,
            reload,
            step: plan.step,
            lineage,
        });
    }
    let mut stage = match built {
        Some(stage) => stage,
        None => e.source.build(&cut, s, e.opts)?,
    };
    if let Some(from) = plan.holders[s] {
        let parts = receive_parts(world, from)?;
        load_parts(&mut *stage, &parts)?;
    }
    Ok(Entered {
        cut,
        stage: Some(stage),
        reload: None,
        step: plan.step,
        lineage,
    })
}

/// The held stage's state at `step`: as it is, or from before its last update.
fn state_at(e: &Entering<'_>, step: u64) -> Result<[Vec<u8>; 2]> {
    let Some((held, stage)) = e.held else {
        return Err(TrainError::ShardsLost("a joiner holds no stage".into()));
    };
    match (&held.undo, held.at == step) {
        (_, true) => stage_parts(stage),
        (Some(undo), false) => Ok(undo.clone()),
        (None, false) => Err(TrainError::ShardsLost(format!(
            "the stage holds step {}, not {step}",
            held.at
        ))),
    }
}

/// Builds a joiner's pipeline in a running job's generation (`world`): collective with the
/// members' [`enter`]; `fresh` plans the cut when every member is new. Returns the
/// generation's step and lineage.
pub(crate) fn join(
    world: Arc<dyn ProcessGroup>,
    source: &StageSource,
    opts: PipelineOptions,
    fresh: &mut dyn FnMut() -> Result<StageCut>,
) -> Result<(Pipeline, u64, u64)> {
    let entering = Entering {
        source,
        opts: &opts,
        held: None,
    };
    let entered = enter(&*world, &entering, None, fresh)?;
    let stage = (entered.stage)
        .ok_or_else(|| TrainError::ShardsLost("a joiner was given no stage".into()))?;
    let pipe = Pipeline::of(stage, entered.cut, &source.model(), opts, world)?;
    Ok((pipe, entered.step, entered.lineage))
}

#[cfg(test)]
#[path = "elastic_tests.rs"]
mod tests;
