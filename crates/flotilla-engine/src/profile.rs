//! Measuring what each layer of a model costs, for [`crate::partition`]: each layer runs as a
//! one-layer [`Stage`] on a micro-batch of deterministic inputs, forward and backward, and the
//! fastest of a few timed repetitions (after one warm-up) is its time: the work is
//! deterministic, so the fastest run is the least disturbed one.
//!
//! Layer times do not add up to a stage's. Measured on the residual CNN (16-sample
//! micro-batches, fastest of 20): stages are additive (two halves sum to the whole model
//! within 3 %), but the ReLU and max-pool after the first convolution take 2.4 and 2.7 ms
//! alone against about 0.3 ms together inside a stage, so the first three layers sum to 2.3x
//! their stage while the last layers sum to 1.05–1.1x theirs. Only part of the difference is
//! a one-layer stage's edge work (1.5 ms to take in and give out a 16×28×28 activation);
//! taking it out did not make the sums additive, and timing every prefix of the model instead
//! suffered from this machine's drift (the same stage measured 30 % apart a minute later).
//! The partition's balance is therefore also measured in the running pipeline (`flotilla
//! bench pipeline`, BENCHMARKS.md section 7).
//!
//! Memory per layer: parameters, their gradient and the optimizer's state
//! (`4 × params × (2 + slots)` bytes); activations: the layer's output for the micro-batch
//! (`4 × numel × samples` bytes), what backward keeps of it. This is an estimate of what the
//! stage holds (burn may keep more intermediate values inside a layer), and is printed as such.

use std::time::Instant;

use crate::error::Result;
use crate::optim::OptimizerSpec;
use crate::partition::LayerCost;
use crate::spec::ModelSpec;
use crate::split::Split;
use crate::stage::Stage;
use crate::weights::ModelState;

/// Per-layer costs of `spec` for micro-batches of `samples`, on the named device, timing
/// `repeats` runs of each layer (at least 1).
pub fn profile(
    spec: &ModelSpec,
    optimizer: &OptimizerSpec,
    device: &str,
    samples: usize,
    repeats: usize,
) -> Result<Vec<LayerCost>> {
    let n = spec.layers.len();
    let io = spec.infer_io()?;
    let split = Split::new(spec, (0..n).map(|i| i..i + 1).collect())?;
    let samples = samples.max(1);
    let mut costs = Vec::with_capacity(n);
    for (i, (_, output)) in io.iter().enumerate() {
        let mut stage = Stage::new(spec, &split, i, optimizer, device, 0)?;
        let params = stage.num_params() as u64;
        let time_s = time_layer(&mut stage, samples, repeats.max(1))?;
        costs.push(LayerCost {
            time_s,
            fixed_bytes: 4 * params * (2 + optimizer.state_slots()),
            activation_bytes: 4 * (output.numel() * samples) as u64,
            params,
        });
    }
    Ok(costs)
}

/// Fastest seconds of forward + backward of `stage` on `samples` samples.
fn time_layer(stage: &mut Stage, samples: usize, repeats: usize) -> Result<f64> {
    let inputs: Vec<Vec<f32>> = stage
        .inputs()
        .iter()
        .map(|slot| {
            (0..slot.shape.numel() * samples)
                .map(|k| ((k * 31 % 97) as f32 / 48.0) - 1.0)
                .collect()
        })
        .collect();
    let refs: Vec<&[f32]> = inputs.iter().map(Vec::as_slice).collect();
    let mut times = Vec::with_capacity(repeats);
    for r in 0..=repeats {
        let started = Instant::now();
        let outputs = stage.forward(r, samples, &refs)?;
        let grads = outputs
            .iter()
            .map(|o| vec![1.0 / o.len() as f32; o.len()])
            .collect();
        stage.backward(r, grads)?;
        if r > 0 {
            times.push(started.elapsed().as_secs_f64());
        }
    }
    stage.reset();
    Ok(times.into_iter().fold(f64::INFINITY, f64::min))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_layer_gets_a_positive_time_and_its_memory() {
        let spec = ModelSpec::builtin("lenet5").expect("lenet5");
        let sgd = OptimizerSpec::Sgd {
            lr: 0.1,
            momentum: 0.9,
            dampening: 0.0,
            nesterov: false,
            weight_decay: 0.0,
        };
        let costs = profile(&spec, &sgd, "flex", 8, 2).expect("profile");
        assert_eq!(costs.len(), spec.layers.len());
        assert!(costs.iter().all(|c| c.time_s > 0.0));
        // Layer 0: conv 1→6, 5×5 with bias = 156 parameters; ×4 bytes × (value, gradient,
        // momentum). Its output: 6×28×28 per sample.
        assert_eq!(costs[0].fixed_bytes, 156 * 4 * 3);
        assert_eq!(costs[0].activation_bytes, 6 * 28 * 28 * 8 * 4);
        // A ReLU has no parameters.
        assert_eq!(costs[1].fixed_bytes, 0);
    }
}
