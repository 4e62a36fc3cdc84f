//! `flotilla bench gemm`: the machine's GEMM rate (square f32 products on rayon's pool, the
//! kernel of every linear layer), per size and thread count, and each thread count's speed-up
//! over one thread measured in the same run. A model's FLOP rate (6 × parameters × tokens/s)
//! is a fraction of the all-cores figure (`scripts/gpt_vs_fsdp.py`).

use anyhow::{Context, Result, bail};

use crate::cli::BenchGemmArgs;

/// The largest size measured: three matrices of it take 768 MiB.
const MAX_SIZE: usize = 8192;

/// Runs `bench gemm`: one line per size and thread count.
pub fn run(args: &BenchGemmArgs) -> Result<()> {
    if let Some(bad) = args.sizes.iter().find(|&&s| s == 0 || s > MAX_SIZE) {
        bail!("bench gemm: size {bad} is not in 1..={MAX_SIZE}");
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = if args.threads.is_empty() {
        let mut t = vec![1, cores];
        t.dedup();
        t
    } else {
        args.threads.clone()
    };
    println!("size  threads  GFLOP/s  vs 1 thread");
    for &size in &args.sizes {
        let mut single = None;
        for &t in &threads {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(t.max(1))
                .build()
                .context("a thread pool for bench gemm")?;
            let rate = pool.install(|| flotilla_engine::gemm_flops_per_s(size, args.reps)) / 1e9;
            if t == 1 {
                single = Some(rate);
            }
            // Against one thread when the run measured it (first: `--threads 1,...`).
            let ratio = single.map_or("-".to_string(), |base| format!("{:.2}x", rate / base));
            println!("{size:>4}  {t:>7}  {rate:>7.1}  {ratio:>11}");
        }
    }
    Ok(())
}
