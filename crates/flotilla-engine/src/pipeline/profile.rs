//! Measuring what each layer of a model costs, for [`crate::partition`].
//!
//! A layer does not cost the same alone as inside a stage, but stages add up: measured on the
//! residual CNN (16-sample micro-batches), two halves of the model take what the whole model
//! takes within 3 % (cut at layers 6–21; 9 % at layer 3), while the ReLU and max-pool after the
//! first convolution take 2.4 and 2.7 ms as one-layer stages against about 0.3 ms together
//! inside a stage (a one-layer sum charged the first three layers 2.3x their stage). So the
//! profile times every **prefix** of the model as one stage (layers `0..j`, forward and
//! backward of one micro-batch of deterministic inputs), and a layer's time is the difference
//! of two consecutive prefixes: a range `i..j` then costs `prefix(j) − prefix(i)`, what a stage
//! of those layers computes. Measured against stages timed directly: the stages after cuts at
//! layers 3–12 (6–17 ms) within 0.01–0.75 ms; short stages at the end (1.7 and 4.8 ms) 1.2–1.9
//! ms off.
//!
//! The prefixes are timed **interleaved** — every prefix once per round, after one warm-up
//! round — and each keeps its fastest round: a shared machine's speed drifts by tens of
//! percent from one minute to the next, and timing one prefix after the other would turn that
//! drift into a slope across the layers. Noise can still make a longer prefix look faster
//! than a shorter one; a prefix is never counted faster than the one before it.
//!
//! **Windows.** A model bigger than one rank must not be built whole to be profiled, so the
//! profile builds at most `window_params` parameters at a time (the planner gives a rank's
//! share of the model): a window of consecutive layers, its values drawn as the whole model's
//! would be (`weights::stage_model`, one layer at a time), every prefix of the window built
//! over them (`Weights::part_of`, shared, not copied) and timed as above, then let go before
//! the next window. Each window after the first starts at the last layer of the one before
//! (its *base*, timed but not counted), so every layer but the first is still costed as the
//! difference of two prefixes inside a stage, never alone. Windows are timed one after the
//! other, so drift between windows is not evened out. The cost is `w (w + 1) / 2` layer passes
//! per round and window (`w` layers), fewer than the whole model's `n (n + 1) / 2`.
//!
//! Memory per layer: parameters, their gradient and the optimizer's state
//! (`4 × params × (2 + slots)` bytes, the parameters counted from the spec); activations: the
//! layer's output for the micro-batch (`4 × numel × samples` bytes), what backward keeps of
//! it. This is an estimate of what the stage holds (burn may keep more intermediate values
//! inside a layer), and is printed as such.

use std::ops::Range;
use std::time::Instant;

use crate::error::Result;
use crate::optim::OptimizerSpec;
use crate::pipeline::cut::StageCut;
use crate::pipeline::partition::LayerCost;
use crate::pipeline::stage::Stage;
use crate::pipeline::stage_engine::StageEngine;
use crate::spec::ModelSpec;
use crate::weights::{Weights, stage_model};

/// Per-layer costs of `spec` for micro-batches of `samples`, on the named device, from
/// `rounds` timed rounds (at least 1) over every prefix of each window of at most
/// `window_params` parameters (`u64::MAX`: the whole model in one window; a window always
/// holds at least one layer after its base).
pub fn profile(
    spec: &ModelSpec,
    optimizer: &OptimizerSpec,
    device: &str,
    (samples, rounds): (usize, usize),
    window_params: u64,
) -> Result<Vec<LayerCost>> {
    let io = spec.infer_io()?;
    let params = spec.layer_param_counts()?;
    let samples = samples.max(1);
    // A head tied to the embedding needs layer 0's table: one window (a pipeline refuses
    // such a model anyway, `stage.rs::stage_range`).
    let windows = match spec.ties_embedding() {
        true => windows(&params, u64::MAX),
        false => windows(&params, window_params),
    };
    let mut times = vec![0.0; params.len()];
    for window in windows {
        let (base, end) = (window.start, window.end);
        let fastest = time_window(spec, optimizer, device, (samples, rounds), window)?;
        // The window's layers after its base (from layer 0 in the first window).
        let first = usize::from(base > 0);
        for k in first..end - base {
            times[base + k] = fastest[k + 1] - fastest[k];
        }
    }
    Ok((params.iter().zip(&io).zip(times))
        .map(|((&params, (_, output)), time_s)| LayerCost {
            time_s,
            fixed_bytes: 4 * params * (2 + optimizer.state_slots()),
            activation_bytes: 4 * (output.numel() * samples) as u64,
            params,
            gathered_bytes: 0,
        })
        .collect())
}

