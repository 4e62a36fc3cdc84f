//! `flotilla bench pipeline`: pipeline schedules compared in one run. Each case is a real local
//! job (`flotilla launch` of a generated `strategy: pipeline` config, the cut chosen
//! automatically); every rank reports its compute time and its time in training steps, so
//! the measured bubble (the share of a step a stage waits) is printed next to the ideal
//! `(S − 1) / (M + S − 1)`, with throughput as a ratio to one process (S = 1) measured in the
//! same run. Every case runs `--repeats` times, one pass over all cases after the other with
//! the reference at the start of each pass, and is reported by its median pass with the
//! spread (this machine's speed drifts by tens of percent within minutes); each stage's peak micro-batches of activations in flight, and the balance of the
//! automatic cut (slowest stage's compute over the mean).

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};

use crate::bench::job::{self, Figures};
use crate::cli::BenchPipelineArgs;

/// What one case measured.
struct Case {
    samples_per_s: f64,
    idle: Vec<f64>,
    peak: Vec<f64>,
    activation_mib: Vec<f64>,
    balance: f64,
}

fn measure(dir: &Path, name: &str, yaml: &str, samples: f64) -> Result<Case> {
    let ranks = job::run(dir, name, yaml, Duration::from_secs(900))?;
    let get = |f: &Figures, k: &str| f.get(k).copied().unwrap_or(f64::NAN);
    let column = |k: &str| ranks.iter().map(|f| get(f, k)).collect::<Vec<f64>>();
    let training = column("training_s").into_iter().fold(0.0, f64::max);
    let compute = column("compute_s");
    let mean = compute.iter().sum::<f64>() / compute.len().max(1) as f64;
    let slowest = compute.iter().copied().fold(0.0, f64::max);
    Ok(Case {
        samples_per_s: samples / training.max(1e-9),
        idle: column("idle_fraction"),
        peak: column("peak_in_flight"),
        activation_mib: column("peak_activation_mib"),
        balance: slowest / mean.max(1e-12),
    })
}

fn list(v: &[f64], digits: usize) -> String {
    v.iter()
        .map(|x| format!("{x:.digits$}"))
        .collect::<Vec<_>>()
        .join("/")
}

/// One case: stages, schedule, micro-batches.
type Key = (usize, &'static str, usize);

/// Prints the reference and, per case, the median pass against it with the spread.
fn print_table(keys: &[Key], runs: Vec<Vec<Case>>, reference: f64, references: &[f64]) {
    println!(
        "reference: 1 process, median {reference:.0} samples/s ({})",
        list(references, 0)
    );
    println!(
        "bubble = share of its training time a stage waits (per stage, first to last), of the median pass; ideal (S-1)/(M+S-1)"
    );
    println!(
        "{:<3} {:<6} {:>3} {:>10} {:>16} {:>7} {:>18} {:>12} {:>14} {:>7}",
        "S",
        "sched",
        "M",
        "samples/s",
        "ratio (spread)",
        "ideal",
        "bubble per stage",
        "peak mb",
        "act. MiB",
        "balance"
    );
    for (&(s, schedule, m), mut cases) in keys.iter().zip(runs) {
        cases.sort_by(|a, b| a.samples_per_s.total_cmp(&b.samples_per_s));
        let (lo, hi) = (cases[0].samples_per_s, cases[cases.len() - 1].samples_per_s);
        let c = &cases[cases.len() / 2];
        let ideal = (s - 1) as f64 / (m + s - 1) as f64;
        println!(
            "{s:<3} {schedule:<6} {m:>3} {:>10.0} {:>16} {:>7.2} {:>18} {:>12} {:>14} {:>7.2}",
            c.samples_per_s,
            format!(
                "{:.2} ({:.2}-{:.2})",
                c.samples_per_s / reference,
                lo / reference,
                hi / reference
            ),
            ideal,
            list(&c.idle, 2),
            list(&c.peak, 0),
            list(&c.activation_mib, 1),
            c.balance
        );
    }
}

/// Runs the bench.
pub fn run(args: &BenchPipelineArgs) -> Result<()> {
    let dir = tempfile::tempdir().context("temporary directory")?;
    let common = format!(
        "strategy: pipeline\nmodel: {}\nbatch_size: {}\nmax_steps: {}\nwarmup_steps: 0\neval_every: 0\noptimizer: {{name: sgd, lr: 0.05, momentum: 0.9}}\n",
        args.model, args.batch_size, args.steps
    );
    // The first step of every rank warms up and is not timed.
    let samples = (args.steps.saturating_sub(1) * args.batch_size) as f64;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let repeats = args.repeats.max(1);
    println!(
        "pipeline bench: {}, batch {}, {} steps per case, one thread per rank, {cores} cores, {repeats} passes",
        args.model, args.batch_size, args.steps
    );
    let keys: Vec<Key> = args
        .stages
        .iter()
        .flat_map(|&s| {
            ["gpipe", "1f1b"]
                .into_iter()
                .flat_map(move |schedule| args.micro_batches.iter().map(move |&m| (s, schedule, m)))
        })
        .collect();
    // Every case once per pass, the reference (one process) at the start of each: the
    // machine's drift reaches every case alike.
    let reference_yaml = format!("{common}stages: 1\nmicro_batches: 1\n");
    let mut references = Vec::new();
    let mut runs: Vec<Vec<Case>> = keys.iter().map(|_| Vec::new()).collect();
    for pass in 0..repeats {
        let name = format!("reference-{pass}");
        references.push(measure(dir.path(), &name, &reference_yaml, samples)?.samples_per_s);
        for (k, &(s, schedule, m)) in keys.iter().enumerate() {
            let name = format!("s{s}-{schedule}-m{m}-{pass}");
            let yaml = format!("{common}stages: {s}\nmicro_batches: {m}\nschedule: {schedule}\n");
            runs[k].push(measure(dir.path(), &name, &yaml, samples)?);
        }
    }
    let reference = median(&references);
    print_table(&keys, runs, reference, &references);
    if args.stages.iter().any(|&s| s > cores) {
        println!(
            "note: with more stages than {cores} cores, stages share cores: their waiting includes waiting for a core"
        );
    }
    Ok(())
}

fn median(v: &[f64]) -> f64 {
    let mut sorted = v.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[sorted.len() / 2]
}
