//! Ring all-reduce benchmark over 127.0.0.1.
//!
//! ```text
//! cargo run --release -p flotilla-comm --example allreduce_bench -- --world 2
//! cargo run --release -p flotilla-comm --example allreduce_bench -- --world 4 --sizes 1M,64M --iters 10
//! ```
//!
//! The launcher re-executes itself once per rank (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT
//! in the environment, torchrun style); rank 0 prints the table. Other options:
//! `--warmup N`, `--chunk-bytes N`, `--wire f32|bf16`, `--compression none|lz4`,
//! `--threads N` (runtime worker threads per rank), `--async` (measure the handle API).

use std::process::{Command, ExitCode};
use std::time::Duration;

use flotilla_comm::bench::{self, BenchOptions};
use flotilla_comm::{CommConfig, Communicator, ProcessGroup};

const CHILD_ENV: &str = "FLOTILLA_BENCH_CHILD";

fn parse_size(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().find(|(_, c)| c.is_ascii_alphabetic()) {
        Some((i, _)) => {
            let m = match s[i..]
                .to_ascii_uppercase()
                .trim_end_matches("IB")
                .trim_end_matches('B')
            {
                "" => 1,
                "K" => 1 << 10,
                "M" => 1 << 20,
                "G" => 1 << 30,
                other => return Err(format!("unknown size unit {other:?} in {s:?}")),
            };
            (&s[..i], m)
        }
        None => (s, 1),
    };
    num.parse::<usize>()
        .map(|n| n * mult)
        .map_err(|e| format!("bad size {s:?}: {e}"))
}

struct Args {
    world: usize,
    opts: BenchOptions,
    passthrough: Vec<(String, String)>,
    threads: Option<usize>,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        world: 2,
        opts: BenchOptions::default(),
        passthrough: Vec::new(),
        threads: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--world" => args.world = val()?.parse().map_err(|e| format!("--world: {e}"))?,
            "--sizes" => {
                args.opts.sizes = val()?
                    .split(',')
                    .map(parse_size)
                    .collect::<Result<_, _>>()?
            }
            "--iters" => args.opts.iters = val()?.parse().map_err(|e| format!("--iters: {e}"))?,
            "--warmup" => {
                args.opts.warmup = val()?.parse().map_err(|e| format!("--warmup: {e}"))?
            }
            "--async" => args.opts.use_async = true,
            "--threads" => {
                args.threads = Some(val()?.parse().map_err(|e| format!("--threads: {e}"))?)
            }
            "--chunk-bytes" => args.passthrough.push((
                "FLOTILLA_COMM_CHUNK_BYTES".into(),
                parse_size(&val()?)?.to_string(),
            )),
            "--wire" => args.passthrough.push(("FLOTILLA_COMM_WIRE".into(), val()?)),
            "--compression" => args
                .passthrough
                .push(("FLOTILLA_COMM_COMPRESSION".into(), val()?)),
            "-h" | "--help" => {
                return Err("usage: allreduce_bench [--world N] [--sizes 4K,1M,64M] [--iters N] [--warmup N] \
                            [--chunk-bytes N] [--wire f32|bf16] [--compression none|lz4] [--threads N] [--async]"
                    .into());
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(args)
}

fn child(args: &Args) -> Result<(), String> {
    let mut cfg = CommConfig::from_env()
        .map_err(|e| e.to_string())?
        .with_join_timeout(Duration::from_secs(30));
    if let Some(t) = args.threads {
        cfg.runtime_threads = t;
    }
    let comm = Communicator::connect(cfg).map_err(|e| e.to_string())?;
    let rows = bench::run_allreduce(&comm, &args.opts)
        .map_err(|e| format!("rank {}: {e}", comm.rank()))?;
    if comm.rank() == 0 {
        println!(
            "ring all-reduce (sum, f32), {} ranks over 127.0.0.1, {} CPU(s)",
            comm.size(),
            std::thread::available_parallelism().map_or(0, |n| n.get())
        );
        print!("{}", bench::format_table(&rows));
    }
    comm.barrier().map_err(|e| e.to_string())
}

fn launch(args: &Args) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| e.to_string())?
        .port();
    // The ranks prove a secret of this run's on every connection (a TCP rank refuses without).
    let secret = String::from_utf8_lossy(flotilla_comm::Secret::generate().bytes()).into_owned();
    let mut children = Vec::new();
    for rank in 0..args.world {
        let mut cmd = Command::new(&exe);
        cmd.args(std::env::args().skip(1))
            .env(CHILD_ENV, "1")
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", args.world.to_string())
            .env(flotilla_comm::SECRET_ENV, &secret)
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string());
        for (k, v) in &args.passthrough {
            cmd.env(k, v);
        }
        children.push(
            cmd.spawn()
                .map_err(|e| format!("cannot spawn rank {rank}: {e}"))?,
        );
    }
    let mut failed = Vec::new();
    for (rank, mut c) in children.into_iter().enumerate() {
        match c.wait() {
            Ok(s) if s.success() => {}
            Ok(s) => failed.push(format!("rank {rank} exited with {s}")),
            Err(e) => failed.push(format!("rank {rank}: {e}")),
        }
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(failed.join("; "))
    }
}

fn main() -> ExitCode {
    let result = parse_args().and_then(|args| {
        if std::env::var_os(CHILD_ENV).is_some() {
            child(&args)
        } else {
            launch(&args)
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("allreduce_bench: {e}");
            ExitCode::FAILURE
        }
    }
}
