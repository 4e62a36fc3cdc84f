//! A sharded stage (`pipeline/stage/sharded.rs`) against the same stage holding its
//! parameters: two micro-batches in flight, then their backwards; the outputs, the input
//! slots' gradients, the loss and the parameters' gradients bit for bit, with dropout, skip
//! tensors crossing the stage's ends, one group and several; the gathers one per group per
//! pass, and none of the parameters left in the stage.

use std::ops::Range;

use crate::StageSeed;
use crate::sharded_tests::{bits, specs};
use crate::{ModelSpec, ModelState, ShardedPass, Stage, StageCut, StageEngine};

const SEED: u64 = 23;

/// A rank that holds every value itself: gathers copy, gradients add up.
struct Local {
    params: Vec<f32>,
    grads: Vec<f32>,
    offsets: Vec<usize>,
    gathers: Vec<Range<usize>>,
}

impl ShardedPass for Local {
    fn gather(&mut self, params: Range<usize>, out: &mut [f32]) -> crate::Result<()> {
        let at = self.offsets[params.start];
        out.copy_from_slice(&self.params[at..at + out.len()]);
        self.gathers.push(params);
        Ok(())
    }

    fn ready(&mut self, param: usize, grad: &[f32]) -> crate::Result<()> {
        let at = self.offsets[param];
        for (a, g) in self.grads[at..at + grad.len()].iter_mut().zip(grad) {
            *a += g;
        }
        Ok(())
    }
}

/// A micro-batch's inputs for `stage` (`n` samples; token ids on a first stage of tokens).
fn inputs(stage: &dyn StageEngine, n: usize, salt: usize, vocab: Option<usize>) -> Vec<Vec<f32>> {
    (stage.inputs().iter())
        .map(|slot| {
            let len = n * slot.shape.numel();
            (0..len)
                .map(|i| match (vocab, stage.index()) {
                    (Some(v), 0) => ((i * 7 + salt) % v) as f32,
                    _ => (((i * 37 + salt * 11) % 101) as f32 / 50.0) - 1.0,
                })
                .collect()
        })
        .collect()
}

/// What a stage's two micro-batches end with: every output, input gradient and loss, then
/// the parameters' gradients.
fn run(
    stage: &mut dyn StageEngine,
    mut pass: Option<&mut Local>,
    vocab: Option<usize>,
) -> Vec<Vec<f32>> {
    let n = 3;
    let mut seen = Vec::new();
    for mb in 0..2 {
        stage.set_dropout_seed(100 + mb as u64);
        let x = inputs(stage, n, mb, vocab);
        let refs: Vec<&[f32]> = x.iter().map(Vec::as_slice).collect();
        seen.extend(
            match pass.as_deref_mut() {
                Some(p) => stage.forward_sharded(mb, n, &refs, p),
                None => stage.forward(mb, n, &refs),
            }
            .expect("forward"),
        );
    }
    for mb in 0..2 {
        let labels_per = match stage.outputs()[0].shape {
            crate::Shape::Seq { t, .. } => t,
            _ => 1,
        };
        let labels: Vec<i64> = (0..n * labels_per).map(|i| ((i + mb) % 2) as i64).collect();
        let grads: Vec<Vec<f32>> = (stage.outputs().iter())
            .map(|s| {
                (0..n * s.shape.numel())
                    .map(|i| ((i + mb) % 5) as f32 * 0.1)
                    .collect()
            })
            .collect();
        let (loss, back) = match (pass.as_deref_mut(), stage.is_last()) {
            (Some(p), true) => {
                let seed = StageSeed::Loss {
                    labels: &labels,
                    weight: 0.5,
                };
                stage.backward_sharded(mb, seed, p).expect("backward")
            }
            (Some(p), false) => stage
                .backward_sharded(mb, StageSeed::Grads(grads), p)
                .expect("backward"),
            (None, true) => {
                let (l, g) = stage.backward_loss(mb, &labels, 0.5).expect("backward");
                (Some(l), g)
            }
            (None, false) => (None, stage.backward(mb, grads).expect("backward")),
        };
        seen.extend(back);
        seen.extend(loss.map(|l| vec![l]));
    }
    seen.push(match pass {
        Some(p) => p.grads.clone(),
        None => stage.grads_mut().to_vec(),
    });
    seen
}

/// Stage `index` of `spec` cut at `points`, built the same way twice.
fn stage(spec: &ModelSpec, points: &[usize], index: usize) -> Stage {
    let cut = StageCut::at(spec, points).expect("cut");
    Stage::new(
        spec,
        &cut,
        index,
        &crate::engine_tests::sgd(0.1, 0.0),
        "flex",
        SEED,
    )
    .expect("stage")
}

/// The plain stage and the sharded one (groups of at most `bytes`) give the same bits;
/// returns the sharded pass's gathers.
fn compare(spec: &ModelSpec, points: &[usize], index: usize, bytes: usize) -> Vec<Range<usize>> {
    let what = format!(
        "{} stage {index} of cut {points:?}, groups of {bytes} bytes",
        spec.name
    );
    let make = || -> Box<dyn StageEngine> { Box::new(stage(spec, points, index)) };
    compare_stages(make, bytes, spec.token_vocab(), &what)
}

