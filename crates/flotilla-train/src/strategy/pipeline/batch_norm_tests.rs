//! Batch norm in a pipeline's stages with replicas (2 stages × 2 replicas of threads): each
//! replica's forwards update its stage's running statistics from its own samples, so they
//! differ after training; an evaluation first replaces them, in every replica of a stage,
//! with their mean over the replicas ([`Pipeline::average_buffers`]), as sync all-reduce
//! peers average theirs. Under ZeRO-3 the stage's backward recomputes each group's forward,
//! whose second update of the statistics is undone: the statistics, parameters and
//! checkpoint are zero 0's, bit for bit.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use flotilla_engine::{ModelSpec, ModelState, StageCut};

use super::tests::{named, options, train_batch};
use super::{Pipeline, PipelineOptions, Schedule, state};
use crate::testkit::{adam, assert_bitwise, checkpoint_at, tensor_bytes, world};

/// A batch norm in each of the two stages (cut at layer 3), on the 12 inputs of
/// `tests.rs`'s batches.
fn spec() -> ModelSpec {
    ModelSpec::from_yaml(
        "input: [12]\nlayers:\n  - linear: {out: 8}\n  - batch_norm\n  - relu\n  \
         - linear: {out: 8}\n  - batch_norm\n  - linear: {out: 3}\n",
        "pipeline-bn",
    )
    .expect("spec")
}

fn buffers(model: &dyn ModelState) -> Vec<f32> {
    let mut b = vec![0.0; model.buffer_layout().total];
    model.read_buffers(&mut b).expect("buffers");
    b
}

/// What a rank ends with: its stage, its replica, its statistics before and after the
/// evaluation.
type Ended = (usize, usize, Vec<f32>, Vec<f32>);

#[test]
fn an_evaluation_averages_each_stages_running_statistics_over_its_replicas() {
    let cut = StageCut::at(&spec(), &[3]).expect("cut");
    let handles: Vec<_> = world(4)
        .into_iter()
        .map(|group| {
            let cut = cut.clone();
            std::thread::spawn(move || {
                let opts = options(Schedule::OneFOneB, 2, 2);
                let mut pipe = Pipeline::new(&spec(), cut, opts, group).expect("pipeline");
                for b in 0..3 {
                    train_batch(&mut pipe, b);
                }
                let before = buffers(pipe.stage());
                let images: Vec<f32> = (0..8 * 12).map(|i| (i % 7) as f32 / 7.0).collect();
                let labels: Vec<i64> = (0..8).map(|i| i % 3).collect();
                pipe.evaluate(&images, &labels, 8).expect("evaluate");
                let after = buffers(pipe.stage());
                (pipe.stage_index(), pipe.replica(), before, after)
            })
        })
        .collect();
    let mut ended: Vec<Ended> = handles
        .into_iter()
        .map(|h| h.join().expect("rank thread"))
        .collect();
    ended.sort_by_key(|e| (e.0, e.1));
    for stage in ended.chunks(2) {
        let [(s, _, a, a_after), (_, _, b, b_after)] = stage else {
            panic!("two replicas a stage");
        };
        assert!(!a.is_empty(), "stage {s} keeps statistics");
        assert_ne!(
            a, b,
            "stage {s}: the replicas' own samples gave different statistics"
        );
        let mean: Vec<f32> = a.iter().zip(b).map(|(x, y)| (x + y) * 0.5).collect();
        assert_bitwise(a_after, &mean, &format!("stage {s}, replica 0"));
        assert_bitwise(b_after, &mean, &format!("stage {s}, replica 1"));
    }
}

/// What a rank of [`run_sharded`] ends with: its stage and replica, its statistics after
/// training and after an evaluation, and its stage's parameters by name.
struct Trained {
    at: (usize, usize),
    trained: Vec<f32>,
    evaluated: Vec<f32>,
    params: Vec<(String, Vec<f32>)>,
}

