//! The `flotilla` command: `train` (one rank), `launch` (N local ranks), `bench`, `config`.

mod bench;
mod bench_ps;
mod cli;
mod launch;
mod progress;
mod settings;
mod telemetry;

use std::ffi::OsString;
use std::io::IsTerminal;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Parser;

use cli::{Cli, Command, LaunchArgs, TrainArgs};
use flotilla_telemetry::RankEvent;
use launch::{LocalJob, Stream};
use progress::{PROGRESS_ENV, TrainObserver, step_bar};

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Train(args) => train(&args),
        Command::Launch(args) => telemetry::init(None).and_then(|_| launch(&args)),
        Command::Bench(cmd) => telemetry::init(None).and_then(|_| bench::run(cmd)),
        Command::Config(args) => telemetry::init(None).and_then(|_| show_config(&args)),
        Command::Trace(cli::TraceCommand::Merge(args)) => trace_merge(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// `flotilla config`: the effective config, checked, each value with the layer it came
/// from, then the topology and its placement.
fn show_config(args: &cli::RunArgs) -> Result<()> {
    let layers = settings::layers(args, false)?;
    let config = layers.extract()?;
    config.validate()?;
    print!("{}", settings::annotated_yaml(&layers.provenance()?));
    let topology = config.topology()?;
    if topology.arch() != flotilla_cluster::Arch::Allreduce {
        let placement = match &config.topology.inventory {
            Some(path) => {
                flotilla_cluster::place(&topology, &flotilla_cluster::Inventory::load(path)?)?
            }
            None => flotilla_cluster::Placement::local(&topology),
        };
        println!("# placement");
        for line in placement.describe().lines() {
            println!("# {line}");
        }
    }
    Ok(())
}

fn train(args: &TrainArgs) -> Result<()> {
    let config = settings::effective_config(&args.run, true)?;
    let rank = match args.rank {
        Some(r) => Some(r),
        None => settings::launcher_rank()?,
    };
    let rank_telemetry = telemetry::init(Some((&config, rank)))?;
    let mut observer = TrainObserver::new(rank_telemetry, config.telemetry.metrics_port);
    let result = flotilla_train::run(&config, rank, &mut observer);
    observer.finish();
    if let Err(e) = &result
        && let Some(blamed) = e.blamed_rank()
    {
        // Tells a supervising launcher which rank this failure points at.
        println!("{}", RankEvent::Failed { blamed }.line());
    }
    let summary = result.with_context(|| match rank {
        Some(r) => format!("rank {r} failed"),
        None => "training failed".to_string(),
    })?;
    if let Some(dir) = &summary.checkpoint {
        println!("checkpoint: {}", dir.display());
    }
    if observer.emits_events() {
        let event = RankEvent::Finished {
            role: summary.role.to_string(),
            figures: summary.figures.clone(),
        };
        println!("{}", event.line());
    }
    println!("{}", summary.final_line());
    Ok(())
}

/// `flotilla trace merge`: joins rank timeline files into one Chrome trace.
fn trace_merge(args: &cli::TraceMergeArgs) -> Result<()> {
    let report = flotilla_telemetry::merge(&args.inputs, &args.output)?;
    println!(
        "{} events of {} files in {}",
        report.events,
        report.files,
        args.output.display()
    );
    for t in report.truncated {
        println!(
            "{} ends mid-line (its rank died); its complete lines are merged",
            t.display()
        );
    }
    Ok(())
}

fn launch(args: &LaunchArgs) -> Result<()> {
    let mut config = settings::effective_config(&args.run, false)?;
    if args.run.master_port.is_none() {
        config.comm.master_port = launch::free_port()?;
    }
    if args.run.master_addr.is_none() {
        config.comm.master_addr = "127.0.0.1".into();
    }
    let spec = config.validate()?;
    let n = config.effective_world_size()?;
    std::fs::create_dir_all(&config.telemetry.output)
        .with_context(|| format!("creating {}", config.telemetry.output.display()))?;
    let config_path = config.telemetry.output.join("launch-config.yaml");
    std::fs::write(&config_path, serde_norway::to_string(&config)?)
        .with_context(|| format!("writing {}", config_path.display()))?;
    println!(
        "launching {n} ranks of {} on {}:{} (output {})",
        spec.name,
        config.comm.master_addr,
        config.comm.master_port,
        config.telemetry.output.display()
    );
    let topology = config.topology()?;
    if topology.arch() != flotilla_cluster::Arch::Allreduce {
        for line in flotilla_cluster::Placement::local(&topology)
            .describe()
            .lines()
        {
            println!("{line}");
        }
    }

    let train_args: Vec<OsString> = vec!["train".into(), config_path.clone().into_os_string()];
    let threads = args.threads.max(1).to_string();
    // Every thread pool a backend may use (rayon for flex, OpenMP/MKL for LibTorch) gets the
    // per-rank thread count, unless the caller set it: an oversubscribed OpenMP pool collapses.
    let thread_vars: Vec<(String, String)> =
        ["RAYON_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"]
            .iter()
            .map(|k| {
                let v = std::env::var(k).unwrap_or_else(|_| threads.clone());
                (k.to_string(), v)
            })
            .collect();
    let mut job = LocalJob::spawn(n, &train_args, |rank| {
        let mut env = vec![
            ("RANK".into(), rank.to_string()),
            ("WORLD_SIZE".into(), n.to_string()),
            ("MASTER_ADDR".into(), config.comm.master_addr.clone()),
            ("MASTER_PORT".into(), config.comm.master_port.to_string()),
            (PROGRESS_ENV.into(), "1".into()),
        ];
        env.extend(thread_vars.iter().cloned());
        env
    })?;

    job.tolerate(tolerated_ranks(&topology));
    let interactive = std::io::stderr().is_terminal();
    let mut bar = None;
    let mut final_line = None;
    let mut finished: Vec<serde_json::Value> = Vec::new();
    let result = job.supervise(None, &mut |line| {
        if line.stream == Stream::Stdout {
            match RankEvent::parse(&line.text) {
                Some(Ok(RankEvent::Progress {
                    step,
                    total,
                    epoch,
                    epochs,
                    loss,
                })) => {
                    if line.rank == 0 && interactive {
                        let b = bar.get_or_insert_with(|| step_bar(total));
                        if let Some(b) = b {
                            b.set_position(step);
                            b.set_message(format!("epoch {epoch}/{epochs} loss {loss:.4}"));
                        }
                    }
                    return;
                }
                Some(Ok(RankEvent::Finished { role, figures })) => {
                    finished.push(serde_json::json!({
                        "rank": line.rank, "role": role, "figures": figures
                    }));
                    return;
                }
                Some(Ok(RankEvent::Failed { .. })) => return,
                // A malformed event is shown as the text it is.
                Some(Err(_)) | None => {}
            }
            if line.rank == 0 && line.text.starts_with("final ") {
                final_line = Some(line.text.clone());
            }
        }
        let text = format!("[rank {}] {}", line.rank, line.text);
        match (&bar, line.stream) {
            (Some(Some(b)), _) => b.println(text),
            (_, Stream::Stdout) => println!("{text}"),
            (_, Stream::Stderr) => eprintln!("{text}"),
        }
    });
    if let Some(Some(b)) = bar {
        b.finish_and_clear();
    }
    if let Some(dest) = &config.telemetry.timeline_path {
        // Also after a failure: the timeline of a failed job is where to look.
        match telemetry::merge_rank_timelines(&config.telemetry.output, n, dest) {
            Ok(line) => println!("{line}"),
            Err(e) => eprintln!("warning: merging the timeline: {e:#}"),
        }
    }
    result?;
    finished.sort_by_key(|v| v["rank"].as_u64());
    let summary_path = config.telemetry.output.join("summary.json");
    std::fs::write(
        &summary_path,
        serde_json::to_vec_pretty(&serde_json::json!({ "ranks": finished }))?,
    )
    .with_context(|| format!("writing {}", summary_path.display()))?;
    match final_line {
        Some(line) => println!("{line}"),
        None => anyhow::bail!("rank 0 exited without a final line"),
    }
    Ok(())
}

/// Ranks whose loss an asynchronous server above them absorbs: a rank is tolerated if any
/// link on its path to the root ends at an `async` server.
fn tolerated_ranks(topology: &flotilla_cluster::Topology) -> Vec<usize> {
    let is_async = |rank: usize| {
        topology
            .role(rank)
            .and_then(|r| r.aggregation)
            .is_some_and(|a| a == flotilla_cluster::Aggregation::Async)
    };
    (0..topology.world_size())
        .filter(|&rank| {
            let mut at = rank;
            for _ in 0..topology.world_size() {
                let Some(parent) = topology.role(at).and_then(|r| r.parents.first().copied())
                else {
                    return false;
                };
                if is_async(parent) {
                    return true;
                }
                at = parent;
            }
            false
        })
        .collect()
}
