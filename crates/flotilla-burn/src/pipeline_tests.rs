//! A pipeline of a user's modules (2 and 3 stages, 2 stages × 2 replicas, with a skip tensor
//! from stage 0 to the last stage, GPipe and 1F1B) trained on in-memory ranks equals the whole
//! model trained in one process on the same global batch; bad layouts are refused by name.

use std::sync::Arc;
use std::time::Duration;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::momentum::MomentumConfig;
use burn::optim::{GradientsParams, ModuleOptimizer, SgdConfig};
use burn::prelude::*;
use burn::tensor::TensorData;
use burn::tensor::activation::relu;
use flotilla_comm::{CommConfig, Communicator};
use flotilla_engine::ParamLayout;
use flotilla_engine::any_module::read_params;
use flotilla_group::ProcessGroup;

use crate::{LOSS, Pipeline, PipelineOptions, PipelineStage, Result, Schedule, Tensors};

/// Stage 0: a hidden layer, and a skip projection of the input straight to the last stage.
#[derive(Module, Debug)]
struct Front {
    a: Linear,
    s: Linear,
}

/// A middle stage (of three): another hidden layer.
#[derive(Module, Debug)]
struct Middle {
    b: Linear,
}

/// The last stage: (with two stages, the middle layer too) the output layer plus the skip
/// tensor, and the mean squared error against the targets.
#[derive(Module, Debug)]
struct Back {
    b: Option<Linear>,
    c: Linear,
    /// The name under which it takes the skip tensor.
    #[module(skip)]
    skip: String,
}

impl PipelineStage for Front {
    fn inputs(&self) -> Vec<String> {
        vec!["x".into()]
    }
    fn outputs(&self) -> Vec<String> {
        vec!["h".into(), "skip".into()]
    }
    fn forward(&self, mut t: Tensors) -> Result<Tensors> {
        let x = t.take::<2>("x")?;
        let h = relu(self.a.forward(x.clone()));
        Ok(Tensors::new().with("h", h).with("skip", self.s.forward(x)))
    }
}

impl PipelineStage for Middle {
    fn inputs(&self) -> Vec<String> {
        vec!["h".into()]
    }
    fn outputs(&self) -> Vec<String> {
        vec!["h".into()]
    }
    fn forward(&self, mut t: Tensors) -> Result<Tensors> {
        Ok(Tensors::new().with("h", relu(self.b.forward(t.take::<2>("h")?))))
    }
}

impl PipelineStage for Back {
    fn inputs(&self) -> Vec<String> {
        vec!["h".into(), self.skip.clone()]
    }
    fn outputs(&self) -> Vec<String> {
        vec![LOSS.into()]
    }
    fn forward(&self, mut t: Tensors) -> Result<Tensors> {
        let mut h = t.take::<2>("h")?;
        if let Some(b) = &self.b {
            h = relu(b.forward(h));
        }
        let y = self.c.forward(h) + t.take::<2>(&self.skip)?;
        let loss = (y - t.take::<2>("y")?).powf_scalar(2.0).mean();
        Ok(Tensors::new().with(LOSS, loss))
    }
}

/// The whole model in one process.
#[derive(Module, Debug)]
struct Whole {
    front: Front,
    middle: Middle,
    back: Back,
}

impl Whole {
    fn loss(&self, x: Tensor<2>, y: Tensor<2>) -> Tensor<1> {
        let h = relu(self.front.a.forward(x.clone()));
        let h = relu(self.middle.b.forward(h));
        let out = self.back.c.forward(h) + self.front.s.forward(x);
        (out - y).powf_scalar(2.0).mean()
    }
}

const GLOBAL_BATCH: usize = 12;
const STEPS: usize = 8;
const LR: f64 = 0.05;

fn device() -> Device {
    Device::flex().autodiff()
}

/// The whole model from a fixed seed, its parameters drawn now.
fn whole() -> Whole {
    whole_from(7)
}

/// The whole model from `seed`, its parameters drawn now.
fn whole_from(seed: u64) -> Whole {
    let _guard = crate::SEED_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let d = device();
    d.seed(seed);
    let lin = |i, o| LinearConfig::new(i, o).init(&d);
    let w = Whole {
        front: Front {
            a: lin(3, 8),
            s: lin(3, 2),
        },
        middle: Middle { b: lin(8, 8) },
        back: Back {
            b: None,
            c: lin(8, 2),
            skip: "skip".into(),
        },
    };
    params(&w);
    w
}

fn params<M: Module>(m: &M) -> Vec<f32> {
    let layout = ParamLayout::of(m);
    let mut flat = vec![0.0; layout.total];
    read_params(m, &layout, &mut flat).expect("read");
    flat
}

