//! The CUDA driver, asked through cudarc's driver API (loaded at run time: the build needs
//! no toolkit). Every call first checks that `libcuda.so` can be loaded at all, since
//! cudarc panics on a missing library; errors are plain sentences for [`super`] to wrap.

use cudarc::driver::result;

/// `cuInit` after checking that the driver's library loads.
fn init() -> Result<(), String> {
    // SAFETY: only tries to open the library (dlopen) by its usual names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(
            "the CUDA driver (libcuda.so) cannot be loaded: no NVIDIA driver on this machine \
             (install it, or pick another device)"
                .into(),
        );
    }
    result::init().map_err(|e| format!("the CUDA driver (libcuda.so) failed to start: {e}"))
}

/// The number of CUDA devices the driver reports.
pub(super) fn count() -> Result<usize, String> {
    init()?;
    let n = result::device::get_count().map_err(|e| format!("cuDeviceGetCount: {e}"))?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// Total memory of device `index` in bytes (`cuDeviceTotalMem`); asked only by burn's CUDA
/// backend's placement (the `cuda` feature).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(super) fn total_memory(index: usize) -> Result<u64, String> {
    init()?;
    let ordinal = i32::try_from(index).map_err(|_| format!("device index {index} too large"))?;
    let dev = result::device::get(ordinal).map_err(|e| format!("cuDeviceGet({index}): {e}"))?;
    // SAFETY: `dev` is a device handle the driver just returned.
    let bytes = unsafe { result::device::total_mem(dev) }
        .map_err(|e| format!("cuDeviceTotalMem({index}): {e}"))?;
    Ok(bytes as u64)
}
