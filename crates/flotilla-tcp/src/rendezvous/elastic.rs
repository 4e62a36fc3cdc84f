//! An elastic job's rendezvous, once per generation: enlist with the lighthouse (through
//! the process's [`Beacon`]), build the full mesh of the generation's members (every pair
//! connected, rank 0 included: the lighthouse keeps no data connection), bound to the
//! generation's session nonce (a process of another generation cannot enter it), and wait
//! for every member's mesh (`Go`). A generation abandoned while its mesh is built (a member
//! lost meanwhile) is enlisted for again; what the lighthouse refuses ends the process.

use std::time::{Duration, Instant};

use flotilla_group::{CommError, RendezvousError};
use tokio::runtime::Runtime;

use super::Mesh;
use super::beacon::Beacon;
use super::client::mesh_listener_at;
use super::mesh::build_mesh;
use crate::config::CommConfig;
use crate::wire::Formed;

/// Forms this process's next generation on `rt` (the new group's runtime); `step`: the
/// steps this process's training state holds (`None`: none, it takes a member's).
pub(crate) fn form(
    rt: &Runtime,
    cfg: &CommConfig,
    beacon: &mut Beacon,
    step: Option<u64>,
) -> Result<(Mesh, Formed), CommError> {
    // Longer than the lighthouse's own deadlines (it decides; this only bounds the wait
    // for a lighthouse that went silent).
    let within = cfg.join_timeout + cfg.timeout * 2 + Duration::from_secs(5);
    let give_up = Instant::now() + within * 2;
    loop {
        let (listener, mesh_addr) = rt.block_on(mesh_listener_at(cfg, beacon.local_ip()))?;
        let host = crate::host::host_key(cfg.shm_dir.as_deref());
        let f = beacon.enlist(cfg, (mesh_addr, host), step, within)?;
        let mut c = cfg.clone();
        (c.world_size, c.rank) = (f.peers.len(), Some(f.rank));
        let built = rt.block_on(build_mesh(&c, (f.rank, 0), f.session, &f.peers, listener));
        match built {
            Ok((streams, _)) => {
                if beacon.ready(cfg.timeout * 2 + Duration::from_secs(5))? {
                    let mesh = Mesh {
                        rank: f.rank,
                        streams,
                        rejoins: None,
                        session: f.session,
                        hosts: f.hosts.clone(),
                    };
                    return Ok((mesh, f));
                }
                tracing::info!(
                    generation = f.generation,
                    "generation abandoned before it ran; enlisting again"
                );
            }
            Err(e) => {
                tracing::warn!(generation = f.generation, error = %e, "could not build the generation's mesh; enlisting again");
                beacon.mesh_failed(e.to_string());
            }
        }
        if Instant::now() > give_up {
            return Err(CommError::Rendezvous(RendezvousError::MasterFailed {
                reason: format!("no generation ran within {:?}", within * 2),
            }));
        }
    }
}
