//! Measuring what each layer of a model costs, for [`crate::partition`].
//!
//! A layer does not cost the same alone as inside a stage, but stages add up: measured on the
//! residual CNN (16-sample micro-batches), two halves of the model take what the whole model
//! takes within 3 % (cut at layers 6–21; 9 % at layer 3), while the ReLU and max-pool after
//! the first convolution take 2.4 and 2.7 ms as one-layer stages against about 0.3 ms
//! together inside a stage (a one-layer sum charged the first three layers 2.3x their stage). So the profile times every **prefix**
//! of the model as one stage (layers `0..j`, forward and backward of one micro-batch of
//! deterministic inputs), and a layer's time is the difference of two consecutive prefixes:
//! a range `i..j` then costs `prefix(j) − prefix(i)`, what a stage of those layers computes.
//! Measured against stages timed directly: the stages after cuts at layers 3–12 (6–17 ms)
//! within 0.01–0.75 ms; short stages at the end (1.7 and 4.8 ms) 1.2–1.9 ms off.
//!
//! The prefixes are timed **interleaved** — every prefix once per round, after one warm-up
//! round — and each keeps its fastest round: a shared machine's speed drifts by tens of
//! percent from one minute to the next, and timing one prefix after the other would turn that
//! drift into a slope across the layers. Noise can still make a longer prefix look faster
//! than a shorter one; a prefix is never counted faster than the one before it.
//!
//! The cost is `n (n + 1) / 2` layer passes per round (`n` layers); every prefix stage is
//! built once and kept for the rounds, all of them over one model's parameter values
//! (`Weights::prefix_of`).
//!
//! Memory per layer: parameters, their gradient and the optimizer's state
//! (`4 × params × (2 + slots)` bytes); activations: the layer's output for the micro-batch
//! (`4 × numel × samples` bytes), what backward keeps of it. This is an estimate of what the
//! stage holds (burn may keep more intermediate values inside a layer), and is printed as such.

use std::time::Instant;

use crate::error::Result;
use crate::optim::OptimizerSpec;
use crate::pipeline::cut::StageCut;
use crate::pipeline::partition::LayerCost;
use crate::pipeline::stage::Stage;
use crate::pipeline::stage_engine::StageEngine;
use crate::spec::ModelSpec;
use crate::weights::{ModelState, Weights, initial_model};

/// Per-layer costs of `spec` for micro-batches of `samples`, on the named device, from
/// `rounds` timed rounds over every prefix (at least 1).
pub fn profile(
    spec: &ModelSpec,
    optimizer: &OptimizerSpec,
    device: &str,
    samples: usize,
    rounds: usize,
) -> Result<Vec<LayerCost>> {
    let n = spec.layers.len();
    let io = spec.infer_io()?;
    let samples = samples.max(1);
    // Every prefix shares this model's values: the profile holds them once, not once per
    // prefix (n / 2 times the model).
    let whole = initial_model(spec, 0)?;
    let mut prefixes = Vec::with_capacity(n);
    for j in 1..=n {
        // One stage of the whole model, or the prefix and the rest.
        let ranges: Vec<_> = if j == n {
            std::iter::once(0..n).collect()
        } else {
            vec![0..j, j..n]
        };
        let cut = StageCut::new(spec, ranges)?;
        let weights = Weights::prefix_of(&whole, spec, optimizer, device, j)?;
        let mut stage = Stage::of_weights(spec, &cut, 0, weights)?;
        // Its gradient is made by each pass and let go after it (`pass`).
        stage.drop_grads();
        let inputs = sample_inputs(&stage, samples, spec.token_vocab());
        prefixes.push((stage, inputs));
    }
    // fastest[j]: seconds of the prefix of layers 0..j (fastest[0] = 0, no layer).
    let mut fastest = vec![f64::INFINITY; n + 1];
    fastest[0] = 0.0;
    for round in 0..=rounds.max(1) {
        for (j, (stage, inputs)) in prefixes.iter_mut().enumerate() {
            let t = pass(stage, inputs, samples, round)?;
            // Round 0 warms up (allocations, first use of every kernel) and is not counted.
            if round > 0 {
                fastest[j + 1] = fastest[j + 1].min(t);
            }
        }
    }
    for j in 1..=n {
        fastest[j] = fastest[j].max(fastest[j - 1]);
    }
    let mut costs = Vec::with_capacity(n);
    let mut params_before = 0u64;
    for (i, (_, output)) in io.iter().enumerate() {
        let params_through = prefixes[i].0.num_params() as u64;
        let params = params_through.saturating_sub(params_before);
        params_before = params_through;
        costs.push(LayerCost {
            time_s: fastest[i + 1] - fastest[i],
            fixed_bytes: 4 * params * (2 + optimizer.state_slots()),
            activation_bytes: 4 * (output.numel() * samples) as u64,
            params,
            gathered_bytes: 0,
        });
    }
    Ok(costs)
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
        let costs = profile(&spec, &sgd, "flex", 8, 2).expect("profile");
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
}
