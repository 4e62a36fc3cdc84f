//! ZeRO checkpoints re-shard on resume: in-memory ranks of the production
//! [`super::SyncAllReduce`] train `K` steps sharded (2 ranks, stage 1; 3 ranks, stage 2) and,
//! beside them, unsharded; each checkpoint resumes on other worlds and stages (1 rank
//! unsharded, 2, 3 and 4 ranks sharded, stage 3 too: each rank cutting its optimizer shard
//! out of the checkpoint's files) for the rest of the steps. Since ZeRO is bitwise
//! zero 0 on the ring, every resumed run must end bit for bit as the unsharded checkpoint
//! resumed unsharded on the same world; the unsharded checkpoint resumed under ZeRO too.
//! And the sharded checkpoint's optimizer state, put together, equals the unsharded run's
//! at that step (every field and scalar: SGD's momentum, Adam's moments and step counts).

use std::path::Path;

use flotilla_engine::{FlatOptimizerState, OptimizerSpec, ParamLayout};

use super::SyncAllReduce;
use super::zero_tests::{STEPS, optimizers, rank, ring, run};
use crate::checkpoint;
use crate::strategy::Strategy;
use crate::testkit::assert_bitwise;

/// Steps before the checkpoint.
const K: u64 = 5;

/// The model's flat layout, as every peer has it.
fn layout(opt: &OptimizerSpec) -> ParamLayout {
    let mut one = rank(ring(1).remove(0), opt, 0);
    let topology = one.config.topology().expect("topology");
    let mut peer = one.build(&topology, SyncAllReduce::build);
    peer.model().expect("a model").layout().clone()
}

/// The optimizer state of the newest checkpoint under `output`, in whole-model flat form.
fn flat_state(output: &Path, layout: &ParamLayout) -> FlatOptimizerState {
    let dir = checkpoint::latest(output)
        .expect("latest")
        .expect("a checkpoint");
    let state = checkpoint::read_state(&dir).expect("state");
    checkpoint::read_flat_state(&dir, &state, layout).expect("flat state")
}

/// Resumes the checkpoints of `sharded` and `whole` on `m` ranks at `zero` and compares
/// each with the unsharded checkpoint resumed unsharded there.
fn resume_everywhere(opt: &OptimizerSpec, sharded: &Path, whole: &Path, m: usize, zero: u8) {
    let want = run(m, opt, 0, (K, STEPS), whole, false);
    let got = run(m, opt, zero, (K, STEPS), sharded, false);
    for r in 0..m {
        let what = format!("{opt:?}: sharded checkpoint at {m} ranks, zero {zero}, rank {r}");
        assert_bitwise(&got[r].0, &want[r].0, &what);
        assert_bitwise(&got[r].1, &want[r].1, &format!("{what}: losses"));
    }
    if zero > 0 {
        let got = run(m, opt, zero, (K, STEPS), whole, false);
        for r in 0..m {
            let what = format!("{opt:?}: unsharded checkpoint at {m} ranks, zero {zero}, rank {r}");
            assert_bitwise(&got[r].0, &want[r].0, &what);
        }
    }
}

/// A checkpoint's world and stage, and the worlds and stages it resumes at.
type Source = (usize, u8, &'static [(usize, u8)]);

#[test]
fn zero_checkpoints_resume_on_other_worlds_and_stages() {
    let sources: [Source; 2] = [
        (2, 1, &[(1, 0), (3, 2), (4, 2), (2, 2), (3, 3), (4, 3)]),
        (3, 2, &[(2, 1), (1, 1), (2, 3)]),
    ];
    for opt in optimizers().iter().take(2) {
        let layout = layout(opt);
        for (n, zero, targets) in sources {
            let (sharded, whole) = (
                tempfile::tempdir().expect("tmp"),
                tempfile::tempdir().expect("tmp"),
            );
            run(n, opt, zero, (0, K), sharded.path(), true);
            run(n, opt, 0, (0, K), whole.path(), true);
            assert_eq!(
                flat_state(sharded.path(), &layout),
                flat_state(whole.path(), &layout),
                "{opt:?}: {n} ranks' zero {zero} shards put together"
            );
            for &(m, z) in targets {
                resume_everywhere(opt, sharded.path(), whole.path(), m, z);
            }
        }
    }
}
