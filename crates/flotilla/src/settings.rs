//! Building the effective [`TrainConfig`]: defaults, then the config file, then flags, then
//! (for `train`) the torchrun-style environment.

use anyhow::{Context, Result};
use flotilla_train::TrainConfig;

use crate::cli::RunArgs;

/// Defaults, overridden by the config file, overridden by flags.
pub fn effective_config(args: &RunArgs) -> Result<TrainConfig> {
    let mut c = match &args.config {
        Some(path) => TrainConfig::load(path)?,
        None => TrainConfig::default(),
    };
    if let Some(v) = &args.data {
        c.data = v.clone();
    }
    if let Some(v) = &args.output {
        c.output = v.clone();
    }
    if let Some(v) = args.epochs {
        c.epochs = v;
    }
    if let Some(v) = args.world_size {
        c.world_size = v;
    }
    if let Some(v) = args.batch_size {
        c.batch_size = v;
    }
    if let Some(v) = args.lr {
        set_lr(&mut c, v);
    }
    if let Some(v) = &args.model {
        c.model = v.clone();
    }
    if let Some(v) = args.seed {
        c.seed = v;
    }
    if let Some(v) = args.max_steps {
        c.max_steps = Some(v);
    }
    if let Some(v) = args.train_limit {
        c.train_limit = Some(v);
    }
    if let Some(v) = args.checkpoint_every {
        c.checkpoint_every = v;
    }
    if let Some(v) = args.bucket_mb {
        c.bucket_mb = v;
    }
    if let Some(v) = &args.device {
        c.device = v.clone();
    }
    if let Some(v) = &args.master_addr {
        c.master_addr = v.clone();
    }
    if let Some(v) = args.master_port {
        c.master_port = v;
    }
    if let Some(v) = args.timeout_s {
        c.timeout_s = v;
    }
    if let Some(v) = &args.inventory {
        c.inventory = Some(v.clone());
    }
    if args.resume {
        c.resume = true;
    }
    Ok(c)
}

fn set_lr(c: &mut TrainConfig, lr: f64) {
    use flotilla_engine::OptimizerSpec::*;
    match &mut c.optimizer {
        Sgd { lr: l, .. } | Adam { lr: l, .. } | Adamw { lr: l, .. } => *l = lr,
    }
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

fn env_parse<T: std::str::FromStr>(names: &[&str]) -> Result<Option<T>> {
    for name in names {
        if let Some(v) = env(name) {
            let parsed = v
                .trim()
                .parse()
                .ok()
                .with_context(|| format!("cannot parse ${name}={v:?}"))?;
            return Ok(Some(parsed));
        }
    }
    Ok(None)
}

/// Applies the launcher environment of torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT),
/// Open MPI (OMPI_COMM_WORLD_RANK/SIZE) and Slurm (SLURM_PROCID/NTASKS); returns the rank it
/// names, if any. Flags given explicitly win over the environment.
pub fn apply_launcher_env(c: &mut TrainConfig, args: &RunArgs) -> Result<Option<usize>> {
    let rank = env_parse::<usize>(&["RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"])?;
    if args.world_size.is_none()
        && let Some(n) = env_parse::<usize>(&[
            "WORLD_SIZE",
            "OMPI_COMM_WORLD_SIZE",
            "PMI_SIZE",
            "SLURM_NTASKS",
        ])?
    {
        c.world_size = n;
    }
    if args.master_addr.is_none()
        && let Some(a) = env("MASTER_ADDR")
    {
        c.master_addr = a;
    }
    if args.master_port.is_none()
        && let Some(p) = env_parse::<u16>(&["MASTER_PORT"])?
    {
        c.master_port = p;
    }
    Ok(rank)
}