/// 4 batches on 2 stages (cut at layer 3) × 2 replicas with Adam and one micro-batch at
/// ZeRO `zero` in groups of at most `group_bytes`, an evaluation, then a checkpoint into
/// `out` (whose directory rank 0 returns).
fn run_sharded(zero: u8, group_bytes: usize, out: &Path) -> (Vec<Trained>, PathBuf) {
    let cut = StageCut::at(&spec(), &[3]).expect("cut");
    let handles: Vec<_> = world(4)
        .into_iter()
        .map(|group| {
            let (cut, out) = (cut.clone(), out.to_path_buf());
            std::thread::spawn(move || {
                let opts = PipelineOptions {
                    optimizer: adam(0.02),
                    zero,
                    micro_batches: 1,
                    group_bytes,
                    ..options(Schedule::OneFOneB, 1, 2)
                };
                let mut pipe = Pipeline::new(&spec(), cut, opts, group).expect("pipeline");
                (0..4).for_each(|b| {
                    train_batch(&mut pipe, b);
                });
                let trained = buffers(pipe.stage());
                let images: Vec<f32> = (0..8 * 12).map(|i| (i % 5) as f32 / 5.0).collect();
                let labels: Vec<i64> = (0..8).map(|i| i % 3).collect();
                pipe.evaluate(&images, &labels, 8).expect("evaluate");
                let evaluated = buffers(pipe.stage());
                let saved =
                    state::save(&mut pipe, &out, &checkpoint_at(4, "pipeline-bn")).expect("save");
                pipe.gather_stage().expect("gather");
                let mut params: Vec<_> = named(pipe.stage()).into_iter().collect();
                params.sort_by(|a, b| a.0.cmp(&b.0));
                let at = (pipe.stage_index(), pipe.replica());
                let ended = Trained {
                    at,
                    trained,
                    evaluated,
                    params,
                };
                (ended, saved)
            })
        })
        .collect();
    let (mut ended, mut dir) = (Vec::new(), None);
    for h in handles {
        let (e, d) = h.join().expect("rank thread");
        ended.push(e);
        dir = dir.or(d);
    }
    ended.sort_by_key(|e| e.at);
    (ended, dir.expect("rank 0's checkpoint"))
}

#[test]
fn zero_3_stages_with_batch_norm_keep_zero_0s_statistics_parameters_and_checkpoint() {
    let dir = tempfile::tempdir().expect("dir");
    let (plain, plain_dir) = run_sharded(0, 0, &dir.path().join("zero0"));
    let plain_file = tensor_bytes(&plain_dir.join("model.safetensors"));
    let stats = plain_file.keys().filter(|n| n.contains("running")).count();
    assert_eq!(stats, 4, "the checkpoint holds 2 batch norms' statistics");
    for bytes in [0, 1] {
        let what = format!("zero 3 in groups of {bytes} bytes");
        let (sharded, sharded_dir) = run_sharded(3, bytes, &dir.path().join(format!("z{bytes}")));
        for (s, p) in sharded.iter().zip(&plain) {
            assert_eq!(s.at, p.at);
            let at = format!("{what}, stage {:?}", s.at);
            assert!(!p.trained.is_empty(), "{at} keeps statistics");
            assert_bitwise(&s.trained, &p.trained, &format!("{at}: trained statistics"));
            assert_bitwise(&s.evaluated, &p.evaluated, &format!("{at}: averaged"));
            for ((name, g), (_, w)) in s.params.iter().zip(&p.params) {
                assert_bitwise(g, w, &format!("{at}: {name}"));
            }
        }
        let file = tensor_bytes(&sharded_dir.join("model.safetensors"));
        let names = |f: &BTreeMap<String, Vec<u8>>| f.keys().cloned().collect::<Vec<_>>();
        assert_eq!(
            names(&file),
            names(&plain_file),
            "{what}: the checkpoint's tensors"
        );
        for (name, bytes) in &file {
            let same = plain_file.get(name) == Some(bytes);
            assert!(same, "{what}: the checkpoint's {name} is not zero 0's");
        }
    }
}