/// The windows over layers of `params` parameters: each holds at most `budget` parameters
/// (or its base and one more layer, when that is more) and starts at the last layer of the
/// one before; together they count every layer once.
fn windows(params: &[u64], budget: u64) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut counted) = (0, 0);
    while counted < params.len() {
        let mut end = counted + 1;
        let mut held: u64 = params[start..end].iter().sum();
        while end < params.len() && held.saturating_add(params[end]) <= budget {
            held += params[end];
            end += 1;
        }
        out.push(start..end);
        (start, counted) = (end - 1, end);
    }
    out
}

/// The fastest seconds of every prefix of `window` (index `k`: layers `window.start..start +
/// k`, 0 at `k = 0`), never less than the one before: the window's values drawn once, each
/// prefix built over them and timed interleaved over `rounds` rounds after a warm-up round.
fn time_window(
    spec: &ModelSpec,
    optimizer: &OptimizerSpec,
    device: &str,
    (samples, rounds): (usize, usize),
    window: Range<usize>,
) -> Result<Vec<f64>> {
    let (n, base) = (spec.layers.len(), window.start);
    let model = stage_model(spec, 0, window.clone())?;
    // Only the model's first stage takes token ids.
    let vocab = spec.token_vocab().filter(|_| base == 0);
    let mut prefixes = Vec::with_capacity(window.len());
    for j in base + 1..=window.end {
        // The prefix as a stage, with the layers before and after it as the others.
        let ranges = [0..base, base..j, j..n];
        let ranges: Vec<_> = ranges.into_iter().filter(|r| !r.is_empty()).collect();
        let cut = StageCut::new(spec, ranges)?;
        let weights = Weights::part_of(&model, spec, optimizer, device, base..j)?;
        let mut stage = Stage::of_weights(spec, &cut, usize::from(base > 0), weights)?;
        // Its gradient is made by each pass and let go after it (`pass`).
        stage.drop_grads();
        let inputs = sample_inputs(&stage, samples, vocab);
        prefixes.push((stage, inputs));
    }
    let mut fastest = vec![f64::INFINITY; window.len() + 1];
    fastest[0] = 0.0;
    for round in 0..=rounds.max(1) {
        for (k, (stage, inputs)) in prefixes.iter_mut().enumerate() {
            let t = pass(stage, inputs, samples, round)?;
            // Round 0 warms up (allocations, first use of every kernel) and is not counted.
            if round > 0 {
                fastest[k + 1] = fastest[k + 1].min(t);
            }
        }
    }
    for k in 1..fastest.len() {
        fastest[k] = fastest[k].max(fastest[k - 1]);
    }
    Ok(fastest)
}

/// Deterministic inputs for every input slot of `stage` (stage 0 of a model of `vocab`
/// tokens takes token ids).
fn sample_inputs(stage: &Stage, samples: usize, vocab: Option<usize>) -> Vec<Vec<f32>> {
    stage
        .inputs()
        .iter()
        .map(|slot| {
            (0..slot.shape.numel() * samples)
                .map(|k| match vocab {
                    Some(v) => (k * 31 % 97 % v) as f32,
                    None => ((k * 31 % 97) as f32 / 48.0) - 1.0,
                })
                .collect()
        })
        .collect()
}

