//! A program's settings and world group, from the one settings schema a config job reads
//! ([`crate::config::keys`]): a program started by `flotilla launch -- PROGRAM` (or torchrun,
//! mpirun, Slurm, by hand) reads the same keys under the same names and units as
//! `flotilla train` — defaults < the file `FLOTILLA_CONFIG` names < the environment
//! (`FLOTILLA_<SECTION>__<FIELD>`, `FLOTILLA_<ALIAS>`, and the launcher's `WORLD_SIZE`,
//! `MASTER_ADDR`, `MASTER_PORT`) — and joins its job through the same backends
//! ([`crate::backend::connect`]: TCP, MPI, NCCL).

use std::path::Path;
use std::sync::Arc;

use flotilla_tcp::{ProcessGroup, Rejoin};

use crate::config::TrainConfig;
use crate::config::sources::Sources;
use crate::error::{Result, TrainError};

/// The variable naming a YAML file of settings for a program (optional), below the
/// environment's own variables.
pub const CONFIG_ENV: &str = "FLOTILLA_CONFIG";

/// The settings of this process's environment ([`settings_from`] of `std::env::vars()`).
pub fn settings() -> Result<TrainConfig> {
    settings_from(std::env::vars())
}

/// The settings `vars` make: defaults, then the file of [`CONFIG_ENV`] if set, then every
/// `FLOTILLA_` variable and the launcher's variables, checked as a config job's are (an
/// unknown key names the nearest one; a value out of range names its key).
pub fn settings_from(vars: impl IntoIterator<Item = (String, String)>) -> Result<TrainConfig> {
    let vars: Vec<(String, String)> = vars.into_iter().collect();
    let mut sources = Sources::defaults();
    let file = vars
        .iter()
        .find(|(k, v)| k == CONFIG_ENV && !v.trim().is_empty());
    if let Some((_, path)) = file {
        sources = sources.file(Path::new(path.trim()))?;
    }
    let config = sources.env(vars, true)?.extract()?;
    config.validate()?;
    Ok(config)
}

/// The rank the launcher's environment gives this process (`RANK`, or Open MPI's, Slurm's;
/// see [`flotilla_cluster::launcher_env`]); `None`: rank 0 assigns one at the rendezvous.
pub fn launcher_rank() -> Result<Option<usize>> {
    let env = flotilla_cluster::LauncherEnv::from_process()
        .map_err(|e| TrainError::config("environment", e.to_string()))?;
    Ok(env.rank.map(|r| r.value))
}

/// Joins the job of `config` as rank `rank` (`None`: assigned) over its backend
/// (`comm.backend`), with its secret and TLS; the ranks must agree on every setting that
/// is not per rank ([`TrainConfig::shared_hash`]), or the rendezvous refuses the one that
/// differs. Collective: every rank of the job calls it.
pub fn join(config: &TrainConfig, rank: Option<usize>) -> Result<Arc<dyn ProcessGroup>> {
    if let Some(min) = config.topology.min_world_size {
        return Err(crate::error::TrainError::config(
            "topology.min_world_size",
            format!(
                "an elastic job ({min}:{}) trains through the library's run \
                 (`flotilla train`, `flotilla_burn::train` or `::session`) or a program's \
                 own loop under `flotilla_burn::elastic::run`; a group joined by itself \
                 (`flotilla_burn::init`) keeps a fixed size (drop min_world_size)",
                config.topology.world_size
            ),
        ));
    }
    let world = config.effective_world_size()?;
    let hash = config.shared_hash(None);
    crate::backend::connect(config, rank, hash, world, Rejoin::Off, Vec::new())
}

