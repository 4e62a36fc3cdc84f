//! `flotilla bench`: all-reduce bandwidth and training-step throughput, each printed with a
//! ratio against a reference measured in the same run (never a bare timing).
//!
//! `bench step` is here; `bench allreduce` is [`allreduce`] ([`mpi`] with `--backend mpi`),
//! `bench ps` [`ps`] and `bench pipeline` [`pipeline`], each case of those two a [`job`];
//! `bench gemm` ([`gemm`]) measures the GEMM rate other figures are a fraction of.

mod allreduce;
mod gemm;
mod job;
pub(crate) mod measure;
#[cfg(test)]
mod measure_tests;
mod mpi;
mod pipeline;
mod ps;

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result};
use flotilla_engine::{BatchRef, BurnEngine, Engine, ModelSpec, ModelState, OptimizerSpec};

use crate::cli::{BenchCommand, BenchStepArgs};

/// Runs a bench subcommand.
pub fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Allreduce(args) if args.backend == "mpi" => crate::bench::mpi::table(&args),
        BenchCommand::Allreduce(args) => crate::bench::allreduce::run(&args),
        BenchCommand::AllreduceWorker(args) if args.backend == "mpi" => {
            crate::bench::mpi::worker(&crate::bench::allreduce::options(&args)?)
        }
        BenchCommand::AllreduceWorker(args) => crate::bench::allreduce::worker(&args),
        BenchCommand::Step(args) => step(&args),
        BenchCommand::Ps(args) => crate::bench::ps::run(&args),
        BenchCommand::Pipeline(args) => crate::bench::pipeline::run(&args),
        BenchCommand::Gemm(args) => crate::bench::gemm::run(&args),
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

/// What one case of `bench step` measured on Flotilla's side.
#[derive(Clone, Copy)]
struct StepRate {
    /// Samples per second (wall clock).
    samples_per_s: f64,
    /// CPU time of the whole process (every thread, user + system) per step, in milliseconds:
    /// the figure that survives a loaded machine.
    cpu_ms_per_step: f64,
}

/// User + system CPU time of this process so far (every thread), in seconds.
fn process_cpu_seconds() -> f64 {
    // SAFETY: `getrusage` only writes the `rusage` we hand it.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above; RUSAGE_SELF is always valid.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &raw mut usage) } != 0 {
        return f64::NAN;
    }
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    secs(usage.ru_utime) + secs(usage.ru_stime)
}

/// Full training steps (forward, backward, gradients out as a flat buffer, optimizer step
/// from it), as the sync strategy runs them, on the backend `device`.
fn flotilla_step_rate(model: &str, device: &str, batch: usize, steps: usize) -> Result<StepRate> {
    let spec = ModelSpec::resolve(model)?;
    let opt = OptimizerSpec::default();
    let mut engine = BurnEngine::new(&spec, &opt, device, 1)?;
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
    let cpu_started = process_cpu_seconds();
    let started = Instant::now();
    for _ in 0..steps {
        one(&mut engine)?;
    }
    let wall = started.elapsed().as_secs_f64();
    let cpu = process_cpu_seconds() - cpu_started;
    Ok(StepRate {
        samples_per_s: (batch * steps) as f64 / wall,
        cpu_ms_per_step: cpu * 1e3 / steps as f64,
    })
}

fn scripts_dir() -> PathBuf {
    let beside = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts");
    if beside.is_dir() {
        beside
    } else {
        PathBuf::from("scripts")
    }
}

/// The Python of the PyTorch peer when none is named: what `scripts/torch_python.py` says
/// (the scripts' default, kept in one place), else `python3`.
fn torch_python() -> String {
    let script = scripts_dir().join("torch_python.py");
    Command::new("python3")
        .arg(&script)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "python3".into())
}