fn sgd() -> ModuleOptimizer {
    SgdConfig::new()
        .with_momentum(Some(MomentumConfig::new().with_momentum(0.9)))
        .init()
}

/// Samples `rows` of step `step`'s global batch: inputs `[n, 3]`, targets `[n, 2]`.
fn batch(step: usize, rows: std::ops::Range<usize>) -> (Tensor<2>, Tensor<2>) {
    let (mut xs, mut ys) = (Vec::new(), Vec::new());
    for i in rows.clone() {
        let t = (step * GLOBAL_BATCH + i) as f32;
        let x = [(t * 0.37).sin(), (t * 0.11).cos(), (t * 0.05).sin() * 2.0];
        xs.extend(x);
        ys.extend([x[0] * x[1] - x[2], x[2].tanh()]);
    }
    let d = device();
    (
        Tensor::from_data(TensorData::new(xs, [rows.len(), 3]), &d),
        Tensor::from_data(TensorData::new(ys, [rows.len(), 2]), &d),
    )
}

/// The whole model trained in one process: final parameters and each step's loss.
fn reference() -> (Vec<f32>, Vec<f32>) {
    let mut model = whole();
    let mut optim = sgd();
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let (x, y) = batch(step, 0..GLOBAL_BATCH);
        let loss = model.loss(x, y);
        losses.push(loss.clone().into_scalar::<f32>());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(LR, model, grads);
    }
    let (x, y) = batch(STEPS, 0..GLOBAL_BATCH);
    losses.push(model.loss(x, y).into_scalar::<f32>());
    (params(&model), losses)
}

fn world(n: usize) -> Vec<Arc<dyn ProcessGroup>> {
    Communicator::in_memory(
        n,
        CommConfig::new(Some(0), n).with_timeout(Duration::from_secs(20)),
    )
    .expect("world")
    .into_iter()
    .map(|c| Arc::new(c) as Arc<dyn ProcessGroup>)
    .collect()
}

/// One rank's result: its stage, replica, final parameters, losses (last stage) and the
/// parameters it started training from (after [`Pipeline::broadcast_model`]).
type RankResult = (usize, usize, Vec<f32>, Vec<f32>, Vec<f32>);

/// The stage modules of `w` for a pipeline of `stages` (2: the middle layer joins the last).
fn stage_modules(w: &Whole, stages: usize) -> (Front, Middle, Back) {
    let (f, m, mut b) = (w.front.clone(), w.middle.clone(), w.back.clone());
    if stages == 2 {
        b.b = Some(m.b.clone());
    }
    (f, m, b)
}

/// The parameters of stage `stage` of `w` in a pipeline of `stages`.
fn stage_params(w: &Whole, stages: usize, stage: usize) -> Vec<f32> {
    let (f, m, b) = stage_modules(w, stages);
    match (stage, stages) {
        (0, _) => params(&f),
        (1, 3) => params(&m),
        _ => params(&b),
    }
}

/// Trains `stage` as this rank's part of the pipeline.
fn train<M: PipelineStage>(
    group: Arc<dyn ProcessGroup>,
    stage: M,
    opts: PipelineOptions,
) -> RankResult {
    let d = device();
    let mut pipe = Pipeline::new(group, &stage, &d, opts).expect("pipeline");
    let mut stage = pipe.broadcast_model(stage).expect("broadcast");
    let started = params(&stage);
    let mut optim = pipe
        .broadcast_optimizer(sgd())
        .expect("broadcast optimizer");
    let per = GLOBAL_BATCH / pipe.replicas();
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let start = pipe.replica() * per;
        let (x, y) = batch(step, start..start + per);
        let b = Tensors::new().with("x", x);
        let t = Tensors::new().with("y", y);
        let out = pipe.step(&stage, b, t).expect("step");
        losses.extend(out.loss);
        stage = optim.step(LR, stage, out.grads);
    }
    // The trained pipeline evaluates a batch it has not seen, forward only.
    let (x, y) = batch(STEPS, 0..GLOBAL_BATCH);
    let (b, t) = (Tensors::new().with("x", x), Tensors::new().with("y", y));
    if let Some(mut out) = pipe.evaluate(&stage, b, t).expect("evaluate") {
        losses.push(out.take::<1>(LOSS).expect("loss").into_scalar::<f32>());
    }
    (
        pipe.stage(),
        pipe.replica(),
        params(&stage),
        losses,
        started,
    )
}

