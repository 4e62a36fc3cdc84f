//! `flotilla bench`: all-reduce bandwidth and training-step throughput, each printed with a
//! ratio against a reference measured in the same run (never a bare timing).

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result};
use flotilla_engine::{BatchRef, BurnEngine, Engine, ModelSpec, ModelState, OptimizerSpec};

use crate::cli::{BenchCommand, BenchStepArgs};

/// Runs a bench subcommand.
pub fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Allreduce(args) if args.backend == "mpi" => crate::bench_mpi::table(&args),
        BenchCommand::Allreduce(args) => crate::bench_allreduce::run(&args),
        BenchCommand::AllreduceWorker(args) if args.backend == "mpi" => {
            crate::bench_mpi::worker(&crate::bench_allreduce::options(&args)?)
        }
        BenchCommand::AllreduceWorker(args) => crate::bench_allreduce::worker(&args),
        BenchCommand::Step(args) => step(&args),
        BenchCommand::Ps(args) => crate::bench_ps::run(&args),
        BenchCommand::Pipeline(args) => crate::bench_pipeline::run(&args),
    }
}

/// A deterministic batch of `n` MNIST-shaped samples.
fn synthetic_batch(n: usize) -> (Vec<f32>, Vec<i64>) {
    let images = (0..n * 784)
        .map(|i| ((i * 7919) % 255) as f32 / 255.0 - 0.5)
        .collect();
    let labels = (0..n).map(|i| (i % 10) as i64).collect();
    (images, labels)
}

/// Samples per second of full training steps (forward, backward, gradients out as a flat
/// buffer, optimizer step from it), as the sync strategy runs them.
fn flotilla_step_rate(model: &str, batch: usize, steps: usize) -> Result<f64> {
    let spec = ModelSpec::resolve(model)?;
    let opt = OptimizerSpec::default();
    let mut engine = BurnEngine::new(&spec, &opt, "flex", 1)?;
    let (images, labels) = synthetic_batch(batch);
    let mut flat = vec![0.0f32; engine.num_params()];
    let mut one = |engine: &mut BurnEngine| -> Result<()> {
        engine.forward_backward(BatchRef {
            images: &images,
            labels: &labels,
        })?;
        engine.read_grads(&mut flat)?;
        engine.apply_grads(&flat, opt.lr())?;
        Ok(())
    };
    for _ in 0..5 {
        one(&mut engine)?;
    }
    let started = Instant::now();
    for _ in 0..steps {
        one(&mut engine)?;
    }
    Ok((batch * steps) as f64 / started.elapsed().as_secs_f64())
}

fn scripts_dir() -> PathBuf {
    let beside = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts");
    if beside.is_dir() {
        beside
    } else {
        PathBuf::from("scripts")
    }
}

/// PyTorch's samples/s for the same step, from `scripts/bench_torch_step.py`, if torch is
/// installed; a failing script is reported on stderr (the row then shows `n/a`).
fn torch_step_rate(model: &str, batch: usize, threads: usize, steps: usize) -> Option<f64> {
    let script = scripts_dir().join("bench_torch_step.py");
    let out = Command::new("python3")
        .arg(&script)
        .args(["--model", model, "--batch", &batch.to_string()])
        .args([
            "--threads",
            &threads.to_string(),
            "--steps",
            &steps.to_string(),
        ])
        .output();
    let out = match out {
        Ok(o) => o,
        Err(e) => {
            eprintln!("# pytorch reference not run: python3: {e}");
            return None;
        }
    };
    if !out.status.success() {
        eprintln!(
            "# pytorch reference failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
        return None;
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix("samples_per_s=")?.trim().parse().ok())
}

fn step(args: &BenchStepArgs) -> Result<()> {
    println!("# flotilla bench step: samples/s of one training step (SGD), burn flex backend");
    println!(
        "# reference: PyTorch CPU (scripts/bench_torch_step.py) measured in the same run, when torch is installed"
    );
    println!(
        "{:>8} {:>6} {:>8} {:>14} {:>14} {:>10}",
        "model", "batch", "threads", "flotilla/s", "pytorch/s", "ratio"
    );
    for model in &args.models {
        for &batch in &args.batches {
            for &threads in &args.threads {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads.max(1))
                    .build()
                    .context("building the thread pool")?;
                // Interleave ours, theirs, ours, theirs; each side keeps its better run.
                let ours1 = pool.install(|| flotilla_step_rate(model, batch, args.steps))?;
                let theirs1 = torch_step_rate(model, batch, threads, args.steps);
                let ours2 = pool.install(|| flotilla_step_rate(model, batch, args.steps))?;
                let theirs2 = torch_step_rate(model, batch, threads, args.steps);
                let ours = ours1.max(ours2);
                let theirs = match (theirs1, theirs2) {
                    (Some(a), Some(b)) => Some(a.max(b)),
                    (a, b) => a.or(b),
                };
                let (t, r) = match theirs {
                    Some(t) => (format!("{t:.0}"), format!("{:.2}", ours / t)),
                    None => ("n/a".to_string(), "n/a".to_string()),
                };
                println!("{model:>8} {batch:>6} {threads:>8} {ours:>14.0} {t:>14} {r:>10}");
            }
        }
    }
    Ok(())
}
