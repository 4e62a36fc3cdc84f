//! The `flotilla` command: `train` (one rank), `launch` (N local ranks), `compare` (one
//! config in several strategies), `bench`, `config`, `certs` (TLS certificates), `secret`
//! (a cluster secret), `checkpoint` (what a checkpoint holds, its export).

mod bench;
mod binding;
mod capacity;
mod certs;
mod checkpoint;
mod cli;
mod compare;
mod gpu_placement;
mod heap;
mod job_secret;
mod launch;
mod rendezvous_socket;
mod run_args;
mod secret;
mod settings;
mod stop;

use std::process::ExitCode;

use anyhow::Result;
use clap::Parser;

use cli::{Cli, Command, TrainArgs};
use flotilla_rank::telemetry;

fn main() -> ExitCode {
    heap::keep_freed_buffers();
    let cli = Cli::parse_from(cli::expand_size_range(std::env::args_os()));
    let result = match cli.command {
        Command::Train(args) => train(&args),
        Command::Launch(args) => init_telemetry().and_then(|_| launch::cmd::run(&args)),
        Command::Stop(args) => stop::run(&args),
        Command::Compare(args) => init_telemetry().and_then(|_| compare::run(&args)),
        Command::Bench(cmd) => init_telemetry().and_then(|_| bench::run(cmd)),
        Command::Config(args) => init_telemetry().and_then(|_| show_config(&args)),
        Command::Trace(cli::TraceCommand::Merge(args)) => trace_merge(&args),
        Command::Certs(args) => certs::run(&args),
        Command::Secret(args) => secret::run(&args),
        Command::Checkpoint(args) => checkpoint::run(&args),
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

/// The process's tracing subscriber, for a command that is not a training rank.
fn init_telemetry() -> Result<()> {
    telemetry::init(None)?;
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
    // burn's default device, as `flotilla launch` names it for its ranks: a rank started by
    // hand (joining an elastic job mid-run, or under a scheduler of its own) that trains on
    // Flex otherwise opens Vulkan whenever it takes optimizer state from a peer or a
    // checkpoint (`flotilla_engine::burn_device_for`).
    if let Some((key, value)) = launch::burn_device_env(&config) {
        // SAFETY: this process has one thread here: main starts none before `train`, and the
        // config was only read and parsed (no device opened yet: `validate` below may open a
        // GPU's driver, which starts threads), so nothing reads the environment meanwhile.
        unsafe { std::env::set_var(key, value) };
    }
    let spec = config.validate()?;
    match flotilla_rank::run(&config, &spec, rank) {
        Ok(_) => Ok(()),
        // A process standing by for a place in a pipeline's replicas when the job ended.
        Err(e) if e.stood_by() => {
            println!("{e}: it ends with the job");
            Ok(())
        }
        Err(e) => Err(anyhow::Error::from(e).context(match rank {
            Some(r) => format!("rank {r} failed"),
            None => "training failed".to_string(),
        })),
    }
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
