//! ZeRO stage 1 by whole parameter, for an engine that steps with an optimizer of its own
//! ([`Engine::steps_own_optimizer`]: burn's `Learner`, whose optimizer state is burn records
//! keyed by parameter, not Flotilla's flat shards).
//!
//! Every bucket is all-reduced as at stage 0, so every rank has the whole averaged gradient;
//! rank `r` steps the parameters of its part of the cut ([`ParamLayout::whole_param_cut`])
//! with the engine's optimizer, which so holds state for those only, and every rank's
//! stepped part goes to every rank (an all-gather of the values). A burn optimizer steps
//! each parameter on its own: the parameters are bitwise those of the unsharded step.
//!
//! In an elastic job (as `elastic.rs` does for the flat shards) rank `r` of `N` also steps
//! its successor's part (`(r + 1) % N`), so losing any one rank loses none of the state, and
//! keeps the state from before each step until the step's all-gather went through here; a
//! step that fails in flight puts this rank's parameters back at once. At a generation's
//! start ([`ParamZero::recut`], collective) the members say the steps they finished and
//! applied and the cut their state belongs to; the generation's step is the most finished
//! (a member that stepped past it takes its step back); each part of that cut comes from its
//! owner, or from the member before it when the owner is lost, and every member puts the state together and
//! keeps the parts the new cut gives it — a joiner's over the wire, from no file.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use flotilla_engine::{Engine, ParamLayout};
use flotilla_tcp::ProcessGroup;

use crate::checkpoint::{self, CheckpointState};
use crate::error::{Result, TrainError};

/// Words of a member's header at a generation's start.
const HEADER_WORDS: usize = 4;

/// ZeRO stage 1 by whole parameter (see the module docs).
pub(crate) struct ParamZero {
    comm: Arc<dyn ProcessGroup>,
    layout: ParamLayout,
    /// Whether each rank also holds its successor's part (an elastic job).
    spare: bool,
    /// The cut (members, index) the optimizer state held here belongs to.
    held: (usize, usize),
    /// Steps applied to the state held here.
    applied: u64,
    /// Whether the last applied step finished here (its all-gather went through).
    finished: bool,
    /// The state from before the last applied step, until it finished (an elastic job).
    before: Option<Vec<u8>>,
    /// The parameters from before the step under way (an elastic job, which goes on after a
    /// failed step; empty otherwise).
    params: Vec<f32>,
}

/// What one member says at a generation's start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Header {
    finished: u64,
    applied: u64,
    /// The cut its state belongs to.
    held: (usize, usize),
}

impl Header {
    fn encode(&self) -> Vec<u8> {
        let words = [
            self.finished,
            self.applied,
            self.held.0 as u64,
            self.held.1 as u64,
        ];
        words.iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    fn decode(bytes: &[u8]) -> Option<Self> {
        if bytes.len() != HEADER_WORDS * 8 {
            return None;
        }
        let w: Vec<u64> = bytes
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
            .collect();
        let held = (usize::try_from(w[2]).ok()?, usize::try_from(w[3]).ok()?);
        (held.1 < held.0).then_some(Self {
            finished: w[0],
            applied: w[1],
            held,
        })
    }
}

/// The parts of the cut among `world` that rank `index` holds: its own, and with `spare` its
/// successor's.
fn parts_of(cut: &[Range<usize>], index: usize, spare: bool) -> Vec<Range<usize>> {
    let world = cut.len();
    let mut parts = vec![cut[index].clone()];
    if spare && world > 1 {
        parts.push(cut[(index + 1) % world].clone());
    }
    parts
}

/// For the members of `headers` (by rank) at `step`: the cut whose every part some member
/// holds at that step (the largest member count first), and for each member the parts it
/// sends (each part's owner, else the member before it, which held it as its spare).
fn assign(
    layout: &ParamLayout,
    headers: &[Header],
    step: u64,
    spare: bool,
) -> Option<(usize, Vec<Vec<Range<usize>>>)> {
    let able = |h: &Header| h.applied == step;
    let mut worlds: Vec<usize> = headers
        .iter()
        .filter(|h| able(h))
        .map(|h| h.held.0)
        .collect();
    worlds.sort_unstable_by(|a, b| b.cmp(a));
    worlds.dedup();
    worlds.into_iter().find_map(|world| {
        let cut = layout.whole_param_cut(world);
        let mut sends = vec![Vec::new(); headers.len()];
        for (k, part) in cut.iter().enumerate() {
            let owner = |h: &Header| able(h) && h.held == (world, k);
            let before = |h: &Header| {
                able(h) && spare && world > 1 && h.held == (world, (k + world - 1) % world)
            };
            let holder = headers
                .iter()
                .position(owner)
                .or_else(|| headers.iter().position(before))?;
            sends[holder].push(part.clone());
        }
        Some((world, sends))
    })
}

impl ParamZero {
    /// This rank's part of the cut among the ranks of `comm`, each with its successor's
    /// when `spare` (an elastic job).
    pub(crate) fn new(comm: Arc<dyn ProcessGroup>, layout: &ParamLayout, spare: bool) -> Self {
        Self {
            held: (comm.size(), comm.rank()),
            comm,
            layout: layout.clone(),
            spare,
            applied: 0,
            finished: true,
            before: None,
            params: vec![0.0; if spare { layout.total } else { 0 }],
        }
    }

