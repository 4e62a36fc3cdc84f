//! Evaluating a model on the test (or validation) set of any [`Samples`] (by one rank, or split across a group), and checking
//! that every rank of a group holds the same parameters.

use flotilla_data::Samples;
use flotilla_engine::{Engine, EvalStats, ModelState};
use flotilla_tcp::ProcessGroup;

use crate::error::{Result, TrainError};

/// Samples evaluated at once: the engine's batch, and how many are gathered (read, for a
/// set read from its file) and held as `f32` at a time. Evaluation's activations are a
/// rank's largest transient memory (LeNet-5's first convolution: 18.8 MB at 1000 samples);
/// at 250 they stay below the shard's size (BENCHMARKS.md §17).
const EVAL_BATCH: usize = 250;

/// Evaluates on the whole test set in one process.
pub fn full(engine: &dyn Engine, test: &dyn Samples) -> Result<EvalStats> {
    let all: Vec<usize> = (0..test.len()).collect();
    evaluate(engine, test, &all)
}

/// Evaluates the samples `indices` of `test`, gathered [`EVAL_BATCH`] at a time: bitwise
/// the figures of evaluating them all at once in batches of that size (the engine sums
/// batch after batch in the same order).
fn evaluate(engine: &dyn Engine, test: &dyn Samples, indices: &[usize]) -> Result<EvalStats> {
    let (mut inputs, mut labels) = (Vec::new(), Vec::new());
    let mut stats = EvalStats::default();
    for chunk in indices.chunks(EVAL_BATCH) {
        test.fill(chunk, &mut inputs, &mut labels)?;
        let part = engine.evaluate(&inputs, &labels, EVAL_BATCH)?;
        stats.loss_sum += part.loss_sum;
        stats.correct += part.correct;
        stats.count += part.count;
    }
    Ok(stats)
}

/// Evaluates on the whole test set, split across ranks (rank `r` takes samples `r, r+N, ...`)
/// and summed with one all-reduce: every rank gets the full-test-set figures.
pub fn distributed(
    engine: &dyn Engine,
    comm: &dyn ProcessGroup,
    test: &dyn Samples,
) -> Result<EvalStats> {
    let (rank, world) = (comm.rank(), comm.size());
    let indices: Vec<usize> = (rank..test.len()).step_by(world).collect();
    let local = evaluate(engine, test, &indices)?;
    let mut sums = [
        local.loss_sum as f32,
        local.correct as f32,
        local.count as f32,
    ];
    comm.all_reduce_sum(&mut sums)?;
    Ok(EvalStats {
        loss_sum: sums[0] as f64,
        correct: sums[1].round() as usize,
        count: sums[2].round() as usize,
    })
}

/// The mean loss of `stats` in bits per byte, when `test`'s labels are byte tokens (a
/// loss in nats per byte over `ln 2`).
pub fn bits_per_byte(stats: &EvalStats, test: &dyn Samples) -> Option<f64> {
    test.byte_tokens()
        .then(|| stats.loss() / std::f64::consts::LN_2)
}

/// XXH3 of a model's parameters (their little-endian bytes in flat order).
pub fn param_hash(model: &dyn ModelState) -> Result<u64> {
    let mut params = vec![0.0f32; model.num_params()];
    model.read_params(&mut params)?;
    let bytes: Vec<u8> = params.iter().flat_map(|v| v.to_le_bytes()).collect();
    Ok(xxhash_rust::xxh3::xxh3_64(&bytes))
}

/// Checks that every rank of `comm` holds bitwise-identical parameters; returns their hash.
/// A rank that differs is named by its world rank.
pub fn verify_identical(model: &dyn ModelState, comm: &dyn ProcessGroup) -> Result<u64> {
    let hash = param_hash(model)?;
    let all = comm.all_gather_u64(hash)?;
    let differing: Vec<String> = all
        .iter()
        .enumerate()
        .filter(|(_, h)| **h != all[0])
        .map(|(r, h)| format!("rank {} has {h:016x}", comm.world_rank(r)))
        .collect();
    if differing.is_empty() {
        Ok(hash)
    } else {
        Err(TrainError::Divergence(format!(
            "rank {} has {:016x}, {}",
            comm.world_rank(0),
            all[0],
            differing.join(", ")
        )))
    }
}
