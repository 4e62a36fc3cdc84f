//! The effective [`TrainConfig`] of a command: its [`Sources`] — defaults, the config file,
//! the environment and the flags given (in that order of precedence, lowest first).

use anyhow::Result;
use flotilla_train::TrainConfig;
use flotilla_train::config::sources::{Provenance, Sources};
use serde_json::{Value, json};

use crate::cli::RunArgs;

/// The sources of a command's config. `launcher_env`: also take the world size and
/// rendezvous address from a launcher's environment (torchrun, mpirun, Slurm) — for
/// `flotilla train`, which such launchers start.
pub fn sources(args: &RunArgs, launcher_env: bool) -> Result<Sources> {
    let mut sources = Sources::defaults();
    if let Some(path) = &args.config {
        sources = sources.file(path)?;
    }
    sources = sources.env(std::env::vars(), launcher_env)?;
    for (flag, tree) in flags(args) {
        sources = sources.tree(tree, &format!("flag --{flag}"))?;
    }
    Ok(sources)
}

/// Defaults < file < environment < flags.
pub fn effective_config(args: &RunArgs, launcher_env: bool) -> Result<TrainConfig> {
    Ok(sources(args, launcher_env)?.extract()?)
}

/// One `(flag, {alias: value})` per flag given on the command line.
fn flags(a: &RunArgs) -> Vec<(&'static str, Value)> {
    let mut out = Vec::new();
    let mut put = |flag: &'static str, key: &str, v: Option<Value>| {
        if let Some(v) = v {
            out.push((flag, json!({ key: v })));
        }
    };
    let path = |p: &Option<std::path::PathBuf>| p.as_ref().map(|p| json!(p));
    put("data", "data", path(&a.data));
    put("output", "output", path(&a.output));
    put("epochs", "epochs", a.epochs.map(|v| json!(v)));
    put("world-size", "world_size", a.world_size.map(|v| json!(v)));
    put("batch-size", "batch_size", a.batch_size.map(|v| json!(v)));
    put("lr", "lr", a.lr.map(|v| json!(v)));
    put("model", "model", a.model.as_ref().map(|v| json!(v)));
    put("seed", "seed", a.seed.map(|v| json!(v)));
    put("max-steps", "max_steps", a.max_steps.map(|v| json!(v)));
    put(
        "train-limit",
        "train_limit",
        a.train_limit.map(|v| json!(v)),
    );
    put(
        "checkpoint-every",
        "checkpoint_every",
        a.checkpoint_every.map(|v| json!(v)),
    );
    put("bucket-mb", "bucket_mb", a.bucket_mb.map(|v| json!(v)));
    put("device", "device", a.device.as_ref().map(|v| json!(v)));
    put("backend", "backend", a.backend.as_ref().map(|v| json!(v)));
    put(
        "master-addr",
        "master_addr",
        a.master_addr.as_ref().map(|v| json!(v)),
    );
    put(
        "master-port",
        "master_port",
        a.master_port.map(|v| json!(v)),
    );
    put("timeout-s", "timeout_s", a.timeout_s.map(|v| json!(v)));
    put("inventory", "inventory", path(&a.inventory));
    put("resume", "resume", a.resume.then_some(json!(true)));
    put("timeline", "timeline_path", path(&a.timeline));
    put(
        "metrics-port",
        "metrics_port",
        a.metrics_port.map(|v| json!(v)),
    );
    out
}

/// The rank a launcher's environment names (see [`flotilla_cluster::launcher_env`] for the
/// variables and their order), if any.
pub fn launcher_rank() -> Result<Option<usize>> {
    let e = flotilla_cluster::LauncherEnv::from_process()?;
    Ok(e.rank.map(|r| r.value))
}

/// Refuses at once a `flotilla train` of a multi-rank job that has neither a rank (flag or
/// launcher variable) nor a rendezvous address from any source: such a process would wait out
/// the join deadline for a rank 0 nobody started. (With an address, a process without a rank
/// joins and rank 0 assigns it one.)
pub fn check_rank_source(
    sources: &Sources,
    config: &TrainConfig,
    rank: Option<usize>,
) -> Result<()> {
    let world = config.effective_world_size()?;
    // With MPI, mpirun gives the rank (and the backend says so when it is missing).
    if rank.is_some() || world <= 1 || config.comm.backend == flotilla_train::config::Backend::Mpi {
        return Ok(());
    }
    let provenance = sources.provenance()?;
    let given = |path: &str| {
        provenance
            .iter()
            .any(|p| p.path == path && p.source != "default")
    };
    if given("comm.master_addr") || given("comm.master_port") {
        return Ok(());
    }
    anyhow::bail!(
        "`flotilla train` runs one rank of a {world}-rank job, and nothing says which rank it \
         is or where rank 0 listens: set RANK (or --rank; mpirun, srun and torchrun set theirs) \
         and MASTER_ADDR / MASTER_PORT for ranks on other hosts. To train on this machine, \
         `flotilla launch` starts all {world} ranks, and `flotilla train -n 1` trains alone."
    )
}

/// The effective config as YAML, every value followed by `# <where it came from>`.
pub fn annotated_yaml(values: &[Provenance]) -> String {
    let mut out = String::new();
    let mut open: Vec<&str> = Vec::new();
    for p in values {
        let parts: Vec<&str> = p.path.split('.').collect();
        let Some((leaf, parents)) = parts.split_last() else {
            continue;
        };
        let common = open.iter().zip(parents).take_while(|(a, b)| a == b).count();
        open.truncate(common);
        for (depth, key) in parents.iter().enumerate().skip(common) {
            out.push_str(&format!("{}{key}:\n", "  ".repeat(depth)));
            open.push(key);
        }
        out.push_str(&format!(
            "{}{leaf}: {}  # {}\n",
            "  ".repeat(parents.len()),
            p.value,
            p.source
        ));
    }
    out
}
