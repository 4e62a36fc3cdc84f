//! ZeRO-1 among a pipeline stage's replicas (`zero.rs`) against zero 0, on 2 stages × 2
//! replicas of threads with Adam: after 20 batches every rank holds zero 0's parameters bit
//! for bit and half its stage's optimizer state (the stage's own optimizer none), and
//! replica 0 puts together the stage's whole state, equal to zero 0's; a checkpoint's state written at batch 10 by either
//! resumes under either and ends on the uninterrupted run's bits.

use std::ops::Range;

use flotilla_engine::{FlatOptimizerState, ModelState, StageCut, optimizer_state_bytes};

use super::tests::{named, options, spec, train_batch};
use super::{Pipeline, PipelineOptions, Schedule};
use crate::testkit::{adam, assert_bitwise, world};

/// A stage's weights and whole optimizer state, as [`Pipeline::stage_state`] gives them.
type Parts = [Vec<u8>; 2];

/// What one rank ends with.
struct Ended {
    stage: usize,
    replica: usize,
    params: Vec<(String, Vec<f32>)>,
    /// Its stage's state, on replica 0.
    parts: Option<Parts>,
    state_bytes: u64,
    /// Its stage's own optimizer's state, in bytes of tensor values.
    own_state_bytes: u64,
}

fn opts(zero: u8) -> PipelineOptions {
    PipelineOptions {
        optimizer: adam(0.02),
        zero,
        ..options(Schedule::OneFOneB, 2, 2)
    }
}

/// `opts(1)` with each replica's optimizer state offloaded under `dir`.
fn offloaded(dir: &std::path::Path) -> PipelineOptions {
    PipelineOptions {
        offload: Some(dir.to_path_buf()),
        ..opts(1)
    }
}

/// Batches `batches` on 2 stages × 2 replicas with `opts`, each stage first loading
/// `from[stage]` when given.
fn run(opts: PipelineOptions, batches: Range<usize>, from: Option<Vec<Parts>>) -> Vec<Ended> {
    let cut = StageCut::at(&spec(), &[5]).expect("cut");
    let handles: Vec<_> = world(4)
        .into_iter()
        .map(|group| {
            let (cut, batches, from) = (cut.clone(), batches.clone(), from.clone());
            let opts = opts.clone();
            std::thread::spawn(move || {
                let mut pipe = Pipeline::new(&spec(), cut, opts, group).expect("pipeline");
                if let Some(from) = from {
                    let parts = &from[pipe.stage_index()];
                    pipe.load_stage_state(parts).expect("load");
                }
                batches.for_each(|b| {
                    train_batch(&mut pipe, b);
                });
                let mut params: Vec<_> = named(pipe.stage()).into_iter().collect();
                params.sort_by(|a, b| a.0.cmp(&b.0));
                let own = pipe.stage().optimizer_state().expect("state");
                Ended {
                    stage: pipe.stage_index(),
                    replica: pipe.replica(),
                    params,
                    parts: pipe.stage_state().expect("stage state"),
                    state_bytes: pipe.optimizer_state_bytes().expect("bytes"),
                    own_state_bytes: optimizer_state_bytes(&own).expect("own bytes"),
                }
            })
        })
        .collect();
    let mut ended: Vec<Ended> = handles
        .into_iter()
        .map(|h| h.join().expect("rank thread"))
        .collect();
    ended.sort_by_key(|e| (e.replica, e.stage));
    ended
}

/// Each stage's parts, from replica 0.
fn stage_parts(ended: &[Ended]) -> Vec<Parts> {
    ended
        .iter()
        .filter(|e| e.replica == 0)
        .map(|e| e.parts.clone().expect("replica 0's parts"))
        .collect()
}

fn assert_same_params(got: &[Ended], want: &[Ended], what: &str) {
    for (g, w) in got.iter().zip(want) {
        assert_eq!((g.stage, g.replica), (w.stage, w.replica));
        for ((name, g), (_, w)) in g.params.iter().zip(&w.params) {
            assert_bitwise(g, w, &format!("{what}: {name}"));
        }
    }
}

/// A stage's whole optimizer state, comparable.
fn flat(stage: usize, whole: &[u8]) -> FlatOptimizerState {
    let cut = StageCut::at(&spec(), &[5]).expect("cut");
    let layout = flotilla_engine::Stage::new(&spec(), &cut, stage, &opts(0).optimizer, "flex", 5)
        .expect("stage")
        .layout()
        .clone();
    FlatOptimizerState::gather(&layout, &[(None, whole)]).expect("gather")
}

#[test]
fn zero_1_trains_zero_0s_bits_with_half_the_optimizer_state() {
    let (plain, sharded) = (run(opts(0), 0..20, None), run(opts(1), 0..20, None));
    assert_same_params(&sharded, &plain, "zero 1 against zero 0");
    let dir = tempfile::tempdir().expect("tmp");
    let files = run(offloaded(dir.path()), 0..20, None);
    assert_same_params(&files, &sharded, "zero 1 offloaded against in memory");
    for (f, s) in files.iter().zip(&sharded) {
        assert_eq!(f.state_bytes, s.state_bytes, "the files hold the state");
    }
    let left = std::fs::read_dir(dir.path()).expect("dir").count();
    assert_eq!(left, 0, "each replica's directory removed at its end");
    for (s, p) in sharded.iter().zip(&plain) {
        println!(
            "stage {} replica {}: {} bytes of optimizer state against {}",
            s.stage, s.replica, s.state_bytes, p.state_bytes
        );
        // Adam's two moments of half the stage's values (to a value, when odd).
        assert!(
            s.state_bytes * 2 <= p.state_bytes + 8,
            "stage {} replica {}: {} bytes against {}",
            s.stage,
            s.replica,
            s.state_bytes,
            p.state_bytes
        );
        assert_eq!(s.own_state_bytes, 0, "the stage's own optimizer stepped");
    }
    for stage in 0..2 {
        let of = |ended: &[Ended]| -> Vec<u64> {
            let e = ended.iter().filter(|e| e.stage == stage);
            e.map(|e| e.state_bytes).collect()
        };
        let (sharded, plain) = (of(&sharded), of(&plain));
        assert_eq!(
            sharded.iter().sum::<u64>(),
            plain[0],
            "stage {stage}: {sharded:?}"
        );
    }
    // (The weights' bytes are not compared: their header's keys come in no fixed order.)
    for (k, (s, p)) in stage_parts(&sharded)
        .iter()
        .zip(stage_parts(&plain))
        .enumerate()
    {
        assert_eq!(
            flat(k, &s[1]),
            flat(k, &p[1]),
            "stage {k}'s optimizer state"
        );
    }
}

#[test]
fn a_stage_state_of_either_resumes_under_either_bitwise() {
    let whole = run(opts(0), 0..20, None);
    for (first, then) in [(1, 0), (0, 1), (1, 1)] {
        let at_10 = stage_parts(&run(opts(first), 0..10, None));
        let resumed = run(opts(then), 10..20, Some(at_10));
        assert_same_params(&resumed, &whole, &format!("zero {first} then {then}"));
    }
    // Saved from offloaded files, loaded into them.
    let dir = tempfile::tempdir().expect("tmp");
    let at_10 = stage_parts(&run(offloaded(dir.path()), 0..10, None));
    let resumed = run(offloaded(dir.path()), 10..20, Some(at_10));
    assert_same_params(&resumed, &whole, "zero 1 offloaded, then again");
}