/// Seconds of one forward and backward of `stage` on `samples` samples (micro-batch `mb`).
fn pass(stage: &mut Stage, inputs: &[Vec<f32>], samples: usize, mb: usize) -> Result<f64> {
    let refs: Vec<&[f32]> = inputs.iter().map(Vec::as_slice).collect();
    let started = Instant::now();
    let outputs = stage.forward(mb, samples, &refs)?;
    let grads = outputs
        .iter()
        .map(|o| vec![1.0 / o.len() as f32; o.len()])
        .collect();
    stage.backward(mb, grads)?;
    let t = started.elapsed().as_secs_f64();
    stage.reset();
    // One prefix's gradient at a time, not every prefix's kept between rounds.
    stage.drop_grads();
    Ok(t)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::DecayParams;

    #[test]
    fn every_layer_gets_a_positive_time_and_its_memory() {
        let spec = ModelSpec::builtin("lenet5").expect("lenet5");
        let sgd = OptimizerSpec::Sgd {
            lr: 0.1,
            momentum: 0.9,
            dampening: 0.0,
            nesterov: false,
            weight_decay: 0.0,
            decay_params: DecayParams::All,
        };
        let costs = profile(&spec, &sgd, "flex", (8, 2), u64::MAX).expect("profile");
        assert_eq!(costs.len(), spec.layers.len());
        assert!(costs.iter().all(|c| c.time_s >= 0.0));
        assert!(costs.iter().map(|c| c.time_s).sum::<f64>() > 0.0);
        // LeNet-5's 61,706 parameters, each counted once, in its own layer.
        assert_eq!(costs.iter().map(|c| c.params).sum::<u64>(), 61_706);
        // Layer 0: conv 1→6, 5×5 with bias = 156 parameters; ×4 bytes × (value, gradient,
        // momentum). Its output: 6×28×28 per sample.
        assert_eq!(costs[0].fixed_bytes, 156 * 4 * 3);
        assert_eq!(costs[0].activation_bytes, 6 * 28 * 28 * 8 * 4);
        // A ReLU has no parameters.
        assert_eq!(costs[1].fixed_bytes, 0);
    }

    #[test]
    fn windows_count_every_layer_once_each_after_the_one_before() {
        let params = [10, 0, 40, 0, 40, 0, 5, 100, 1];
        // The whole model in one window.
        assert_eq!(
            windows(&params, u64::MAX),
            std::iter::once(0..9).collect::<Vec<_>>()
        );
        let w = windows(&params, 50);
        assert_eq!(w, vec![0..4, 3..7, 6..8, 7..9]);
        // A window holds at most the budget, or its base and one more layer.
        for r in &w {
            let held: u64 = params[r.clone()].iter().sum();
            assert!(held <= 50 || r.len() <= 2, "{r:?} holds {held}");
        }
        // Each starts at the last layer of the one before; the counted layers tile 0..9.
        for pair in w.windows(2) {
            assert_eq!(pair[1].start, pair[0].end - 1);
        }
        assert_eq!(w.last().map(|r| r.end), Some(9));
        assert_eq!(windows(&[], 5), Vec::<Range<usize>>::new());
    }

    /// The residual CNN in windows of a fifth of its parameters: stages that start inside
    /// the model take its skip tensors as inputs; each window's prefixes are built and timed
    /// as stages (an error fails the test), and the costs are one window's layer for layer.
    #[test]
    fn windows_give_the_same_layers_and_memory_as_the_whole_model() {
        let spec = ModelSpec::builtin("resnet-bn").expect("resnet-bn");
        let adam = OptimizerSpec::default();
        let whole = profile(&spec, &adam, "flex", (2, 1), u64::MAX).expect("whole");
        let total = spec.param_count().expect("count");
        let params = spec.layer_param_counts().expect("counts");
        assert!(
            windows(&params, total / 5).len() > 2,
            "the model is profiled in windows"
        );
        let split = profile(&spec, &adam, "flex", (2, 1), total / 5).expect("windows");
        assert_eq!(whole.len(), split.len());
        for (a, b) in whole.iter().zip(&split) {
            assert_eq!((a.params, a.fixed_bytes), (b.params, b.fixed_bytes));
            assert_eq!(a.activation_bytes, b.activation_bytes);
        }
        // Every layer that computes was timed, in whichever window.
        assert!(split.iter().all(|c| c.time_s >= 0.0));
        assert!(split.iter().map(|c| c.time_s).sum::<f64>() > 0.0);
    }
}
