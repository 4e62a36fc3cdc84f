//! The process heap's policy for training: freed tensor buffers are kept for reuse instead of
//! being returned to the kernel.
//!
//! A step allocates and frees the same large buffers every time (activations, gradients, GEMM
//! outputs of hundreds of KiB). glibc serves blocks above its mmap threshold (128 KiB at
//! first, raised on each free up to 32 MiB) with a fresh `mmap` and unmaps them on `free`, so
//! the next step takes page faults and zeroes every page again, and it trims the heap's top
//! above 128 KiB. Fixing the threshold at 256 MiB and the trim threshold at 512 MiB keeps
//! those blocks in the heap: the byte-level GPT's step took 19 % less CPU time (BENCHMARKS.md
//! §24). The price is resident memory: the blocks kept are counted in it, so the main job's
//! peak per rank rose from 53.6 to 73.9 MiB (BENCHMARKS.md §25); what is not returned is
//! memory the next step uses again.

/// Sets the heap policy above; a no-op on targets other than glibc.
pub fn keep_freed_buffers() {
    // SAFETY: `mallopt` only changes malloc's parameters; called before any thread exists.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 512 << 20);
    }
}
