//! `flotilla compare CONFIG --strategies a,b,c`: the same model, data, optimizer, budget and
//! seed trained in each strategy, one after the other on this machine, each launched as
//! `flotilla launch` launches (into `OUTPUT/<strategy>/`, where its rank 0 writes its
//! `summary.json`), then one report of them all ([`report`]). A strategy that
//! cannot run this config fails in its own row, not the whole comparison. After `--`, a
//! program (one on `flotilla_burn::train`) runs as each strategy's ranks instead.

mod report;

use std::path::Path;

use anyhow::{Context, Result, bail};
use flotilla_train::TrainConfig;
use flotilla_train::presets::{self, Preset};

use crate::cli::{CompareArgs, LaunchArgs, RemoteArgs};
use crate::settings;
use flotilla_rank::report::{SUMMARY_FILE, read_summary};
use report::{Comparison, RunFacts, StrategyRun, Target};

/// The accuracy compared when neither `--target-accuracy` nor the config names one.
pub const DEFAULT_TARGET: f64 = 0.98;

/// The validation loss (nats) a text job's comparison times when the config names no
/// `target_loss`.
pub const DEFAULT_TARGET_LOSS: f64 = 1.6;

/// Runs `flotilla compare`.
pub fn run(args: &CompareArgs) -> Result<()> {
    // Every name is checked before anything runs.
    let chosen = args
        .strategies
        .iter()
        .map(|name| presets::preset(name.trim()))
        .collect::<Result<Vec<_>, _>>()?;
    if chosen.is_empty() {
        bail!("--strategies names no strategy");
    }
    let base = settings::effective_config(&args.run, false)?;
    // `-n`, a flag, is what `base` holds; without it, the config says.
    let workers = if args.run.given("world-size") {
        base.topology.world_size
    } else {
        presets::workers(&base)?
    };
    let target = target(args, &base)?;
    let out = base.telemetry.output.clone();
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let mut runs = Vec::with_capacity(chosen.len());
    for s in chosen {
        println!("== {}: {} ({workers} workers)", s.name, s.about);
        let outcome = run_one(&base, s, workers, args);
        if let Err(reason) = &outcome {
            eprintln!("{}: {reason}", s.name);
        }
        runs.push(StrategyRun {
            name: s.name,
            about: s.about,
            outcome: outcome.map_err(|e| first_line(&e)),
        });
    }
    let comparison = Comparison {
        setup: setup_line(&base, workers),
        target,
        runs,
    };
    let paths = report::write(&out, &comparison)?;
    print!("{}", report::markdown(&comparison));
    let shown: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
    println!("report: {}", shown.join(", "));
    if comparison.runs.iter().all(|r| r.outcome.is_err()) {
        bail!("no strategy ran (their reasons are in {})", shown[0]);
    }
    Ok(())
}

/// What the comparison times: the validation loss of a text job (`target_loss`), else the
/// accuracy (`--target-accuracy`, the config's `target_accuracy`).
fn target(args: &CompareArgs, base: &TrainConfig) -> Result<Target> {
    if matches!(
        base.data.source(),
        flotilla_train::config::DataSource::Text(_)
    ) {
        let loss = base.schedule.target_loss.unwrap_or(DEFAULT_TARGET_LOSS);
        return Ok(Target::Loss(loss));
    }
    let target = args
        .target_accuracy
        .or(base.schedule.target_accuracy)
        .unwrap_or(DEFAULT_TARGET);
    if !(target > 0.0 && target <= 1.0) {
        bail!("--target-accuracy must be in (0, 1], got {target}");
    }
    Ok(Target::Accuracy(target))
}

/// Launches `base` in strategy `s` into `<output>/<strategy>/` and reads its summary.
fn run_one(
    base: &TrainConfig,
    s: &Preset,
    workers: usize,
    args: &CompareArgs,
) -> Result<RunFacts, String> {
    let mut config = s.configure(base, workers);
    let dir = base.telemetry.output.join(s.name);
    config.telemetry.output = dir.clone();
    // One timeline per strategy, in its own directory.
    config.telemetry.timeline_path = base
        .telemetry
        .timeline_path
        .as_ref()
        .and_then(|p| p.file_name())
        .map(|name| dir.join(name));
    let facts = (|| -> Result<RunFacts> {
        // A summary left by an earlier comparison must not stand in for this run's.
        remove_stale(&dir.join(SUMMARY_FILE))?;
        // The preset has turned `-n` (the workers) into this strategy's ranks already.
        let mut run = args.run.clone();
        run.flags.retain(|(long, _)| *long != "world-size");
        let opts = LaunchArgs {
            run,
            threads: args.threads,
            oversubscribe: false,
            memory_per_rank: None,
            bind: crate::binding::Bind::default(),
            max_restarts: 0,
            start_ranks: None,
            remote: RemoteArgs::default(),
            program: args.program.clone(),
        };
        if opts.program.is_empty() {
            crate::launch::cmd::launch(config, &opts)?;
        } else {
            crate::launch::program::launch(config, &opts)?;
        }
        RunFacts::from_summary(&read_summary(&dir)?)
    })();
    facts.map_err(|e| format!("{e:#}"))
}

fn remove_stale(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(e).with_context(|| format!("removing {}", path.display()))
        }
        _ => Ok(()),
    }
}

/// The first line of an error (a failed job's error goes on with the rank's stderr).
fn first_line(error: &str) -> String {
    error.lines().next().unwrap_or(error).trim().to_string()
}

/// What every strategy ran, for the report's header.
fn setup_line(c: &TrainConfig, workers: usize) -> String {
    let budget = match (c.schedule.max_steps, c.schedule.epochs) {
        (Some(m), 0) => format!("{m} steps"),
        (Some(m), e) => format!("{e} epoch(s), at most {m} steps"),
        (None, e) => format!("{e} epoch(s)"),
    };
    let data = match c.data.train_limit {
        Some(n) => format!("the first {n} samples of {}", c.data.path.display()),
        None => c.data.path.display().to_string(),
    };
    let optimizer = serde_json::to_string(&c.optimizer).unwrap_or_default();
    format!(
        "Model `{}` on {data}, {budget}, batch {} per worker, optimizer `{optimizer}`, seed {}; \
         {workers} workers (ranks computing gradients) in every strategy.",
        c.model.spec, c.data.batch_size, c.model.seed,
    )
}
