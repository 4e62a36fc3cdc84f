//! ZeRO-1 and ZeRO-2 among a pipeline stage's replicas (`zero.rs`) against zero 0, on 2
//! stages × 2 replicas of threads with Adam: after 20 batches every rank holds zero 0's
//! parameters bit for bit and half its stage's optimizer state (the stage's own optimizer
//! none), and replica 0 puts together the stage's whole state, equal to zero 0's; clipped by
//! the global norm, the three stages still end on the same bits (and not on the unclipped
//! run's); a checkpoint's state written at batch 10 by any resumes under any and ends on the
//! uninterrupted run's bits.

use std::ops::Range;

use flotilla_engine::{FlatOptimizerState, ModelState, StageCut, optimizer_state_bytes};

use super::tests::{
    BATCHES, assert_matches, named, options, reference_clipped, run_model, spec, train_batch,
};
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
    /// Whether its stage held its whole parameters after the last batch.
    held_whole: bool,
}

fn opts(zero: u8) -> PipelineOptions {
    PipelineOptions {
        optimizer: adam(0.02),
        zero,
        ..options(Schedule::OneFOneB, 2, 2)
    }
}

/// `opts(zero)` with one micro-batch a batch (ZeRO-3's sums then come in zero 0's order)
/// and, under ZeRO-3, parameter groups of at most `group_bytes`.
fn one_micro_batch(zero: u8, group_bytes: usize) -> PipelineOptions {
    PipelineOptions {
        micro_batches: 1,
        group_bytes,
        ..opts(zero)
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
    run_cut(&[5], opts, batches, from)
}

/// [`run`] on the cut at `points`.
fn run_cut(
    points: &[usize],
    opts: PipelineOptions,
    batches: Range<usize>,
    from: Option<Vec<Parts>>,
) -> Vec<Ended> {
    let cut = StageCut::at(&spec(), points).expect("cut");
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
                let total = pipe.stage().layout().total;
                let held_whole = pipe.stage().read_params(&mut vec![0.0; total]).is_ok();
                pipe.gather_stage().expect("gather");
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
                    held_whole,
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

/// Each stage's whole optimizer state, as replica 0 puts it together, is the same in `got`
/// and `want`. (The weights' bytes are not compared: their header's keys come in no fixed
/// order.)
fn assert_same_states(got: &[Ended], want: &[Ended]) {
    for (k, (g, w)) in stage_parts(got).iter().zip(stage_parts(want)).enumerate() {
        assert_eq!(
            flat(k, &g[1]),
            flat(k, &w[1]),
            "stage {k}'s optimizer state"
        );
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
fn zero_1_and_2_train_zero_0s_bits_with_half_the_optimizer_state() {
    let (plain, sharded) = (run(opts(0), 0..20, None), run(opts(1), 0..20, None));
    assert_same_params(&sharded, &plain, "zero 1 against zero 0");
    let scattered = run(opts(2), 0..20, None);
    assert_same_params(&scattered, &plain, "zero 2 against zero 0");
    for (s, p) in scattered.iter().zip(&sharded) {
        assert_eq!(
            s.state_bytes, p.state_bytes,
            "zero 2's optimizer shard is zero 1's"
        );
    }
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
    assert_same_states(&sharded, &plain);
}

#[test]
fn a_stage_state_of_either_resumes_under_either_bitwise() {
    let whole = run(opts(0), 0..20, None);
    for (first, then) in [(1, 0), (0, 1), (1, 1), (2, 0), (0, 2), (1, 2)] {
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

#[test]
fn clipped_by_the_global_norm_zero_0_1_and_2_train_one_processs_clipped_run() {
    // SGD (the scale of the step is the clipped gradient's) at a norm every step exceeds.
    let max = 0.05;
    let (initial, want) = reference_clipped(Some(max));
    let (_, unclipped) = reference_clipped(None);
    let moved = want.iter().any(|(name, w)| {
        let gap = |a: &[f32]| {
            w.iter()
                .zip(a)
                .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
        };
        gap(&unclipped[name]) > 1e-3 && gap(&initial[name]) > 1e-3
    });
    assert!(moved, "clipping at {max} changed too little to be seen");
    let clipped = |zero| PipelineOptions {
        clip_grad_norm: Some(max),
        zero,
        ..options(Schedule::OneFOneB, 2, 2)
    };
    let plain = run_model(&spec(), &[5], clipped(0), BATCHES, train_batch);
    assert_matches(&plain, &want, "clipped, zero 0");
    let sorted = |mut e: Vec<super::tests::Ended>| {
        e.sort_by_key(|e| (e.replica, e.stage));
        e
    };
    let plain = sorted(plain);
    for zero in [1, 2] {
        let sharded = sorted(run_model(
            &spec(),
            &[5],
            clipped(zero),
            BATCHES,
            train_batch,
        ));
        for (s, p) in sharded.iter().zip(&plain) {
            for (name, v) in &p.params {
                assert_bitwise(&s.params[name], v, &format!("clipped, zero {zero}: {name}"));
            }
        }
    }
}

/// ZeRO-3 (each replica keeps half of each parameter group, gathers every group for each
/// use and reduce-scatters its gradient): with one micro-batch zero 0's bits, one group or
/// several, with half the optimizer state; a stage state of either resumes under the other
/// on the uninterrupted run's bits.
#[test]
fn zero_3_with_one_micro_batch_trains_zero_0s_bits_and_resumes_either_way() {
    let plain = run(one_micro_batch(0, 0), 0..20, None);
    for (bytes, prefetch) in [(0, true), (1, true), (400, true), (1, false)] {
        let opts = PipelineOptions {
            prefetch,
            ..one_micro_batch(3, bytes)
        };
        let sharded = run(opts, 0..20, None);
        assert_same_params(
            &sharded,
            &plain,
            &format!("zero 3, groups of {bytes} bytes"),
        );
        for (s, p) in sharded.iter().zip(&plain) {
            assert!(
                s.state_bytes * 2 <= p.state_bytes + 8 * 8,
                "{} {}",
                s.state_bytes,
                p.state_bytes
            );
            assert_eq!(s.own_state_bytes, 0, "the stage's own optimizer stepped");
            assert!(
                !s.held_whole && p.held_whole,
                "zero 3's stage holds its shard only"
            );
        }
        assert_same_states(&sharded, &plain);
    }
    // Cut at 9, stage 0 runs in two groups (a forward's prefetched gather feeds stage 1).
    let plain_9 = run_cut(&[9], one_micro_batch(0, 0), 0..20, None);
    for prefetch in [true, false] {
        let opts = PipelineOptions {
            prefetch,
            ..one_micro_batch(3, 1)
        };
        let what = format!("zero 3 cut at 9, prefetch {prefetch}");
        assert_same_params(&run_cut(&[9], opts, 0..20, None), &plain_9, &what);
    }
    for (first, then) in [(3, 0), (0, 3), (3, 3)] {
        let at_10 = stage_parts(&run(one_micro_batch(first, 1), 0..10, None));
        let resumed = run(one_micro_batch(then, 1), 10..20, Some(at_10));
        assert_same_params(&resumed, &plain, &format!("zero {first} then {then}"));
    }
}

/// ZeRO-3 with micro-batches (the replicas' sums before the micro-batches'), GPipe and 1F1B,
/// plain and clipped, trains one process's run (to rounding).
#[test]
fn zero_3_with_micro_batches_trains_one_processs_run() {
    for (schedule, clip) in [(Schedule::OneFOneB, None), (Schedule::GPipe, Some(0.05))] {
        let (_, want) = reference_clipped(clip);
        let opts = PipelineOptions {
            clip_grad_norm: clip,
            zero: 3,
            group_bytes: 1,
            ..options(schedule, 2, 2)
        };
        let ended = run_model(&spec(), &[5], opts, BATCHES, train_batch);
        assert_matches(
            &ended,
            &want,
            &format!("zero 3, {schedule:?}, clip {clip:?}"),
        );
    }
}
