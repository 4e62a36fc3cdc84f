//! The `f32` collectives over NCCL, staged: the host buffer is copied into device memory on
//! the group's stream, NCCL runs on it there, the result is copied back and the stream
//! synchronised. Reduce-scatter and all-gather pad every rank's [`flotilla_group::shard`]
//! to the largest (NCCL cuts equal chunks; Flotilla's shards may differ by one element).

use std::ffi::c_void;

use cudarc::driver::{CudaSlice, DevicePtr};
use cudarc::nccl::result;
use cudarc::nccl::sys::{ncclDataType_t, ncclRedOp_t};
use flotilla_group::shard;

use crate::comm::NcclComm;

/// One collective with its host buffer.
pub(crate) enum Op {
    /// Sum over the group, every rank ends with it (`ncclAllReduce`).
    AllReduce(Vec<f32>),
    /// The root's buffer to everyone (`ncclBroadcast`).
    Broadcast(Vec<f32>, usize),
    /// This rank's shard of the sum (`ncclReduceScatter`).
    ReduceScatter(Vec<f32>),
    /// Every rank's shard to everyone (`ncclAllGather`).
    AllGather(Vec<f32>),
}

impl Op {
    /// The collective's name in errors.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Op::AllReduce(_) => "all_reduce",
            Op::Broadcast(..) => "broadcast",
            Op::ReduceScatter(_) => "reduce_scatter",
            Op::AllGather(_) => "all_gather",
        }
    }
}

const F32: ncclDataType_t = ncclDataType_t::ncclFloat32;

/// Runs `op` as rank `rank` of `size` and returns the host buffer with the result.
pub(crate) fn execute(
    comm: &NcclComm,
    op: Op,
    (rank, size): (usize, usize),
) -> Result<Vec<f32>, String> {
    match op {
        Op::AllReduce(mut buf) => {
            let mut dev = upload(comm, &buf)?;
            let (p, _sync) = dev.device_ptr(&comm.stream);
            // SAFETY: `p` holds `buf.len()` f32s on this communicator's device.
            comm.with(|c, s| unsafe {
                result::all_reduce(
                    p as *const c_void,
                    p as *mut c_void,
                    buf.len(),
                    F32,
                    ncclRedOp_t::ncclSum,
                    c,
                    s,
                )
            })?;
            drop(_sync);
            download(comm, &mut dev, &mut buf)?;
            Ok(buf)
        }
        Op::Broadcast(mut buf, root) => {
            let mut dev = upload(comm, &buf)?;
            let (p, _sync) = dev.device_ptr(&comm.stream);
            let root = i32::try_from(root).map_err(|_| format!("root {root} too large"))?;
            // SAFETY: as above.
            comm.with(|c, s| unsafe {
                result::broadcast(
                    p as *const c_void,
                    p as *mut c_void,
                    buf.len(),
                    F32,
                    root,
                    c,
                    s,
                )
            })?;
            drop(_sync);
            download(comm, &mut dev, &mut buf)?;
            Ok(buf)
        }
        Op::ReduceScatter(buf) => reduce_scatter(comm, buf, (rank, size)),
        Op::AllGather(buf) => all_gather(comm, buf, (rank, size)),
    }
}

/// The padded chunk of every rank: the largest shard.
fn chunk(len: usize, size: usize) -> usize {
    (0..size)
        .map(|r| shard(len, size, r).len())
        .max()
        .unwrap_or(0)
}

/// `buf` cut into its `size` shards, each at the start of a chunk of `chunk(len, size)`
/// (zeros after it): what `ncclReduceScatter` cuts into equal parts.
pub(crate) fn pack_shards(buf: &[f32], size: usize) -> Vec<f32> {
    let c = chunk(buf.len(), size);
    let mut padded = vec![0.0f32; c * size];
    for r in 0..size {
        let s = shard(buf.len(), size, r);
        padded[r * c..r * c + s.len()].copy_from_slice(&buf[s]);
    }
    padded
}

/// This rank's own shard of `buf` in a chunk (what it gives `ncclAllGather`).
pub(crate) fn pack_own(buf: &[f32], (rank, size): (usize, usize)) -> Vec<f32> {
    let s = shard(buf.len(), size, rank);
    let mut own = vec![0.0f32; chunk(buf.len(), size)];
    own[..s.len()].copy_from_slice(&buf[s]);
    own
}

/// Writes chunk `r` of `chunks` (laid out as [`pack_shards`] does) into shard `r` of `buf`
/// for every `r` in `ranks`.
pub(crate) fn unpack(buf: &mut [f32], chunks: &[f32], size: usize, ranks: std::ops::Range<usize>) {
    let (len, c) = (buf.len(), chunk(buf.len(), size));
    for (i, r) in ranks.enumerate() {
        let s = shard(len, size, r);
        let n = s.len();
        buf[s].copy_from_slice(&chunks[i * c..i * c + n]);
    }
}

fn reduce_scatter(
    comm: &NcclComm,
    mut buf: Vec<f32>,
    (rank, size): (usize, usize),
) -> Result<Vec<f32>, String> {
    let c = chunk(buf.len(), size);
    let send = upload(comm, &pack_shards(&buf, size))?;
    let mut recv = upload(comm, &vec![0.0f32; c])?;
    {
        let (src, _s1) = send.device_ptr(&comm.stream);
        let (dst, _s2) = recv.device_ptr(&comm.stream);
        // SAFETY: `src` holds `c · size` f32s, `dst` `c`, on this communicator's device.
        comm.with(|h, s| unsafe {
            result::reduce_scatter(
                src as *const c_void,
                dst as *mut c_void,
                c,
                F32,
                ncclRedOp_t::ncclSum,
                h,
                s,
            )
        })?;
    }
    let mut mine = vec![0.0f32; c];
    download(comm, &mut recv, &mut mine)?;
    unpack(&mut buf, &mine, size, rank..rank + 1);
    Ok(buf)
}

fn all_gather(
    comm: &NcclComm,
    mut buf: Vec<f32>,
    (rank, size): (usize, usize),
) -> Result<Vec<f32>, String> {
    let c = chunk(buf.len(), size);
    let send = upload(comm, &pack_own(&buf, (rank, size)))?;
    let mut recv = upload(comm, &vec![0.0f32; c * size])?;
    {
        let (src, _s1) = send.device_ptr(&comm.stream);
        let (dst, _s2) = recv.device_ptr(&comm.stream);
        // SAFETY: `src` holds `c` f32s, `dst` `c · size`, on this communicator's device.
        comm.with(|h, st| unsafe {
            result::all_gather(src as *const c_void, dst as *mut c_void, c, F32, h, st)
        })?;
    }
    let mut all = vec![0.0f32; c * size];
    download(comm, &mut recv, &mut all)?;
    unpack(&mut buf, &all, size, 0..size);
    Ok(buf)
}

/// The host buffer copied into new device memory on the group's stream.
fn upload(comm: &NcclComm, host: &[f32]) -> Result<CudaSlice<f32>, String> {
    comm.stream
        .clone_htod(host)
        .map_err(|e| format!("copy to the GPU: {e:?}"))
}

/// Waits for the stream (the collective) and copies `dev` back into `host`.
fn download(comm: &NcclComm, dev: &mut CudaSlice<f32>, host: &mut [f32]) -> Result<(), String> {
    comm.stream
        .memcpy_dtoh(dev, host)
        .and_then(|()| comm.stream.synchronize())
        .map_err(|e| format!("collective or copy from the GPU: {e:?}"))
}