/// PyTorch's rate for the same step, from `scripts/bench_torch_step.py`, if torch is
/// installed; a failing script is reported on stderr (the row then shows `n/a`).
fn torch_step_rate(
    python: &str,
    model: &str,
    batch: usize,
    threads: usize,
    steps: usize,
) -> Option<StepRate> {
    let script = scripts_dir().join("bench_torch_step.py");
    let out = Command::new(python)
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
            eprintln!("# pytorch reference not run: {python}: {e}");
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
    let stdout = String::from_utf8_lossy(&out.stdout);
    let value = |key: &str| -> Option<f64> {
        stdout
            .lines()
            .rev()
            .find_map(|l| l.strip_prefix(key)?.trim().parse().ok())
    };
    Some(StepRate {
        samples_per_s: value("samples_per_s=")?,
        cpu_ms_per_step: value("cpu_ms_per_step=").unwrap_or(f64::NAN),
    })
}

fn step(args: &BenchStepArgs) -> Result<()> {
    flotilla_engine::check_device(&args.device)?;
    let mut args = args.clone();
    let python = args.python.get_or_insert_with(torch_python);
    println!("# the PyTorch peer: {python}");
    let args = &args;
    println!(
        "# flotilla bench step: samples/s of one training step (SGD), burn backend `{}`",
        args.device
    );
    println!(
        "# reference: PyTorch CPU (scripts/bench_torch_step.py) measured in the same run, when torch is installed"
    );
    println!(
        "# cpu_ms: process CPU time (every thread) per step; cpu ratio = pytorch's / ours (> 1: we use less)"
    );
    println!(
        "{:>8} {:>6} {:>8} {:>14} {:>14} {:>10} {:>12} {:>12} {:>10}",
        "model",
        "batch",
        "threads",
        "flotilla/s",
        "pytorch/s",
        "ratio",
        "cpu_ms",
        "torch_cpu_ms",
        "cpu_ratio"
    );
    for model in &args.models {
        for &batch in &args.batches {
            for &threads in &args.threads {
                step_case(args, model, batch, threads)?;
            }
        }
    }
    Ok(())
}

/// One row of `bench step`: ours, theirs, ours, theirs, ... (`args.rounds` runs of each);
/// each side keeps its best run (the CPU time is the best run's).
fn step_case(args: &BenchStepArgs, model: &str, batch: usize, threads: usize) -> Result<()> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .build()
        .context("building the thread pool")?;
    let ours_once = || pool.install(|| flotilla_step_rate(model, &args.device, batch, args.steps));
    let python = args.python.as_deref().unwrap_or("python3");
    let theirs_once = || torch_step_rate(python, model, batch, threads, args.steps);
    let better = |a: StepRate, b: StepRate| {
        if b.samples_per_s > a.samples_per_s {
            b
        } else {
            a
        }
    };
    let (mut ours, mut theirs): (Option<StepRate>, Option<StepRate>) = (None, None);
    for _ in 0..args.rounds {
        let o = ours_once()?;
        ours = Some(ours.map_or(o, |a| better(a, o)));
        if let Some(t) = theirs_once() {
            theirs = Some(theirs.map_or(t, |a| better(a, t)));
        }
    }
    let ours = ours.context("bench step: --rounds must be at least 1")?;
    let (t, r, tc, rc) = match theirs {
        Some(t) => (
            format!("{:.0}", t.samples_per_s),
            format!("{:.2}", ours.samples_per_s / t.samples_per_s),
            format!("{:.3}", t.cpu_ms_per_step),
            format!("{:.2}", t.cpu_ms_per_step / ours.cpu_ms_per_step),
        ),
        None => ("n/a".into(), "n/a".into(), "n/a".into(), "n/a".into()),
    };
    println!(
        "{model:>8} {batch:>6} {threads:>8} {:>14.0} {t:>14} {r:>10} {:>12.3} {tc:>12} {rc:>10}",
        ours.samples_per_s, ours.cpu_ms_per_step
    );
    Ok(())
}
