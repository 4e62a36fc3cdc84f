//! A ZeRO shard's optimizer step, measured by the process's allocator: burn's optimizers take
//! tensors, so a step copies the shard's values and gradient into them and back. Handed to
//! burn a chunk of pieces at a time (`optim/shard_optim.rs`), the step adds about a chunk's
//! copies and burn's temporaries of it over the shard, its gradient and its state; handed the
//! whole shard at once it added twice the shard and burn's temporaries of all of it (on
//! the 57 M GPT on 2 ranks, 218 MiB a rank at the step's peak).

mod counting;

use std::ops::Range;
use std::sync::atomic::Ordering;

use counting::{LIVE, PEAK};
use flotilla_engine::{DecayParams, OptimizerSpec, ParamInfo, ParamLayout, ShardOptimizer};

/// The layout of 8 linear layers of `width`: 8 matrices of `width²` values and their biases.
fn layout(width: usize) -> ParamLayout {
    let mut params = Vec::new();
    let mut offset = 0;
    for k in 0..8 {
        for (name, shape) in [("weight", vec![width, width]), ("bias", vec![width])] {
            let len = shape.iter().product();
            let name = format!("layers.{k}.{name}");
            params.push(ParamInfo {
                name,
                shape,
                offset,
                len,
            });
            offset += len;
        }
    }
    ParamLayout {
        params,
        total: offset,
    }
}

#[test]
fn a_shard_step_holds_about_a_chunk_beside_the_shard_and_its_state() {
    let layout = layout(1024);
    let total = layout.total;
    let owned: Vec<Range<usize>> = std::iter::once(0..total).collect();
    let adamw = OptimizerSpec::Adamw {
        lr: 0.01,
        beta1: 0.9,
        beta2: 0.99,
        epsilon: 1e-8,
        weight_decay: 0.1,
        decay_params: DecayParams::Matrices,
    };
    let mut shard = ShardOptimizer::new(&adamw, &layout, &owned, "flex").expect("shard");
    let mut values: Vec<f32> = (0..total).map(|i| (i % 97) as f32 * 1e-3).collect();
    let grads: Vec<f32> = (0..total).map(|i| (i % 89) as f32 * 1e-4 - 4e-3).collect();
    // The first step makes the state (two moments of the shard).
    shard
        .step_shard(&mut values, &grads, 0.01)
        .expect("first step");
    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    shard
        .step_shard(&mut values, &grads, 0.01)
        .expect("second step");
    let added = PEAK.load(Ordering::Relaxed) - before;
    let shard_bytes = 4 * total;
    let ratio = added as f64 / shard_bytes as f64;
    println!("a step added {added} bytes at its peak, {ratio:.2}x the shard's {shard_bytes}");
    assert!(ratio < 0.75, "a step added {ratio:.2}x the shard's bytes");
}
