//! This rank's GPU: a config naming a GPU device without an index (`device: cuda`) runs on
//! the GPU of the rank's local rank (`LOCAL_RANK`, or the launcher's: Open MPI's
//! `OMPI_COMM_WORLD_LOCAL_RANK`, Slurm's `SLURM_LOCALID`, ...; 0 when none is set),
//! round-robin over the host's GPUs (`flotilla_engine::local_device`).

use flotilla_cluster::LauncherEnv;

use crate::config::TrainConfig;
use crate::error::{Result, TrainError};

/// This process's local rank as its launcher gives it (0 when it gives none).
pub fn local_rank() -> Result<usize> {
    let env = LauncherEnv::from_process()
        .map_err(|e| TrainError::config("launcher variables", e.to_string()))?;
    Ok(env.local_rank.map_or(0, |l| l.value))
}

/// `config` with its device resolved for this rank (`cuda` → `cuda:i`); CPU backends and
/// explicit indices are kept.
pub fn on_local_gpu(config: &TrainConfig) -> Result<TrainConfig> {
    let bad = |e: flotilla_engine::EngineError| TrainError::config("model.device", e.to_string());
    let mut config = config.clone();
    let spec = flotilla_engine::DeviceSpec::parse(&config.model.device).map_err(bad)?;
    // Only a GPU named without its index reads the launcher's local rank: the CPU path is
    // as before.
    if spec.gpu().is_some() && spec.index.is_none() {
        config.model.device =
            flotilla_engine::local_device(&config.model.device, local_rank()?).map_err(bad)?;
    }
    Ok(config)
}