/// [`compare`] for the stages `make` builds (the same each time).
fn compare_stages(
    make: impl Fn() -> Box<dyn StageEngine>,
    bytes: usize,
    vocab: Option<usize>,
    what: &str,
) -> Vec<Range<usize>> {
    let mut plain = make();
    let want = run(&mut *plain, None, vocab);
    let mut sharded = make();
    sharded.set_group_bytes(bytes).expect("groups");
    let layout = sharded.layout().clone();
    let mut params = vec![0.0; layout.total];
    sharded.read_params(&mut params).expect("read");
    sharded.release_params().expect("release");
    let mut pass = Local {
        grads: vec![0.0; params.len()],
        params,
        offsets: layout.params.iter().map(|p| p.offset).collect(),
        gathers: Vec::new(),
    };
    let got = run(&mut *sharded, Some(&mut pass), vocab);
    assert_eq!(got.len(), want.len(), "{what}");
    for (k, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(bits(g), bits(w), "{what}: value {k}");
    }
    assert!(
        sharded.read_params(&mut vec![0.0; layout.total]).is_err(),
        "{what}: released"
    );
    assert_eq!(sharded.in_flight(), 0, "{what}");
    pass.gathers
}

#[test]
fn a_sharded_stage_gives_the_stages_outputs_and_gradients_bit_for_bit() {
    let mut seen_groups = 0;
    for (name, spec) in specs() {
        if name == "gpt-tied" {
            continue; // A pipeline refuses a tied head.
        }
        let n = spec.layers.len();
        for points in [vec![n / 2], vec![n / 3, 2 * n / 3]] {
            for index in 0..=points.len() {
                for bytes in [0, 1] {
                    let gathers = compare(&spec, &points, index, bytes);
                    let groups = stage(&spec, &points, index);
                    let mut groups = groups;
                    groups.set_group_bytes(bytes).expect("groups");
                    let g = groups.param_groups();
                    // Forward twice (two micro-batches), backward twice: each group four
                    // times, forward in layer order and backward from the last.
                    assert_eq!(gathers.len(), 4 * g.len(), "{name} {points:?} {index}");
                    assert_eq!(&gathers[..g.len()], &g[..], "{name}: forward order");
                    let back: Vec<_> = g.iter().rev().cloned().collect();
                    assert_eq!(&gathers[2 * g.len()..3 * g.len()], &back[..], "{name}");
                    seen_groups = seen_groups.max(g.len());
                }
            }
        }
    }
    assert!(
        seen_groups >= 3,
        "some stage ran in several groups ({seen_groups})"
    );
}

/// A program's stage modules (a skip from the first straight to the last) run sharded as
/// one group each: the plain stage's bits, each module gathered once a pass.
#[test]
fn a_programs_stage_module_runs_sharded_as_one_group_bit_for_bit() {
    use super::module_stage_tests::{INPUT, back, front, middle};
    for index in 0..3 {
        let make = || {
            let builders = [front(), middle(), back()];
            let optimizer = crate::engine_tests::sgd(0.1, 0.0);
            crate::module_pipeline(&builders, INPUT, index, &optimizer, "flex", SEED)
                .expect("stage")
                .1
        };
        let gathers = compare_stages(make, 1, None, &format!("stage module {index}"));
        assert_eq!(
            gathers.len(),
            4,
            "stage module {index}: one group, four passes"
        );
    }
}

/// A stage drawn released ([`Stage::new_released`], ZeRO-3's start) hands its sink the
/// values the whole stage starts with, in flat order, after the plan of its groups (last
/// first), holds none of them, and, gathered from those values, runs the whole stage's bits.
#[test]
fn a_released_stage_draws_the_whole_stages_values_one_layer_at_a_time() {
    use crate::sharded_tests::Everything;
    for (name, spec) in specs() {
        if name == "gpt-tied" {
            continue; // A pipeline refuses a tied head.
        }
        let n = spec.layers.len();
        let points = [n / 3, 2 * n / 3];
        let cut = StageCut::at(&spec, &points).expect("cut");
        for (index, bytes) in [(0, 0), (1, 1), (2, 1)] {
            let what = format!("{name} stage {index}, groups of {bytes} bytes");
            let mut whole = stage(&spec, &points, index);
            whole.set_group_bytes(bytes).expect("groups");
            let mut expected = vec![0.0; whole.layout().total];
            whole.read_params(&mut expected).expect("params");
            let mut sink = Everything::default();
            let optimizer = crate::engine_tests::sgd(0.1, 0.0);
            let mut released = Stage::new_released(
                &spec,
                (&cut, index),
                &optimizer,
                ("flex", SEED),
                bytes,
                &mut sink,
            )
            .expect("released stage");
            assert_eq!(bits(&sink.values), bits(&expected), "{what}: the values");
            let count = whole.layout().params.len();
            let flat: Vec<usize> = (0..count).collect();
            assert_eq!(sink.params, flat, "{what}: flat order");
            let mut groups = whole.param_groups();
            assert_eq!(released.param_groups(), groups, "{what}: the groups");
            groups.reverse();
            assert_eq!(sink.groups, groups, "{what}: planned last first");
            assert_eq!(released.layout(), whole.layout(), "{what}: the layout");
            let mut out = vec![0.0; expected.len()];
            assert!(released.read_params(&mut out).is_err(), "{what}: held");
            let want = run(&mut whole, None, spec.token_vocab());
            let mut pass = Local {
                grads: vec![0.0; expected.len()],
                offsets: whole.layout().params.iter().map(|p| p.offset).collect(),
                params: expected,
                gathers: Vec::new(),
            };
            let got = run(&mut released, Some(&mut pass), spec.token_vocab());
            for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(bits(g), bits(w), "{what}: value {k}");
            }
        }
    }
}
