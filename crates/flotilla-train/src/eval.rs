//! Evaluating a model on the test (or validation) set of any [`Samples`] (by one rank, or split across a group), and checking
//! that every rank of a group holds the same parameters.

use flotilla_data::Samples;
use flotilla_engine::{Engine, EvalStats, ModelState, ShardedPass};
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
    sum_over(comm, local)
}

/// [`distributed`] for a model whose parameters are sharded over the ranks (ZeRO-3): each
/// rank's samples `batch` at a time through [`Engine::evaluate_sharded`], which gathers every
/// group from `pass` once per batch; every rank runs as many batches as the rank with the
/// most samples (the last ones empty on the others), so that the gathers match.
pub fn distributed_sharded(
    engine: &mut dyn Engine,
    comm: &dyn ProcessGroup,
    test: &dyn Samples,
    batch: usize,
    pass: &mut dyn ShardedPass,
) -> Result<EvalStats> {
    let (rank, world) = (comm.rank(), comm.size());
    let batch = batch.max(1);
    let indices: Vec<usize> = (rank..test.len()).step_by(world).collect();
    let batches = test.len().div_ceil(world).div_ceil(batch);
    let (mut inputs, mut labels) = (Vec::new(), Vec::new());
    let mut local = EvalStats::default();
    for b in 0..batches {
        let chunk = indices.get(b * batch..).unwrap_or(&[]);
        let chunk = &chunk[..chunk.len().min(batch)];
        test.fill(chunk, &mut inputs, &mut labels)?;
        let part = engine.evaluate_sharded(&inputs, &labels, pass)?;
        local.loss_sum += part.loss_sum;
        local.correct += part.correct;
        local.count += part.count;
    }
    sum_over(comm, local)
}

/// `local`'s figures summed over the ranks of `comm` (one all-reduce).
fn sum_over(comm: &dyn ProcessGroup, local: EvalStats) -> Result<EvalStats> {
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
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    for v in &params {
        hasher.update(&v.to_le_bytes());
    }
    Ok(hasher.digest())
}

/// Checks that every rank of `comm` holds bitwise-identical parameters; returns their hash.
/// A rank that differs is named by its world rank.
pub fn verify_identical(model: &dyn ModelState, comm: &dyn ProcessGroup) -> Result<u64> {
    let hash = param_hash(model)?;
    match differing_hashes(comm, hash, "has")? {
        None => Ok(hash),
        Some(which) => Err(TrainError::Divergence(which)),
    }
}

/// Every rank's `mine` (collective): `None` when all are rank 0's, else which differ, as
/// `rank 0 {verb} <hash>, rank 2 {verb} <hash>` (world ranks).
pub fn differing_hashes(comm: &dyn ProcessGroup, mine: u64, verb: &str) -> Result<Option<String>> {
    let all = comm.all_gather_u64(mine)?;
    let differing: Vec<String> = all
        .iter()
        .enumerate()
        .filter(|(_, h)| **h != all[0])
        .map(|(r, h)| format!("rank {} {verb} {h:016x}", comm.world_rank(r)))
        .collect();
    Ok((!differing.is_empty()).then(|| {
        format!(
            "rank {} {verb} {:016x}, {}",
            comm.world_rank(0),
            all[0],
            differing.join(", ")
        )
    }))
}
