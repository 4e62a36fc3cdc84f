//! The three phases of the hierarchical all-reduce ([`crate::hier`]'s module doc), each in
//! its own turn of its group: the host's sum over the shared segment, a segment of it
//! across hosts over TCP, the host's gather. `hier` runs them one after the other on a
//! whole buffer, `hier_pipeline` piece by piece.

use flotilla_group::{CommError, shard};

use crate::flat::{self, Algorithm};
use crate::world::GroupState;

/// Phase 1: the host's ranks all-reduce `buf` over their segment (in the next turn of
/// `local`).
pub(crate) async fn host_reduce(local: &GroupState, buf: &mut [f32]) -> Result<(), CommError> {
    let t = local.nested_ticket();
    let _turn = local.begin(t).await?;
    flat::shm_all_reduce(local, t, buf).await
}

/// Phase 2: this rank's segment `mine` of the host's sum, all-reduced over TCP with the
/// same local rank of every other host (in the next turn of `cross`).
pub(crate) async fn cross_reduce(cross: &GroupState, mine: &mut [f32]) -> Result<(), CommError> {
    let t = cross.nested_ticket();
    let _turn = cross.begin(t).await?;
    Algorithm::of(cross, mine).run(cross, t, mine).await
}

/// Phase 3: local rank `j` broadcasts segment `j` of `buf` to the host, for every `j` (in
/// the next `k` turns of `local`).
pub(crate) async fn host_gather(local: &GroupState, buf: &mut [f32]) -> Result<(), CommError> {
    let (len, k) = (buf.len(), local.members.len());
    for j in 0..k {
        let t = local.nested_ticket();
        let _turn = local.begin(t).await?;
        flat::shm_broadcast(local, t, &mut buf[shard::segment(len, k, j)], j).await?;
    }
    Ok(())
}
