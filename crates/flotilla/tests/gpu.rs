//! GPU devices and the NCCL backend through the CLI, on a machine without them: a launch on
//! `device: cuda` is refused before any rank starts with one error naming what is missing
//! (the `cuda` feature in a default build, the driver `libcuda.so` in a `--features cuda`
//! build on a machine without NVIDIA's driver), `--oversubscribe` or not; `backend: nccl`
//! in a build without its feature names the feature.

mod common;

use std::time::Duration;

use common::{flotilla, run_with_deadline, text, tmp};

fn refused(args: &[&str]) -> String {
    let dir = tmp();
    let mut c = flotilla();
    c.arg("launch")
        .args(args)
        .arg("--output")
        .arg(dir.path().join("out"));
    let o = run_with_deadline(c, Duration::from_secs(30));
    assert!(!o.status.success(), "{}", text(&o));
    assert!(
        !String::from_utf8_lossy(&o.stdout).contains("[rank "),
        "a rank started\n{}",
        text(&o)
    );
    assert!(!dir.path().join("out").join("run-rank0.log").exists());
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn a_cuda_launch_without_a_gpu_is_one_clear_error() {
    for extra in [&[][..], &["--oversubscribe"][..]] {
        let mut args = vec!["-n", "2", "--device", "cuda"];
        args.extend_from_slice(extra);
        let err = refused(&args);
        let expected = if cfg!(feature = "cuda") {
            "the CUDA driver (libcuda.so) cannot be loaded"
        } else {
            "device `cuda` needs a binary built with the `cuda` feature (cargo build --release --features cuda)"
        };
        assert!(err.contains(expected), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[test]
fn nccl_without_its_feature_names_it() {
    let err = refused(&["-n", "2", "--backend", "nccl"]);
    if cfg!(feature = "nccl") {
        assert!(
            err.contains("the CUDA driver (libcuda.so) cannot be loaded"),
            "{err}"
        );
    } else {
        assert!(
            err.contains("built without the `nccl` feature") && err.contains("--features nccl"),
            "{err}"
        );
    }
}
