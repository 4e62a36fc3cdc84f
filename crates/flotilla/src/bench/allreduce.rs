//! `flotilla bench allreduce`: the all-reduce's bandwidth of the TCP backend between local
//! ranks, by transport (`--transport`: shared memory, or recursive doubling, Rabenseifner's
//! and the ring by size over 127.0.0.1), against the loopback TCP bandwidth measured in the
//! same run; the worker lines and the rows that `--backend mpi` (`crate::bench::mpi`) also uses.

use std::ffi::OsString;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::bench::measure::{BenchOptions, BenchRow, default_sizes, format_bytes, run_allreduce};
use anyhow::{Context, Result, bail};
use flotilla_tcp::{ProcessGroup, TcpGroup, Transport, WireFormat};

use crate::binding;
use crate::cli::BenchAllreduceArgs;
use crate::job_secret::JobSecret;
use crate::launch::{LocalJob, Stream};
use crate::rendezvous_socket::RendezvousSocket;

/// What a worker's result lines start with (then the label of the measurement).
pub const ROW_PREFIX: &str = "@bench ";

/// One measured size, as a worker reports it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Row {
    /// Buffer size in bytes.
    pub bytes: usize,
    /// Timed iterations.
    pub iters: usize,
    /// Median seconds of one all-reduce (slowest rank).
    pub secs: f64,
    /// Algorithm bandwidth, GB/s.
    pub algbw: f64,
    /// Bus bandwidth, GB/s.
    pub busbw: f64,
}

impl Row {
    /// The line a worker prints for `r` under `label`.
    pub fn line(label: &str, r: &BenchRow) -> String {
        format!(
            "{ROW_PREFIX}{label} {} {} {:.9} {:.3} {:.3}",
            r.bytes,
            r.iters,
            r.median.as_secs_f64(),
            r.algbw_gbs,
            r.busbw_gbs
        )
    }