/// Joins the job this process was started in: [`settings`], [`launcher_rank`], [`join`].
pub fn join_from_env() -> Result<(TrainConfig, Arc<dyn ProcessGroup>)> {
    let config = settings()?;
    let group = join(&config, launcher_rank()?)?;
    Ok((config, group))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn a_program_reads_the_names_and_units_of_a_config_job() {
        let c = settings_from(vars(&[
            ("WORLD_SIZE", "3"),
            ("MASTER_ADDR", "10.0.0.7"),
            ("MASTER_PORT", "29555"),
            ("FLOTILLA_COMM__TIMEOUT_S", "7.5"),
            ("FLOTILLA_TRANSPORT", "tcp"),
            ("FLOTILLA_COMM__COMPRESSION", "lz4"),
            ("FLOTILLA_WIRE_FORMAT", "bf16"),
            ("FLOTILLA_COMM__SMALL_ALL_REDUCE_KB", "64"),
            ("FLOTILLA_COMM__CHUNK_KB", "128"),
            ("FLOTILLA_COMM__SHM_CHUNK_KB", "256"),
            ("FLOTILLA_COMM__MAX_QUEUED_MB", "512"),
            ("FLOTILLA_COMM__SOCKET_BUFFER_KB", "4096"),
            ("FLOTILLA_COMM__THREADS", "2"),
        ]))
        .expect("settings");
        assert_eq!(c.effective_world_size().expect("size"), 3);
        let comm = c.comm_config(Some(1), 0, 3).expect("comm config");
        assert_eq!(
            (comm.master_addr.as_str(), comm.master_port),
            ("10.0.0.7", 29555)
        );
        assert_eq!(comm.timeout, std::time::Duration::from_millis(7500));
        assert_eq!(comm.transport, flotilla_tcp::Transport::Tcp);
        assert_eq!(comm.compression, flotilla_tcp::Compression::Lz4);
        assert_eq!(comm.wire_format, flotilla_tcp::WireFormat::Bf16);
        assert_eq!(comm.small_all_reduce_bytes, 64 << 10);
        assert_eq!(comm.chunk_bytes, 128 << 10);
        assert_eq!(comm.shm_chunk_bytes, 256 << 10);
        assert_eq!(comm.max_queued_bytes, 512 << 20);
        assert_eq!(comm.socket_buffer_bytes, Some(4 << 20));
        assert_eq!(comm.runtime_threads, 2);
        comm.validate().expect("the transport takes it");
    }

    #[test]
    fn a_program_setting_that_does_not_fit_names_its_key() {
        for (var, value, named) in [
            ("FLOTILLA_COMM__CHUNK_KB", "0", "comm.chunk_kb"),
            ("FLOTILLA_COMM__SHM_CHUNK_KB", "6", "comm.shm_chunk_kb"),
            ("FLOTILLA_COMM__MAX_QUEUED_MB", "1", "comm.max_queued_mb"),
            ("FLOTILLA_COMM__THREADS", "0", "comm.threads"),
            // Refused as the variable is read: the variable is named.
            (
                "FLOTILLA_COMM__TIMEOUT_S",
                "nan",
                "FLOTILLA_COMM__TIMEOUT_S",
            ),
        ] {
            let e = settings_from(vars(&[("WORLD_SIZE", "2"), (var, value)]))
                .expect_err(var)
                .to_string();
            assert!(e.contains(named), "{var}={value}: {e}");
        }
        let e = settings_from(vars(&[("FLOTILLA_COMM__TIMEOUT", "5")]))
            .expect_err("unknown key")
            .to_string();
        assert!(e.contains("comm.timeout"), "{e}");
    }

    #[test]
    fn a_settings_file_is_read_below_the_environment() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("job.yaml");
        std::fs::write(&path, "comm: {timeout_s: 9, transport: shm}\n").expect("write");
        let file = path.display().to_string();
        let c = settings_from(vars(&[
            (CONFIG_ENV, &file),
            ("FLOTILLA_COMM__TIMEOUT_S", "4"),
        ]))
        .expect("settings");
        assert_eq!(c.comm.timeout_s, 4.0, "the environment wins");
        assert_eq!(c.comm.transport, flotilla_tcp::Transport::Shm, "the file's");
    }
}