    /// The parts this rank steps in the current group.
    fn mine(&self) -> Vec<Range<usize>> {
        let cut = self.layout.whole_param_cut(self.comm.size());
        parts_of(&cut, self.comm.rank(), self.spare)
    }

    /// The flat span of parameters `part`.
    fn span(&self, part: &Range<usize>) -> Range<usize> {
        let at = |i: usize| {
            self.layout
                .params
                .get(i)
                .map_or(self.layout.total, |p| p.offset)
        };
        at(part.start)..at(part.end)
    }

    /// One step: this rank's parts stepped by `engine`'s optimizer on the whole averaged
    /// gradient `grads`, then every rank's own part to every rank. A failed all-gather puts
    /// the parameters back (the step's optimizer state is taken back at the next start).
    pub(crate) fn step(&mut self, engine: &mut dyn Engine, grads: &[f32], lr: f64) -> Result<()> {
        let (rank, world) = (self.comm.rank(), self.comm.size());
        if self.spare {
            engine.read_params(&mut self.params)?;
            self.before = Some(engine.optimizer_state()?);
        }
        engine.apply_grads_to(grads, &self.mine(), lr)?;
        (self.applied, self.finished) = (self.applied + 1, false);
        let mut now = vec![0.0; self.layout.total];
        engine.read_params(&mut now)?;
        let cut = self.layout.whole_param_cut(world);
        let own: Vec<u8> = now[self.span(&cut[rank])]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let gathered = match self.comm.all_gather_bytes(&own) {
            Ok(g) => g,
            Err(e) => {
                self.put_back(engine)?;
                return Err(e.into());
            }
        };
        for (k, bytes) in gathered.iter().enumerate() {
            let dst = &mut now[self.span(&cut[k])];
            if bytes.len() != dst.len() * 4 {
                self.put_back(engine)?;
                return Err(TrainError::Protocol {
                    peer: k,
                    message: format!(
                        "{} bytes of its stepped parameters, not {}",
                        bytes.len(),
                        dst.len() * 4
                    ),
                });
            }
            for (v, b) in dst.iter_mut().zip(bytes.chunks_exact(4)) {
                *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        engine.write_params(&now)?;
        (self.finished, self.before) = (true, None);
        Ok(())
    }

    /// Puts the parameters from before a failed step back (an elastic job trains on from
    /// them; a job of fixed size ends at the error, so it keeps no copy).
    fn put_back(&self, engine: &mut dyn Engine) -> Result<()> {
        if self.spare {
            engine.write_params(&self.params)?;
        }
        Ok(())
    }

    /// Writes a checkpoint (collective): every rank's own part of the optimizer state goes
    /// to rank 0, which writes the whole state with the parameters (and holds it only while
    /// it writes); rank 0's checkpoint directory.
    pub(crate) fn save(
        &self,
        output: &Path,
        engine: &mut dyn Engine,
        state: &CheckpointState,
    ) -> Result<Option<PathBuf>> {
        let cut = self.layout.whole_param_cut(self.comm.size());
        let own = engine.optimizer_state_of(&cut[self.comm.rank()..=self.comm.rank()])?;
        let parts = self.comm.all_gather_bytes(&own)?;
        if self.comm.rank() != 0 {
            return Ok(None);
        }
        let held = engine.optimizer_state()?;
        let every = 0..self.layout.params.len();
        engine.load_optimizer_parts(&parts, std::slice::from_ref(&every))?;
        let saved = checkpoint::save(output, &*engine, state);
        engine.load_optimizer_state(&held)?;
        saved.map(Some)
    }

    /// After a checkpoint of `step` was loaded whole into `engine`: keeps this rank's parts.
    pub(crate) fn resumed(&mut self, engine: &mut dyn Engine, step: u64) -> Result<()> {
        let whole = engine.optimizer_state()?;
        engine.load_optimizer_parts(&[whole], &self.mine())?;
        self.held = (self.comm.size(), self.comm.rank());
        (self.applied, self.finished, self.before) = (step, true, None);
        Ok(())
    }

    /// Takes the new group of a generation (its state is put together at its start).
    pub(crate) fn regroup(&mut self, comm: Arc<dyn ProcessGroup>) {
        self.comm = comm;
    }

    /// At a start (collective): the optimizer state of the members' most finished step put
    /// together from its holders and cut for the current group (see the module docs); the
    /// member count and step of the cut it came from when that differs from the group's.
    pub(crate) fn recut(&mut self, engine: &mut dyn Engine) -> Result<Option<(usize, u64)>> {
        let finished = self.applied - u64::from(!self.finished);
        let mine = Header {
            finished,
            applied: self.applied,
            held: self.held,
        };
        let headers = self
            .comm
            .all_gather_bytes(&mine.encode())?
            .iter()
            .enumerate()
            .map(|(m, b)| {
                Header::decode(b).ok_or_else(|| TrainError::Protocol {
                    peer: m,
                    message: "a malformed ZeRO header".into(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let step = headers.iter().map(|h| h.finished).max().unwrap_or(0);
        if self.applied == step + 1
            && let Some(before) = self.before.take()
        {
            engine.load_optimizer_state(&before)?;
            self.applied = step;
        }
        let headers: Vec<Header> = headers
            .into_iter()
            .enumerate()
            .map(
                |(m, h)| match (m == self.comm.rank(), h.applied == step + 1) {
                    (true, _) => Header {
                        applied: self.applied,
                        ..h
                    },
                    // It took its step back as this rank did (it held the state from before).
                    (false, true) => Header { applied: step, ..h },
                    (false, false) => h,
                },
            )
            .collect();
        let Some((from, sends)) = assign(&self.layout, &headers, step, self.spare) else {
            return Err(TrainError::ShardsLost(format!(
                "a part of the optimizer state at step {step} held only by ranks that left \
                 (each part lives on its rank and the one before it); the job cannot go on \
                 without a restart from its checkpoint"
            )));
        };
        let send = match sends.get(self.comm.rank()) {
            Some(parts) if !parts.is_empty() => engine.optimizer_state_of(parts)?,
            _ => Vec::new(),
        };
        let parts = self.comm.all_gather_bytes(&send)?;
        engine.load_optimizer_parts(&parts, &self.mine())?;
        self.held = (self.comm.size(), self.comm.rank());
        (self.applied, self.finished, self.before) = (step, true, None);
        Ok((from != self.comm.size()).then_some((from, step)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(applied: u64, held: (usize, usize)) -> Header {
        Header {
            finished: applied,
            applied,
            held,
        }
    }

    #[test]
    fn a_header_round_trips_and_a_malformed_one_is_refused() {
        let h = Header {
            finished: 7,
            applied: 8,
            held: (3, 2),
        };
        assert_eq!(Header::decode(&h.encode()), Some(h));
        assert_eq!(Header::decode(&h.encode()[..24]), None);
        let mut outside = h.encode();
        outside[24] = 3; // index 3 of a 3-member cut
        assert_eq!(Header::decode(&outside), None);
    }

    proptest::proptest! {
        /// Whatever a member sends as its header, decoding gives a header or nothing (no
        /// panic), and a header it gives encodes back to the same bytes.
        #[test]
        fn any_bytes_decode_to_a_header_or_nothing(bytes in proptest::collection::vec(0u8..=255, 0..48)) {
            if let Some(h) = Header::decode(&bytes) {
                proptest::prop_assert_eq!(h.encode(), bytes);
                proptest::prop_assert!(h.held.1 < h.held.0);
            }
        }
    }

    #[test]
    fn each_part_comes_from_its_owner_a_lost_owners_from_the_member_before_it() {
        let layout = ParamLayout::of_lengths(&[4, 4, 4, 4, 4, 4]);
        let cut = layout.whole_param_cut(3);
        assert_eq!(cut, vec![0..2, 2..4, 4..6]);
        // The first start: each its own part (and its successor's, which another sends).
        let fresh: Vec<Header> = (0..3).map(|r| header(0, (3, r))).collect();
        let (world, sends) = assign(&layout, &fresh, 0, true).expect("every part");
        assert_eq!(world, 3);
        assert_eq!(sends, vec![vec![0..2], vec![2..4], vec![4..6]]);
        // Rank 0 of 3 lost at step 40: old ranks 1 and 2 are the members, and a joiner
        // (nothing applied) holds nothing. Part 0 lives on with old rank 2.
        let after = vec![header(40, (3, 1)), header(40, (3, 2)), header(0, (3, 2))];
        let (world, sends) = assign(&layout, &after, 40, true).expect("every part");
        assert_eq!(world, 3);
        assert_eq!(sends, vec![vec![2..4], vec![0..2, 4..6], vec![]]);
        // Without the spare (a job of fixed size) part 0 is lost with its owner.
        assert_eq!(assign(&layout, &after, 40, false), None);
        // Two neighbours lost (old ranks 0 and 1): part 1 is lost.
        assert_eq!(assign(&layout, &after[1..], 40, true), None);
        // A member at another step holds nothing of this one.
        let behind = vec![header(39, (3, 1)), header(40, (3, 2))];
        assert_eq!(assign(&layout, &behind, 40, true), None);
    }

    #[test]
    fn the_newest_complete_cut_wins() {
        let layout = ParamLayout::of_lengths(&[4, 4, 4, 4]);
        // Two members re-cut to 2 parts; a third still holds the 3-part cut.
        let h = vec![header(9, (2, 0)), header(9, (2, 1)), header(9, (3, 2))];
        let (world, sends) = assign(&layout, &h, 9, true).expect("the 2-part cut");
        assert_eq!(world, 2);
        assert_eq!(sends, vec![vec![0..2], vec![2..4], vec![]]);
    }
}
