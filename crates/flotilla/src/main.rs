//! The `flotilla` command: `train` (one rank), `launch` (N local ranks), `compare` (one
//! config in several strategies), `bench`, `config`, `certs` (TLS certificates), `secret`
//! (a cluster secret).

mod bench;
mod bench_allreduce;
mod bench_job;
mod bench_mpi;
mod bench_pipeline;
mod bench_ps;
mod binding;
mod capacity;
mod certs_cmd;
mod cli;
mod compare;
mod compare_report;
mod gpu_placement;
mod heap;
mod job_secret;
mod launch;
mod launch_cmd;
mod launch_program;
mod launch_tls;
mod plots;
mod progress;
mod relay;
mod remote;
mod remote_launch;
mod rendezvous_socket;
mod report;
mod run_args;
mod secret_cmd;
mod settings;
mod stop_cmd;
mod telemetry;

use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Parser;

use cli::{Cli, Command, TrainArgs};
use flotilla_telemetry::RankEvent;
use progress::TrainObserver;

fn main() -> ExitCode {
    heap::keep_freed_buffers();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Train(args) => train(&args),
        Command::Launch(args) => telemetry::init(None).and_then(|_| launch_cmd::run(&args)),
        Command::Stop(args) => stop_cmd::run(&args),
        Command::Compare(args) => telemetry::init(None).and_then(|_| compare::run(&args)),
        Command::Bench(cmd) => telemetry::init(None).and_then(|_| bench::run(cmd)),
        Command::Config(args) => telemetry::init(None).and_then(|_| show_config(&args)),
        Command::Trace(cli::TraceCommand::Merge(args)) => trace_merge(&args),
        Command::Certs(args) => certs_cmd::run(&args),
        Command::Secret(args) => secret_cmd::run(&args),
    };
    let code = match &result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    };
    // MPI (if this process started it) ends here, after every group is gone; a failure
    // ends the whole MPI job.
    flotilla_train::backend::finish(result.is_ok());
    code
}

/// `flotilla config`: the effective config, checked, each value with the source it came
/// from, then the topology and its placement.
fn show_config(args: &run_args::RunArgs) -> Result<()> {
    let sources = settings::sources(args, false)?;
    let config = sources.extract()?;
    let spec = config.validate()?;
    print!("{}", settings::annotated_yaml(&sources.provenance()?));
    let topology = config.topology()?;
    if topology.arch() == flotilla_cluster::Arch::Pipeline {
        let plan = flotilla_train::pipeline::plan(&config, &spec)?;
        println!("# plan (profiled on this machine)");
        for line in plan.describe(&config).lines() {
            println!("# {line}");
        }
    } else if topology.arch() != flotilla_cluster::Arch::Allreduce {
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
    let sources = settings::sources(&args.run, true)?;
    let config = sources.extract()?;
    let rank = match args.rank {
        Some(r) => Some(r),
        None => settings::launcher_rank()?,
    };
    settings::check_rank_source(&sources, &config, rank)?;
    let rank_telemetry = telemetry::init(Some((&config, rank)))?;
    let mut observer = TrainObserver::new(
        rank_telemetry,
        config.telemetry.metrics_port,
        &config.telemetry.metrics_addr,
    );
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
    if summary.rank == 0 {
        // Rank 0 has the evaluations and every rank's traffic: the run's report is its job.
        let written = report::write_run(&config, &summary).context("writing the run's report")?;
        let paths: Vec<String> = written.iter().map(|p| p.display().to_string()).collect();
        println!("report: {}", paths.join(", "));
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
