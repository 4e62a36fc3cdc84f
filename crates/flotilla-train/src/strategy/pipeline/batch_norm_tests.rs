//! Batch norm in a pipeline's stages with replicas (2 stages × 2 replicas of threads): each
//! replica's forwards update its stage's running statistics from its own samples, so they
//! differ after training; an evaluation first replaces them, in every replica of a stage,
//! with their mean over the replicas ([`Pipeline::average_buffers`]), as sync all-reduce
//! peers average theirs.

use flotilla_engine::{ModelSpec, ModelState, StageCut};

use super::tests::{options, train_batch};
use super::{Pipeline, Schedule};
use crate::testkit::{assert_bitwise, world};

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
