//! The effective [`TrainConfig`] of a command: its [`Sources`] — defaults, the config file,
//! the environment and the flags given (in that order of precedence, lowest first).

use anyhow::Result;
use flotilla_train::TrainConfig;
use flotilla_train::config::sources::Provenance;
pub use flotilla_train::config::sources::Sources;

use crate::run_args::RunArgs;

/// The sources of a command's config. `launcher_env`: also take the world size and
/// rendezvous address from a launcher's environment (torchrun, mpirun, Slurm) — for
/// `flotilla train`, which such launchers start.
pub fn sources(args: &RunArgs, launcher_env: bool) -> Result<Sources> {
    let mut sources = Sources::defaults();
    if let Some(path) = &args.config {
        sources = sources.file(path)?;
    }
    sources = sources.env(std::env::vars(), launcher_env)?;
    for (long, value) in &args.flags {
        sources = sources.flag(long, value.clone())?;
    }
    Ok(sources)
}

/// Defaults < file < environment < flags.
pub fn effective_config(args: &RunArgs, launcher_env: bool) -> Result<TrainConfig> {
    Ok(sources(args, launcher_env)?.extract()?)
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
