//! One NCCL communicator on one GPU: made from the unique id the group's rank 0 created
//! (`ncclGetUniqueId`) and broadcast over the control group, with the CUDA stream its
//! collectives and staging copies run on; aborted (`ncclCommAbort`) by the watchdog or an
//! abort, destroyed when dropped.

use std::ffi::c_char;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nccl::{result, sys};

/// The size of an NCCL unique id.
pub(crate) const ID_BYTES: usize = 128;

/// A communicator handle NCCL lets other threads abort.
struct Handle(sys::ncclComm_t);

// SAFETY: NCCL communicators may be used from any thread; this crate serialises every
// call on one behind `NcclComm::handle` and lets only `ncclCommAbort` run concurrently
// with a collective in flight on the stream (which NCCL documents as the way to stop one).
unsafe impl Send for Handle {}

/// A communicator and its stream.
pub(crate) struct NcclComm {
    /// `None` once aborted: no call may use it again.
    handle: Mutex<Option<Handle>>,
    /// The stream of this group's collectives and staging copies, on the rank's GPU.
    pub(crate) stream: Arc<CudaStream>,
}

/// Checks that the CUDA driver and NCCL can be loaded (cudarc panics on a missing library).
pub(crate) fn probe_libraries() -> Result<(), String> {
    // SAFETY: both only try to open the libraries (dlopen) by their usual names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(
            "the CUDA driver (libcuda.so) cannot be loaded: no NVIDIA driver on this machine"
                .into(),
        );
    }
    // SAFETY: as above: it only tries to open NCCL's library (dlopen) by its usual names.
    if !unsafe { sys::is_culib_present() } {
        return Err(
            "NCCL (libnccl.so.2) cannot be loaded: install NCCL (e.g. Debian's libnccl2)".into(),
        );
    }
    Ok(())
}

/// A new unique id (rank 0 of a group makes it; the others receive its bytes).
pub(crate) fn new_id() -> Result<Vec<u8>, String> {
    probe_libraries()?;
    let id = result::get_uniqueid().map_err(|e| format!("ncclGetUniqueId: {e:?}"))?;
    Ok(id.internal.iter().map(|&c| c as u8).collect())
}

impl NcclComm {
    /// Joins the communicator of `id` as `rank` of `size` on GPU `device`. NCCL's
    /// initialisation blocks until every rank joined: it runs on a thread of its own and is
    /// given up after `timeout` (the rank then fails, naming the wait).
    pub(crate) fn init(
        device: usize,
        id: &[u8],
        (rank, size): (usize, usize),
        timeout: Duration,
    ) -> Result<NcclComm, String> {
        probe_libraries()?;
        let internal: [c_char; ID_BYTES] = <[u8; ID_BYTES]>::try_from(id)
            .map_err(|_| format!("an NCCL unique id of {} bytes, not {ID_BYTES}", id.len()))?
            .map(|b| b as c_char);
        let ctx = CudaContext::new(device).map_err(|e| format!("CUDA device {device}: {e:?}"))?;
        let stream = ctx
            .new_stream()
            .map_err(|e| format!("CUDA stream: {e:?}"))?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("flotilla-nccl-init".into())
            .spawn(move || {
                let r = ctx
                    .bind_to_thread()
                    .map_err(|e| format!("{e:?}"))
                    .and_then(|()| init_rank(sys::ncclUniqueId { internal }, rank, size));
                // The receiver may have given up; then the communicator is leaked with
                // this failed rank.
                let _ = tx.send(r);
            })
            .map_err(|e| format!("cannot start NCCL's initialisation thread: {e}"))?;
        let handle = rx.recv_timeout(timeout).map_err(|_| {
            format!("ncclCommInitRank did not finish within {timeout:?}: not every rank joined")
        })??;
        Ok(NcclComm {
            handle: Mutex::new(Some(handle)),
            stream,
        })
    }

    fn lock(&self) -> MutexGuard<'_, Option<Handle>> {
        self.handle.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` on the communicator and this group's stream (enqueueing work on the
    /// stream; the caller synchronises), unless it was aborted.
    pub(crate) fn with<R>(
        &self,
        f: impl FnOnce(sys::ncclComm_t, sys::cudaStream_t) -> Result<R, result::NcclError>,
    ) -> Result<R, String> {
        let guard = self.lock();
        let handle = guard.as_ref().ok_or("the NCCL communicator was aborted")?;
        f(handle.0, self.stream.cu_stream() as sys::cudaStream_t).map_err(|e| format!("{e:?}"))
    }

    /// `ncclCommAbort`: a collective stuck on the stream returns, and the communicator is
    /// never used again. Whether this call did it.
    pub(crate) fn abort(&self) -> bool {
        let Some(handle) = self.lock().take() else {
            return false;
        };
        // SAFETY: the handle came from `ncclCommInitRank` and is used by no one after this.
        if let Err(e) = unsafe { result::comm_abort(handle.0) } {
            tracing::warn!(error = ?e, "ncclCommAbort failed");
        }
        true
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if let Some(handle) = self.lock().take() {
            // SAFETY: as in `abort`; every collective finished (the worker is gone).
            if let Err(e) = unsafe { result::comm_destroy(handle.0) } {
                tracing::warn!(error = ?e, "ncclCommDestroy failed");
            }
        }
    }
}

fn init_rank(id: sys::ncclUniqueId, rank: usize, size: usize) -> Result<Handle, String> {
    let n = i32::try_from(size).map_err(|_| format!("{size} ranks: too many for NCCL"))?;
    let r = i32::try_from(rank).map_err(|_| format!("rank {rank}: too large for NCCL"))?;
    let mut comm = std::mem::MaybeUninit::uninit();
    // SAFETY: `comm` is written by NCCL on success, read only then.
    unsafe {
        result::comm_init_rank(comm.as_mut_ptr(), n, id, r)
            .map_err(|e| format!("ncclCommInitRank: {e:?}"))?;
        Ok(Handle(comm.assume_init()))
    }
}
