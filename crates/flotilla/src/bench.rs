//! `flotilla bench`: all-reduce bandwidth and training-step throughput, each printed with a
//! ratio against a reference measured in the same run (never a bare timing).

use std::ffi::OsString;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use flotilla_comm::bench::{BenchOptions, default_sizes, format_bytes, run_allreduce};
use flotilla_comm::{CommConfig, Communicator, ProcessGroup, WireFormat};
use flotilla_engine::{BatchRef, BurnEngine, Engine, ModelSpec, ModelState, OptimizerSpec};

use crate::cli::{BenchAllreduceArgs, BenchCommand, BenchStepArgs};
use crate::launch::{LocalJob, Stream, free_port};

const ROW_PREFIX: &str = "@bench ";

/// Runs a bench subcommand.
pub fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Allreduce(args) => allreduce(&args),
        BenchCommand::AllreduceWorker(args) => allreduce_worker(&args),
        BenchCommand::Step(args) => step(&args),
        BenchCommand::Ps(args) => crate::bench_ps::run(&args),
        BenchCommand::Pipeline(args) => crate::bench_pipeline::run(&args),
    }
}

fn parse_size(s: &str) -> Result<usize> {
    let s = s.trim();
    let (num, mult) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    let n: usize = num.parse().with_context(|| format!("bad size {s:?}"))?;
    Ok(n * mult)
}

fn sizes(args: &BenchAllreduceArgs) -> Result<Vec<usize>> {
    if args.sizes.is_empty() {
        Ok(default_sizes())
    } else {
        args.sizes.iter().map(|s| parse_size(s)).collect()
    }
}

/// Single-stream TCP bandwidth over loopback in GB/s: the `B` of the ring's bound
/// `busbw <= B`, measured with the same socket API and chunk size the ring uses.
fn loopback_bandwidth(total: usize) -> Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let receiver = std::thread::spawn(move || -> std::io::Result<usize> {
        let (mut s, _) = listener.accept()?;
        let mut buf = vec![0u8; 1 << 20];
        let mut got = 0;
        loop {
            let n = s.read(&mut buf)?;
            if n == 0 {
                return Ok(got);
            }
            got += n;
        }
    });
    let mut s = TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    let chunk = vec![1u8; 1 << 20];
    let started = Instant::now();
    let mut sent = 0;
    while sent < total {
        s.write_all(&chunk)?;
        sent += chunk.len();
    }
    drop(s);
    let got = receiver
        .join()
        .map_err(|_| anyhow::anyhow!("loopback receiver panicked"))??;
    let secs = started.elapsed().as_secs_f64();
    Ok(got as f64 / secs / 1e9)
}

fn allreduce(args: &BenchAllreduceArgs) -> Result<()> {
    let sizes = sizes(args)?;
    let reference = loopback_bandwidth(1 << 30)?;
    println!("# flotilla bench allreduce: ring all-reduce of f32 buffers over 127.0.0.1");
    println!(
        "# reference B = single-stream loopback TCP bandwidth, measured now: {reference:.2} GB/s; ideal ring busbw = B"
    );
    println!(
        "# {} cores on this machine; each rank's compute runs on 1 thread",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!(
        "{:>6} {:>10} {:>6} {:>12} {:>12} {:>12} {:>9}",
        "ranks", "size", "iters", "time_us", "algbw_GB/s", "busbw_GB/s", "busbw/B"
    );
    for &n in &args.ranks {
        if n < 2 {
            bail!("all-reduce bench needs at least 2 ranks, got {n}");
        }
        let port = free_port()?;
        let mut worker_args: Vec<OsString> = vec![
            "bench".into(),
            "allreduce-worker".into(),
            "--iters".into(),
            args.iters.to_string().into(),
            "--sizes".into(),
            sizes
                .iter()
                .map(|s| s.to_string())
                .collect::<Vec<_>>()
                .join(",")
                .into(),
        ];
        if args.bf16 {
            worker_args.push("--bf16".into());
        }
        let mut job = LocalJob::spawn(n, &worker_args, |rank| {
            vec![
                ("RANK".into(), rank.to_string()),
                ("WORLD_SIZE".into(), n.to_string()),
                ("MASTER_ADDR".into(), "127.0.0.1".into()),
                ("MASTER_PORT".into(), port.to_string()),
                ("RAYON_NUM_THREADS".into(), "1".into()),
            ]
        })?;
        job.supervise(Some(Duration::from_secs(1800)), &mut |line| {
            if line.stream == Stream::Stdout
                && line.rank == 0
                && let Some(rest) = line.text.strip_prefix(ROW_PREFIX)
            {
                let f: Vec<&str> = rest.split_whitespace().collect();
                if let [bytes, iters, secs, algbw, busbw] = f.as_slice() {
                    let bytes: usize = bytes.parse().unwrap_or(0);
                    let secs: f64 = secs.parse().unwrap_or(f64::NAN);
                    let busbw_v: f64 = busbw.parse().unwrap_or(f64::NAN);
                    println!(
                        "{:>6} {:>10} {:>6} {:>12.1} {:>12} {:>12} {:>9.2}",
                        n,
                        format_bytes(bytes),
                        iters,
                        secs * 1e6,
                        algbw,
                        busbw,
                        busbw_v / reference
                    );
                }
            } else if line.stream == Stream::Stderr {
                eprintln!("[rank {}] {}", line.rank, line.text);
            }
        })?;
    }
    Ok(())
}

fn allreduce_worker(args: &BenchAllreduceArgs) -> Result<()> {
    let mut cfg = CommConfig::from_env()?;
    if args.bf16 {
        cfg.wire_format = WireFormat::Bf16;
    }
    let comm = Communicator::connect(cfg)?;
    let opts = BenchOptions {
        sizes: sizes(args)?,
        iters: args.iters,
        ..BenchOptions::default()
    };
    let rows = run_allreduce(&comm, &opts)?;
    if comm.rank() == 0 {
        for r in rows {
            println!(
                "{ROW_PREFIX}{} {} {:.9} {:.3} {:.3}",
                r.bytes,
                r.iters,
                r.median.as_secs_f64(),
                r.algbw_gbs,
                r.busbw_gbs
            );
        }
    }
    Ok(())
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