/// Runs a pipeline of `stages` stages on `ranks` in-memory ranks; every rank's result.
/// Replica 0 builds its stages from [`whole`]; every other replica from a model of its own
/// seed, which [`Pipeline::broadcast_model`] must replace with its stage root's.
fn run(ranks: usize, stages: usize, opts: PipelineOptions) -> Vec<RankResult> {
    let handles: Vec<_> = world(ranks)
        .into_iter()
        .map(|g| {
            let (stage, replica) = (g.rank() % stages, g.rank() / stages);
            let w = match replica {
                0 => whole(),
                r => whole_from(100 + r as u64),
            };
            let (f, m, b) = stage_modules(&w, stages);
            let opts = opts.clone();
            std::thread::spawn(move || match (stage, stages) {
                (0, _) => train(g, f, opts),
                (1, 3) => train(g, m, opts),
                _ => train(g, b, opts),
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank"))
        .collect()
}

fn relative_error(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    a.iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
        / scale
}

/// Checks that the pipeline's stages (replica by replica) hold the whole model's parameters
/// and the last stage's losses (each step's, then an evaluation's) are the whole batch's.
fn check(ranks: usize, stages: usize, opts: PipelineOptions) {
    let (want, want_losses) = reference();
    let mut results = run(ranks, stages, opts.clone());
    results.sort_by_key(|r| (r.1, r.0));
    // Every replica started from its stage root's parameters, bit for bit (the other
    // replicas built theirs from other seeds).
    let root = whole();
    for (stage, replica, _, _, started) in &results {
        let want = stage_params(&root, stages, *stage);
        assert!(
            started
                .iter()
                .map(|v| v.to_bits())
                .eq(want.iter().map(|v| v.to_bits())),
            "{opts:?}: stage {stage} of replica {replica} did not start from its root's parameters"
        );
        if *replica > 0 {
            let own = stage_params(&whole_from(100 + *replica as u64), stages, *stage);
            assert!(relative_error(&own, &want) > 1e-2, "the seeds differ");
        }
    }
    for replica in results.chunks(stages) {
        let got: Vec<f32> = replica.iter().flat_map(|r| r.2.clone()).collect();
        let e = relative_error(&got, &want);
        assert!(e <= 1e-5, "{opts:?} on {ranks} ranks: relative error {e}");
        assert!(
            relative_error(&want, &params(&whole())) > 1e-2,
            "the parameters moved"
        );
        let last = &replica[stages - 1];
        if ranks == stages {
            let e = relative_error(&last.3, &want_losses);
            assert!(e <= 1e-5, "losses {:?} against {want_losses:?}", last.3);
        }
    }
}

#[test]
fn two_stages_equal_one_process_gpipe_and_1f1b() {
    for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
        check(2, 2, PipelineOptions::new(2, 4).with_schedule(schedule));
    }
}

#[test]
fn three_stages_with_a_skip_over_the_middle_equal_one_process() {
    for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
        check(3, 3, PipelineOptions::new(3, 5).with_schedule(schedule));
    }
    check(3, 3, PipelineOptions::new(3, 1));
}

#[test]
fn two_stages_times_two_replicas_equal_one_process() {
    for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
        check(4, 2, PipelineOptions::new(2, 3).with_schedule(schedule));
    }
}

#[test]
fn stages_that_do_not_divide_the_ranks_are_refused() {
    let g = world(3).remove(0);
    let e = PipelineOptions::new(2, 2)
        .place(g.as_ref())
        .expect_err("refused");
    assert!(
        e.to_string().contains("2 stages do not divide the 3 ranks"),
        "{e}"
    );
}

#[test]
fn names_that_do_not_meet_are_refused_on_every_rank() {
    let w = whole();
    let handles: Vec<_> = world(2)
        .into_iter()
        .map(|g| {
            let (f, mut b) = (w.front.clone(), w.back.clone());
            b.b = Some(w.middle.b.clone());
            b.skip = "skp".into();
            std::thread::spawn(move || {
                let opts = PipelineOptions::new(2, 2);
                let d = device();
                let r = match g.rank() {
                    0 => Pipeline::new(g, &f, &d, opts).map(|_| ()),
                    _ => Pipeline::new(g, &b, &d, opts).map(|_| ()),
                };
                r.expect_err("refused").to_string()
            })
        })
        .collect();
    for h in handles {
        let e = h.join().expect("rank");
        assert!(
            e.contains("stage 1 takes `skp`, which no earlier stage gives"),
            "{e}"
        );
    }
}

/// Declares `h` and `skip` but gives only `h`.
#[derive(Module, Debug)]
struct Liar {
    a: Linear,
}

impl PipelineStage for Liar {
    fn inputs(&self) -> Vec<String> {
        vec!["x".into()]
    }
    fn outputs(&self) -> Vec<String> {
        vec!["h".into(), "skip".into()]
    }
    fn forward(&self, mut t: Tensors) -> Result<Tensors> {
        Ok(Tensors::new().with("h", self.a.forward(t.take::<2>("x")?)))
    }
}

#[test]
fn a_forward_that_gives_other_names_fails_and_its_consumer_names_it() {
    let w = whole();
    let groups = Communicator::in_memory(
        2,
        CommConfig::new(Some(0), 2).with_timeout(Duration::from_secs(2)),
    )
    .expect("world");
    let handles: Vec<_> = groups
        .into_iter()
        .map(|c| {
            let g = Arc::new(c) as Arc<dyn ProcessGroup>;
            let liar = Liar {
                a: w.front.a.clone(),
            };
            let mut b = w.back.clone();
            b.b = Some(w.middle.b.clone());
            std::thread::spawn(move || {
                let (d, opts) = (device(), PipelineOptions::new(2, 2));
                let (x, y) = batch(0, 0..4);
                let (bt, tt) = (Tensors::new().with("x", x), Tensors::new().with("y", y));
                let e = match g.rank() {
                    0 => Pipeline::new(g, &liar, &d, opts).and_then(|mut p| p.step(&liar, bt, tt)),
                    _ => Pipeline::new(g, &b, &d, opts).and_then(|mut p| p.step(&b, bt, tt)),
                };
                e.map(|_| ()).expect_err("fails").to_string()
            })
        })
        .collect();
    let errors: Vec<String> = handles
        .into_iter()
        .map(|h| h.join().expect("rank"))
        .collect();
    assert!(
        errors[0]
            .contains(r#"stage 0's forward gave ["h"], but it declares the outputs ["h", "skip"]"#),
        "{}",
        errors[0]
    );
    assert!(
        errors[1].contains(
            "rank 0: pipeline stage 1 waited for the activation `h` of micro-batch 0 from stage 0"
        ),
        "{}",
        errors[1]
    );
}

/// One stage whose forward reads its layers in the other order than the module declares
/// them (`b`, then `a`), as `examples/pipeline_model.rs`'s first stage reads its skip layer.
#[derive(Module, Debug)]
struct ReadsBackwards {
    a: Linear,
    b: Linear,
}

impl PipelineStage for ReadsBackwards {
    fn inputs(&self) -> Vec<String> {
        vec!["x".into()]
    }
    fn outputs(&self) -> Vec<String> {
        vec![LOSS.into()]
    }
    fn forward(&self, mut t: Tensors) -> Result<Tensors> {
        let x = t.take::<2>("x")?;
        let late = self.b.forward(x.clone());
        let y = self.a.forward(x) + late;
        let loss = (y - t.take::<2>("y")?).powf_scalar(2.0).mean();
        Ok(Tensors::new().with(LOSS, loss))
    }
}

/// [`ReadsBackwards`] from seed 11, its parameters left lazy (burn draws each when first
/// read). The caller holds [`crate::SEED_LOCK`].
fn lazy_stage() -> ReadsBackwards {
    let d = device();
    d.seed(11);
    let lin = || LinearConfig::new(3, 2).init(&d);
    ReadsBackwards { a: lin(), b: lin() }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Without replicas, a stage trains from the parameters its seed gives in the module's order
/// (those that replicas broadcast, and that a save before training holds), not from those
/// drawn in the order its first forward reads them; and so does a module handed to
/// `broadcast_model` alone.
#[test]
fn a_stage_without_replicas_draws_its_lazy_parameters_in_the_modules_order() {
    let _guard = crate::SEED_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let want = params(&lazy_stage());
    let read_by_forward = lazy_stage();
    let (x, y) = batch(0, 0..4);
    let inputs = Tensors::new().with("x", x.clone()).with("y", y.clone());
    read_by_forward.forward(inputs).expect("forward");
    let (bt, tt) = (Tensors::new().with("x", x), Tensors::new().with("y", y));
    assert_ne!(
        bits(&params(&read_by_forward)),
        bits(&want),
        "the orders differ"
    );
    let stage = lazy_stage();
    let group = world(1).remove(0);
    let mut pipe =
        Pipeline::new(group, &stage, &device(), PipelineOptions::new(1, 2)).expect("pipeline");
    let stage = pipe.broadcast_model(stage).expect("broadcast");
    pipe.step(&stage, bt.clone(), tt.clone()).expect("step");
    assert_eq!(bits(&params(&stage)), bits(&want), "the stage's parameters");
    let fresh = pipe.broadcast_model(lazy_stage()).expect("broadcast");
    pipe.step(&fresh, bt, tt).expect("step");
    assert_eq!(
        bits(&params(&fresh)),
        bits(&want),
        "a fresh module's parameters"
    );
}