    /// The row of a worker's line with `label`, if it is one.
    pub fn parse(line: &str, label: &str) -> Option<Row> {
        let rest = line.strip_prefix(ROW_PREFIX)?.strip_prefix(label)?;
        let f: Vec<&str> = rest.split_whitespace().collect();
        let [bytes, iters, secs, algbw, busbw] = f.as_slice() else {
            return None;
        };
        Some(Row {
            bytes: bytes.parse().ok()?,
            iters: iters.parse().ok()?,
            secs: secs.parse().ok()?,
            algbw: algbw.parse().ok()?,
            busbw: busbw.parse().ok()?,
        })
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

/// The sizes to measure.
pub fn sizes(args: &BenchAllreduceArgs) -> Result<Vec<usize>> {
    if args.sizes.is_empty() {
        Ok(default_sizes())
    } else {
        args.sizes.iter().map(|s| parse_size(s)).collect()
    }
}

/// The worker arguments of a measurement (`backend`: the worker's `--backend`).
pub fn worker_args(args: &BenchAllreduceArgs, backend: &str) -> Result<Vec<OsString>> {
    let sizes = sizes(args)?;
    let mut out: Vec<OsString> = vec![
        "bench".into(),
        "allreduce-worker".into(),
        "--backend".into(),
        backend.into(),
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
        out.push("--bf16".into());
    }
    Ok(out)
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

/// Fails unless every rank count is at least 2.
pub fn check_ranks(args: &BenchAllreduceArgs) -> Result<()> {
    match args.ranks.iter().find(|&&n| n < 2) {
        Some(n) => bail!("all-reduce bench needs at least 2 ranks, got {n}"),
        None => Ok(()),
    }
}

/// The labels of a worker's rows: the transport it used.
const USED: [&str; 3] = ["hier", "shm", "tcp"];

/// `flotilla bench allreduce` (TCP backend, each requested transport).
pub fn run(args: &BenchAllreduceArgs) -> Result<()> {
    check_ranks(args)?;
    let reference = loopback_bandwidth(1 << 30)?;
    println!(
        "# flotilla bench allreduce: all-reduce of f32 buffers between local ranks; transport \
         shm: a shared-memory segment (chunks of comm.shm_chunk_kb, default {} KiB per rank); \
         tcp: 127.0.0.1 (recursive doubling up to comm.small_all_reduce_kb, default {} KiB; \
         Rabenseifner's up to comm.mid_all_reduce_kb, default {} MiB; the ring above; \
         FLOTILLA_COMM__<KEY> sets them); auto: shm between ranks of one host",
        flotilla_tcp::DEFAULT_SHM_CHUNK_BYTES >> 10,
        flotilla_tcp::DEFAULT_SMALL_ALL_REDUCE_BYTES >> 10,
        flotilla_tcp::DEFAULT_MID_ALL_REDUCE_BYTES >> 20
    );
    println!(
        "# reference B = single-stream loopback TCP bandwidth, measured now: {reference:.2} GB/s; ideal ring busbw = B"
    );
    println!(
        "# {} cores on this machine; each rank's compute runs on 1 thread; ranks bound to \
         cores: --bind {} (auto: when the ranks outnumber the cores)",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        args.bind
    );
    println!(
        // The transport last: scripts read the size and busbw columns by position.
        "{:>6} {:>10} {:>6} {:>12} {:>12} {:>12} {:>9} {:>10}",
        "ranks", "size", "iters", "time_us", "algbw_GB/s", "busbw_GB/s", "busbw/B", "transport"
    );
    let requested = if args.transport.is_empty() {
        vec!["auto".to_string()]
    } else {
        args.transport.clone()
    };
    for &n in &args.ranks {
        for t in &requested {
            for (used, r) in rows(args, n, t.parse()?)? {
                let shown = if *t == used {
                    used
                } else {
                    format!("{t}:{used}")
                };
                println!(
                    "{:>6} {:>10} {:>6} {:>12.1} {:>12.3} {:>12.3} {:>9.2} {:>10}",
                    n,
                    format_bytes(r.bytes),
                    r.iters,
                    r.secs * 1e6,
                    r.algbw,
                    r.busbw,
                    r.busbw / reference,
                    shown
                );
            }
        }
    }
    Ok(())
}

/// The rows of the TCP backend with `n` local ranks over `transport`, each with the
/// transport the job used (`shm` or `tcp`).
pub fn rows(
    args: &BenchAllreduceArgs,
    n: usize,
    transport: Transport,
) -> Result<Vec<(String, Row)>> {
    let socket = RendezvousSocket::bind("127.0.0.1", 0)?;
    let port = socket.port()?;
    // The user's secret reaches the ranks through the environment they inherit; else one for
    // this run.
    let secret = match flotilla_tcp::Secret::from_env()? {
        Some(_) => None,
        None => Some(JobSecret::fresh()?),
    };
    let mut worker = worker_args(args, "tcp")?;
    worker.extend(["--transport".into(), transport.to_string().into()]);
    let cpus = binding::plan(args.bind, n, 1, &binding::allowed_cpus(), true);
    let env = |rank: usize| {
        let mut env = vec![
            ("RANK".into(), rank.to_string()),
            ("WORLD_SIZE".into(), n.to_string()),
            ("MASTER_ADDR".into(), "127.0.0.1".into()),
            ("MASTER_PORT".into(), port.to_string()),
            ("RAYON_NUM_THREADS".into(), "1".into()),
        ];
        env.extend(binding::rank_var(cpus.as_deref(), rank));
        env.extend(secret.as_ref().and_then(JobSecret::rank_env));
        env
    };
    let mut job = LocalJob::spawn(n, &worker, env, Some(&socket))?;
    drop(socket);
    let mut rows = Vec::new();
    job.supervise(Some(Duration::from_secs(1800)), &mut |line| {
        if line.stream == Stream::Stdout && line.rank == 0 {
            let parsed = USED
                .iter()
                .find_map(|u| Row::parse(&line.text, u).map(|r| (u.to_string(), r)));
            rows.extend(parsed);
        } else if line.stream == Stream::Stderr {
            eprintln!("[rank {}] {}", line.rank, line.text);
        }
    })?;
    Ok(rows)
}

/// The measurement a worker makes.
pub fn options(args: &BenchAllreduceArgs) -> Result<BenchOptions> {
    Ok(BenchOptions {
        sizes: sizes(args)?,
        iters: args.iters,
        // bf16 keeps 8 significant bits of each partial sum: the check's values fit them.
        exact_bits: if args.bf16 { 8 } else { 24 },
        ..BenchOptions::default()
    })
}

/// One rank of the TCP backend's benchmark (started by [`run`], or by hand on several
/// hosts); its rows carry the transport it used: `shm`, `tcp`, or `hier` (the hierarchical
/// all-reduce: shared memory and bytes to other hosts).
pub fn worker(args: &BenchAllreduceArgs) -> Result<()> {
    let opts = options(args)?;
    // The settings of the environment, in the schema's names (`FLOTILLA_COMM__CHUNK_KB`...).
    let settings = flotilla_train::program::settings()?;
    let rank = flotilla_train::program::launcher_rank()?;
    let world = settings.effective_world_size()?;
    let mut cfg = settings.comm_config(rank, settings.shared_hash(None), world)?;
    if args.bf16 {
        cfg.wire_format = WireFormat::Bf16;
    }
    if let Some(t) = args.transport.first() {
        cfg.transport = t.parse()?;
    }
    let comm = TcpGroup::connect(cfg)?;
    let rows = run_allreduce(&comm, &opts)?;
    let stats = comm.stats();
    let used = match (stats.shm_bytes > 0, stats.bytes_sent_inter_host > 0) {
        (true, true) => "hier",
        (true, false) => "shm",
        (false, _) => "tcp",
    };
    if comm.rank() == 0 {
        for r in &rows {
            println!("{}", Row::line(used, r));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_round_trip_through_their_line_by_label() {
        let r = BenchRow {
            bytes: 4096,
            world_size: 2,
            iters: 20,
            median: Duration::from_micros(125),
            algbw_gbs: 0.033,
            busbw_gbs: 0.033,
        };
        let line = Row::line("mpi", &r);
        let parsed = Row::parse(&line, "mpi").expect("parses");
        assert_eq!((parsed.bytes, parsed.iters), (4096, 20));
        assert!((parsed.secs - 125e-6).abs() < 1e-12 && parsed.busbw == 0.033);
        assert_eq!(Row::parse(&line, "raw"), None);
        assert_eq!(parse_size("64M").expect("size"), 64 << 20);
    }
}
