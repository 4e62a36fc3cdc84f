//! The process group a run trains over, by `comm.backend`: Flotilla's TCP transport (with
//! its rendezvous), MPI (with the `mpi` feature; rank and world size are MPI's), or NCCL
//! over the TCP group (with the `nccl` feature: `flotilla_nccl::NcclGroup`), and
//! [`finish`], which ends the backend's process-wide state at exit.

use std::sync::Arc;

use flotilla_tcp::{ProcessGroup, Rejoin, TcpGroup};

use crate::config::{Backend, TrainConfig};
use crate::error::{Result, TrainError};

/// Joins the job's world group: `rank` is what a launcher said (`None`: assigned at
/// rendezvous), `hash` the config hash every rank must share, `world` the topology's size,
/// `rejoin` whether this rank replaces a lost one (linking to `links`) or lets replacements
/// in ([`crate::rejoin::mode`]; TCP only).
pub fn connect(
    config: &TrainConfig,
    rank: Option<usize>,
    hash: u64,
    world: usize,
    rejoin: Rejoin,
    links: Vec<usize>,
) -> Result<Arc<dyn ProcessGroup>> {
    match config.comm.backend {
        Backend::Tcp => {
            let mut cfg = config.comm_config(rank, hash, world)?;
            cfg.rejoin = rejoin;
            cfg.rejoin_links = links;
            Ok(Arc::new(TcpGroup::connect(cfg)?))
        }
        Backend::Mpi if rejoin == Rejoin::Join => Err(TrainError::config(
            crate::rejoin::REJOIN_ENV,
            "an MPI job cannot take a replaced rank back (restart the whole job)",
        )),
        Backend::Mpi => connect_mpi(config, rank, hash, world),
        Backend::Nccl if rejoin == Rejoin::Join => Err(TrainError::config(
            crate::rejoin::REJOIN_ENV,
            "an NCCL job cannot take a replaced rank back (restart the whole job)",
        )),
        Backend::Nccl => {
            let tcp = TcpGroup::connect(config.comm_config(rank, hash, world)?)?;
            connect_nccl(config, Arc::new(tcp))
        }
    }
}

/// NCCL under the TCP group `control` (which carries the unique id), on this rank's GPU:
/// the index of `model.device` when it is `cuda:i` (as [`crate::gpu::on_local_gpu`] made
/// it), else the local rank's round-robin GPU (NCCL as the transport of a CPU model).
#[cfg(feature = "nccl")]
fn connect_nccl(
    config: &TrainConfig,
    control: Arc<dyn ProcessGroup>,
) -> Result<Arc<dyn ProcessGroup>> {
    use flotilla_engine::{DeviceSpec, GpuKind};
    let bad = |message: String| TrainError::config("comm.backend: nccl", message);
    let spec = DeviceSpec::parse(&config.model.device).map_err(|e| bad(e.to_string()))?;
    let device = match (spec.gpu(), spec.index) {
        (Some(GpuKind::Cuda), Some(i)) => i,
        _ => {
            let gpus = flotilla_engine::cuda_driver_count().map_err(|e| bad(e.to_string()))?;
            flotilla_engine::device_index(crate::gpu::local_rank()?, gpus)
        }
    };
    let cfg = flotilla_nccl::NcclConfig {
        device,
        timeout: std::time::Duration::from_secs_f64(config.comm.timeout_s),
    };
    Ok(Arc::new(flotilla_nccl::NcclGroup::over(control, cfg)?))
}

#[cfg(not(feature = "nccl"))]
fn connect_nccl(
    _config: &TrainConfig,
    _control: Arc<dyn ProcessGroup>,
) -> Result<Arc<dyn ProcessGroup>> {
    Err(TrainError::config(
        "comm.backend: nccl",
        "this binary was built without the `nccl` feature; rebuild with `cargo build --release --features nccl`",
    ))
}

#[cfg(feature = "mpi")]
fn connect_mpi(
    config: &TrainConfig,
    rank: Option<usize>,
    hash: u64,
    world: usize,
) -> Result<Arc<dyn ProcessGroup>> {
    let cfg = flotilla_mpi::MpiConfig {
        timeout: std::time::Duration::from_secs_f64(config.comm.timeout_s),
        config_hash: Some(hash),
    };
    let group = flotilla_mpi::MpiGroup::world(cfg)?;
    let bad = |message: String| TrainError::config("comm.backend: mpi", message);
    if group.size() != world {
        return Err(bad(format!(
            "MPI started {} processes but this topology has {world} ranks: run `mpirun -np {world} flotilla train ...`",
            group.size()
        )));
    }
    if let Some(r) = rank
        && r != group.rank()
    {
        return Err(bad(format!(
            "the launcher says rank {r} but MPI says rank {} (start the job with mpirun alone)",
            group.rank()
        )));
    }
    Ok(Arc::new(group))
}

#[cfg(not(feature = "mpi"))]
fn connect_mpi(
    _config: &TrainConfig,
    _rank: Option<usize>,
    _hash: u64,
    _world: usize,
) -> Result<Arc<dyn ProcessGroup>> {
    Err(TrainError::config(
        "comm.backend: mpi",
        "this binary was built without the `mpi` feature; rebuild with `cargo build --release --features mpi`",
    ))
}

/// Ends the backend for this process; call once at exit, after the run returned (every
/// group dropped). With MPI: `MPI_Finalize` after a clean run, `MPI_Abort` (ending the
/// job) after a failed one or a collective that cannot be cancelled. Nothing for TCP.
pub fn finish(success: bool) {
    #[cfg(feature = "mpi")]
    flotilla_mpi::finalize(success);
    #[cfg(not(feature = "mpi"))]
    let _ = success;
}
