//! `flotilla bench allreduce --backend mpi`: for each number of ranks, an `mpirun` job whose
//! ranks time the MPI backend's all-reduce (`MpiGroup::all_reduce_sum`: queued to the
//! group's worker, `MPI_Allreduce`, copied back) and Open MPI's own `MPI_Allreduce` called
//! directly, next to the TCP ring measured with the same sizes.

use crate::bench::measure::BenchOptions;
#[cfg(feature = "mpi")]
use crate::bench::measure::format_bytes;
use anyhow::Result;

#[cfg(feature = "mpi")]
use crate::bench::allreduce::Row;
use crate::cli::BenchAllreduceArgs;

/// Prints the three-way table.
#[cfg(feature = "mpi")]
pub fn table(args: &BenchAllreduceArgs) -> Result<()> {
    crate::bench::allreduce::check_ranks(args)?;
    println!(
        "# flotilla bench allreduce --backend mpi: f32 sums through Flotilla's MPI backend, the TCP ring over 127.0.0.1, and Open MPI's MPI_Allreduce called directly (reference), same sizes and ranks"
    );
    println!(
        "# {} cores on this machine; MPI ranks started by mpirun --oversubscribe",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!(
        "{:>6} {:>10} {:>6} {:>12} {:>10} {:>10} {:>10} {:>8} {:>8}",
        "ranks",
        "size",
        "iters",
        "mpi_us",
        "tcp_busbw",
        "mpi_busbw",
        "ompi_busbw",
        "mpi/ompi",
        "tcp/ompi"
    );
    for &n in &args.ranks {
        let tcp: Vec<_> = crate::bench::allreduce::rows(args, n, flotilla_tcp::Transport::Tcp)?
            .into_iter()
            .map(|(_, r)| r)
            .collect();
        let (mpi, raw) = mpirun_rows(args, n)?;
        for m in &mpi {
            let t = tcp.iter().find(|r| r.bytes == m.bytes);
            let o = raw.iter().find(|r| r.bytes == m.bytes);
            let tb = t.map_or(f64::NAN, |r| r.busbw);
            let ob = o.map_or(f64::NAN, |r| r.busbw);
            println!(
                "{:>6} {:>10} {:>6} {:>12.1} {:>10.3} {:>10.3} {:>10.3} {:>8.2} {:>8.2}",
                n,
                format_bytes(m.bytes),
                m.iters,
                m.secs * 1e6,
                tb,
                m.busbw,
                ob,
                m.busbw / ob,
                tb / ob
            );
        }
    }
    Ok(())
}

/// Without the feature: a clear error.
#[cfg(not(feature = "mpi"))]
pub fn table(_args: &BenchAllreduceArgs) -> Result<()> {
    anyhow::bail!(
        "--backend mpi: this binary was built without the `mpi` feature; rebuild with `cargo build --release --features mpi`"
    )
}

/// Runs `n` MPI ranks of the worker; rank 0's rows of the backend and of raw MPI.
#[cfg(feature = "mpi")]
fn mpirun_rows(args: &BenchAllreduceArgs, n: usize) -> Result<(Vec<Row>, Vec<Row>)> {
    use anyhow::{Context, bail};
    use std::io::BufRead;
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};

    let exe = std::env::current_exe().context("locating the flotilla executable")?;
    let mut child = Command::new("mpirun")
        .args(["--oversubscribe", "-np", &n.to_string()])
        .arg(exe)
        .args(crate::bench::allreduce::worker_args(args, "mpi")?)
        // Lets mpirun run when the user is root (containers); no effect otherwise.
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("RAYON_NUM_THREADS", "1")
        .stdout(Stdio::piped())
        .spawn()
        .context("starting mpirun (Debian: apt-get install openmpi-bin)")?;
    let stdout = child.stdout.take().context("mpirun's stdout")?;
    let reader = std::thread::spawn(move || {
        let (mut mpi, mut raw) = (Vec::new(), Vec::new());
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(|l| l.ok())
        {
            if let Some(r) = Row::parse(&line, "mpi") {
                mpi.push(r);
            } else if let Some(r) = Row::parse(&line, "raw") {
                raw.push(r);
            }
        }
        (mpi, raw)
    });
    let started = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        if started.elapsed() > Duration::from_secs(1800) {
            let _ = child.kill();
            let _ = child.wait();
            bail!("mpirun -np {n} did not finish within 30 minutes");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let rows = reader
        .join()
        .map_err(|_| anyhow::anyhow!("reading mpirun's output failed"))?;
    if !status.success() {
        bail!("mpirun -np {n} failed ({status})");
    }
    Ok(rows)
}

/// One MPI rank: the backend's all-reduce, then raw `MPI_Allreduce`; rank 0 prints both.
#[cfg(feature = "mpi")]
pub fn worker(opts: &BenchOptions) -> Result<()> {
    use crate::bench::measure::{measure_allreduce, run_allreduce};
    use flotilla_tcp::ProcessGroup;

    let world = flotilla_mpi::MpiGroup::world(flotilla_mpi::MpiConfig::default())?;
    let mpi = run_allreduce(&world, opts)?;
    // Raw `MPI_Allreduce` on a communicator of its own, in the same loop; `world`
    // synchronises the iterations and gathers the times.
    let mut raw = flotilla_mpi::RawAllReduce::new(&world)?;
    let raw = measure_allreduce(&world, opts, &mut |buf: &mut Vec<f32>| raw.sum(buf))?;
    if world.rank() == 0 {
        for r in &mpi {
            println!("{}", Row::line("mpi", r));
        }
        for r in &raw {
            println!("{}", Row::line("raw", r));
        }
    }
    Ok(())
}

/// Without the feature: a clear error.
#[cfg(not(feature = "mpi"))]
pub fn worker(_opts: &BenchOptions) -> Result<()> {
    anyhow::bail!(
        "--backend mpi: this binary was built without the `mpi` feature; rebuild with `cargo build --release --features mpi`"
    )
}
