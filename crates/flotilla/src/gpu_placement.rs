//! Where the ranks of a local launch run on a GPU device: round-robin over the host's GPUs
//! (rank `r` on GPU `r mod G`, the index each rank takes itself from its `LOCAL_RANK`
//! through `flotilla_engine::local_device`), refused before anything starts when there are
//! more ranks than GPUs unless `--oversubscribe`, and always when the host has none. A
//! host whose only `wgpu` adapters are software ones (lavapipe, a CPU driver) has no GPU to
//! oversubscribe: every rank shares adapter 0, and the launcher says so.

use anyhow::{Result, bail};
use flotilla_engine::{DeviceSpec, GpuKind, device_index, gpu_count, software_only};

/// The GPU index of each of `n` ranks on a host with `gpus` GPUs of the device named
/// `device` (`cuda`: round-robin; `cuda:1`: all on GPU 1), or the refusal: no GPU at all,
/// or more ranks than GPUs without `oversubscribe`.
pub fn place(n: usize, device: &str, gpus: usize, oversubscribe: bool) -> Result<Vec<usize>> {
    if gpus == 0 {
        bail!("device `{device}`: this host has no GPU for it (the driver reports 0)");
    }
    let pinned = DeviceSpec::parse(device)?.index;
    let distinct = if pinned.is_some() { 1 } else { gpus };
    if n > distinct && !oversubscribe {
        bail!(
            "{n} local ranks on device `{device}` but this host gives them {distinct} GPU(s): one GPU \
             per rank. Use fewer ranks (-n), spread them over hosts (--inventory), or pass \
             --oversubscribe to share GPUs round-robin"
        );
    }
    Ok((0..n)
        .map(|r| pinned.unwrap_or_else(|| device_index(r, gpus)))
        .collect())
}

/// Places a local launch of `n` ranks on `device`: `None` for a CPU backend (unless `nccl`,
/// whose collectives need a CUDA GPU per rank whatever the model runs on), else each
/// rank's GPU index, after asking the driver how many GPUs this host has (a missing driver
/// or feature is the engine's error naming it); software adapters alone are shared, never
/// refused.
pub fn check_local(
    n: usize,
    device: &str,
    nccl: bool,
    oversubscribe: bool,
) -> Result<Option<Vec<usize>>> {
    let (kind, device) = match DeviceSpec::parse(device)?.gpu() {
        Some(kind) => (kind, device),
        None if nccl => (GpuKind::Cuda, "cuda"),
        None => return Ok(None),
    };
    let gpus = gpu_count(kind)?;
    if software_only(kind)? {
        println!(
            "[launcher] device {device}: the only adapters are software ones (a CPU driver such \
             as lavapipe, no GPU): the {n} rank(s) share adapter 0"
        );
        return Ok(Some(vec![DeviceSpec::parse(device)?.index.unwrap_or(0); n]));
    }
    place(n, device, gpus, oversubscribe).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_go_round_robin_and_more_than_the_gpus_need_oversubscribe() {
        assert_eq!(place(2, "cuda", 4, false).expect("fits"), [0, 1]);
        assert_eq!(place(4, "cuda", 4, false).expect("fits"), [0, 1, 2, 3]);
        let e = place(5, "cuda", 4, false).expect_err("5 > 4").to_string();
        assert!(
            e.contains("5 local ranks") && e.contains("4 GPU(s)") && e.contains("--oversubscribe"),
            "{e}"
        );
        assert_eq!(place(5, "cuda", 2, true).expect("shared"), [0, 1, 0, 1, 0]);
        // A pinned index holds one rank, or all of them when oversubscribed.
        assert_eq!(place(1, "cuda:1", 2, false).expect("fits"), [1]);
        assert!(place(2, "cuda:1", 2, false).is_err());
        assert_eq!(place(2, "cuda:1", 2, true).expect("shared"), [1, 1]);
        // No GPU at all is refused even with --oversubscribe.
        let e = place(1, "cuda", 0, true).expect_err("none").to_string();
        assert!(e.contains("no GPU"), "{e}");
    }

    #[test]
    fn cpu_devices_are_not_placed() {
        assert_eq!(check_local(64, "flex", false, false).expect("cpu"), None);
    }
}
