//! burn's wgpu backend on Vulkan (`--features wgpu`, `device: wgpu`) through the CLI: real
//! `flotilla` processes over 127.0.0.1 on the vendored MNIST, on whatever Vulkan driver the
//! machine has (CI installs Mesa's lavapipe, a conforming Vulkan driver that runs on the CPU,
//! so the runs are short). Every wgpu run is compared tensor by tensor with the same run on
//! the CPU backend (flex): the parameters start equal (they are drawn on the CPU whatever the
//! device), so they end within f32 rounding of each other (burn's wgpu kernels sum in
//! another order than Flex's). A build with it but no Vulkan driver fails with one error
//! naming what is missing (a build without a GPU feature: `tests/gpu.rs`, on `cuda`).
//!
//! Closeness to the CPU run alone would pass a strategy that silently built its engine on the
//! CPU (the difference is then 0): every rank of every run also logs where its parameter
//! tensors are at the end of the run, read from the tensors themselves (each parameter's
//! `Tensor::device()`, the device of its backend primitive; `ModelState::param_placement`),
//! and every rank of every strategy must report wgpu: a sync and an async all-reduce peer, a
//! pipeline stage, a parameter-server worker and the parameter server (the flat root, which
//! holds the whole model in an engine on the configured device and steps it there). The same
//! runs on Flex must report flex, so that the check can fail. (A hierarchical job's local
//! server holds no model: it relays flat buffers on the host and logs that it has no
//! parameter tensors; none runs here.)
#![cfg(feature = "wgpu")]

mod common;

use common::*;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Output;
use std::time::Duration;

type Tensors = BTreeMap<String, Vec<f32>>;

const LIMIT: Duration = Duration::from_secs(600);

/// LeNet-5 on small batches (lavapipe is slow), momentum SGD past a short warm-up; the final
/// evaluation on 200 test images (all 10,000 took lavapipe about 14 s a job, and nothing
/// here reads the accuracy: the tensors are compared).
const COMMON: &str = "batch_size: 8\ntest_limit: 200\nwarmup_steps: 5\nlr_schedule: cosine\noptimizer: {name: sgd, lr: 0.05, momentum: 0.9}\n";

/// wgpu against the CPU: f32 rounding of other summation orders, over every step.
const TOLERANCE: f64 = 1e-4;

/// A finished run: its final tensors, rank 0's run.log, and every rank's role and where its
/// parameter tensors were at the end (see [`tensor_devices`]).
struct Run {
    tensors: Tensors,
    log: String,
    devices: Vec<(String, String)>,
}

impl Run {
    /// Asserts that the ranks had exactly the roles `roles` (by rank) and that every one's
    /// parameter tensors were on `backend` (`wgpu`, `flex`), as the tensors reported it.
    fn assert_tensors_on(&self, name: &str, backend: &str, roles: &[&str]) {
        let got: Vec<&str> = self.devices.iter().map(|(r, _)| r.as_str()).collect();
        assert_eq!(got, roles, "{name}: the ranks' roles");
        for (rank, (role, place)) in self.devices.iter().enumerate() {
            assert!(
                place.starts_with(&format!("on {backend} (")),
                "{name}: rank {rank} ({role}) parameter tensors {place}, not on {backend}"
            );
        }
    }
}

/// Runs `flotilla launch` of `yaml` (plus [`COMMON`]) on `device` for `steps` steps into
/// `dir/name-device`.
fn run(dir: &Path, name: &str, device: &str, steps: u64, yaml: &str) -> Run {
    let name = format!("{name}-{device}");
    let cfg = config_file(
        dir,
        &format!("{name}.yaml"),
        &format!("{COMMON}max_steps: {steps}\ndevice: {device}\n{yaml}"),
    );
    let out = dir.join(&name);
    let o = launch(&[&cfg, "--output", out.to_str().expect("utf8")], LIMIT);
    assert_eq!(
        final_fields(&o)["steps"],
        steps as f64,
        "{name}\n{}",
        text(&o)
    );
    Run {
        tensors: checkpoint_tensors(&out),
        log: run_log(&out, 0),
        devices: tensor_devices(&out),
    }
}

/// Every rank's role and where its parameter tensors were at the end of the run (`on wgpu
/// (Cpu on Vulkan) (all 10 parameter tensors)`), by rank: the line each rank's run.log has
/// from `ModelState::param_placement`, which reads the tensors' own devices.
fn tensor_devices(out: &Path) -> Vec<(String, String)> {
    let ranks = std::fs::read_dir(out)
        .expect("output directory")
        .flatten()
        .filter(|e| e.path().is_dir() && e.file_name().to_string_lossy().starts_with("rank-"))
        .count();
    (0..ranks)
        .map(|rank| {
            let log = run_log(out, rank);
            let prefix = format!("rank {rank} (");
            log.lines()
                // After the line's `[  12.345s] ` time.
                .filter_map(|l| l.split_once(&prefix).map(|(_, rest)| rest))
                .find_map(|l| l.split_once(") parameter tensors "))
                .map(|(role, place)| (role.to_string(), place.to_string()))
                .unwrap_or_else(|| panic!("rank {rank} logged no parameter tensors:\n{log}"))
        })
        .collect()
}

/// The parameters before the first step (a run of zero steps checkpoints them).
fn initial(dir: &Path) -> Tensors {
    let out = dir.join("initial");
    let out_s = out.to_str().expect("utf8");
    launch(
        &[
            "-n",
            "1",
            "--max-steps",
            "0",
            "--test-limit",
            "200",
            "--output",
            out_s,
        ],
        LIMIT,
    );
    checkpoint_tensors(&out)
}

/// `wgpu` within [`TOLERANCE`] of `cpu`, both moved away from `init`.
fn assert_close_to_cpu(name: &str, wgpu: &Tensors, cpu: &Tensors, init: &Tensors) {
    let moved = relative_error(cpu, init);
    assert!(moved > 1e-2, "{name}: parameters barely moved ({moved})");
    let e = relative_error(wgpu, cpu);
    assert!(e <= TOLERANCE, "{name}: wgpu vs cpu relative error {e}");
}

/// The XXH3 of its final parameters that a rank logged (after the all-gathered check).
fn param_hash(log: &str) -> String {
    log.lines()
        .find_map(|l| l.split("parameters identical on all 2 ranks (xxh3 ").nth(1))
        .unwrap_or_else(|| panic!("no parameter hash in run.log:\n{log}"))
        .trim_end_matches(')')
        .to_string()
}

/// Whether a Vulkan driver is installed (an ICD manifest where the loader looks). Without
/// one the wgpu tests skip, except under CI, where they must run.
fn vulkan_driver() -> bool {
    let found = ["/usr/share/vulkan/icd.d", "/etc/vulkan/icd.d"]
        .iter()
        .filter_map(|d| std::fs::read_dir(d).ok())
        .flatten()
        .flatten()
        .any(|e| e.path().extension().is_some_and(|x| x == "json"));
    if !found && std::env::var_os("CI").is_some() {
        panic!("CI needs a Vulkan driver (mesa-vulkan-drivers, libvulkan1): none is installed");
    }
    if !found {
        eprintln!("skipped: no Vulkan driver (apt-get install mesa-vulkan-drivers libvulkan1)");
    }
    found
}

/// Runs `flotilla ARGS` expecting a failure; returns everything it printed.
fn failing(args: &[&str], env: &[(&str, &str)]) -> (Output, String) {
    let mut c = flotilla();
    c.args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    let o = run_with_deadline(c, Duration::from_secs(120));
    let all = text(&o);
    assert!(!o.status.success(), "{args:?} succeeded\n{all}");
    (o, all)
}

#[test]
fn two_ranks_on_wgpu_equal_the_cpu_run_and_each_other_bitwise() {
    if !vulkan_driver() {
        return;
    }
    let dir = tmp();
    let init = initial(dir.path());
    let two = "world_size: 2\nbucket_mb: 0.01\n";
    let cpu = run(dir.path(), "lenet", "flex", 50, two);
    let wgpu = run(dir.path(), "lenet", "wgpu", 50, two);
    let log = &wgpu.log;
    assert!(log.contains("device=wgpu:0 (Vulkan adapter 0"), "{log}");
    // What the tensors say, not what the configuration asked for.
    cpu.assert_tensors_on("sync all-reduce on flex", "flex", &["peer"; 2]);
    wgpu.assert_tensors_on("sync all-reduce on wgpu", "wgpu", &["peer"; 2]);
    assert_close_to_cpu("2 ranks, 50 steps", &wgpu.tensors, &cpu.tensors, &init);
    // Each rank logs the hash of its own final parameters.
    let out = dir.path().join("lenet-wgpu");
    let hashes = [0, 1].map(|r| param_hash(&run_log(&out, r)));
    assert_eq!(hashes[0], hashes[1], "the two ranks' parameters differ");
}

#[test]
fn every_strategy_on_wgpu_equals_its_cpu_run() {
    if !vulkan_driver() {
        return;
    }
    let dir = tmp();
    let init = initial(dir.path());
    // Each strategy with the roles of its ranks, by rank.
    let strategies: [(&str, &str, &[&str]); 3] = [
        (
            "async-allreduce",
            "world_size: 2\nstrategy: async_allreduce\nstaleness: 1\n",
            &["peer", "peer"],
        ),
        (
            "flat-ps",
            "arch: flat\nparameter_server: {aggr_type: sync, num_workers: 2}\n",
            &["root", "worker", "worker"],
        ),
        (
            "pipeline",
            "strategy: pipeline\nsplit_points: [6]\nmicro_batches: 2\nschedule: 1f1b\n",
            &["stage", "stage"],
        ),
    ];
    for (name, yaml, roles) in strategies {
        let cpu = run(dir.path(), name, "flex", 20, yaml);
        let wgpu = run(dir.path(), name, "wgpu", 20, yaml);
        cpu.assert_tensors_on(&format!("{name} on flex"), "flex", roles);
        wgpu.assert_tensors_on(&format!("{name} on wgpu"), "wgpu", roles);
        assert_close_to_cpu(name, &wgpu.tensors, &cpu.tensors, &init);
    }
}

#[test]
fn wgpu_without_a_vulkan_driver_is_one_error_naming_the_driver() {
    // The Vulkan loader reads its drivers from these files alone: none exists.
    let none = "/nonexistent/flotilla-no-icd.json";
    let env = [("VK_ICD_FILENAMES", none), ("VK_DRIVER_FILES", none)];
    let (_, all) = failing(
        &["launch", "-n", "1", "--device", "wgpu", "--max-steps", "1"],
        &env,
    );
    assert!(
        all.contains(
            "device `wgpu:0`: no Vulkan adapter at index 0 (0 found); install a Vulkan driver"
        ),
        "{all}"
    );
    assert!(!all.contains("panicked"), "{all}");
}

#[test]
fn auto_takes_the_cpu_backend_without_a_vulkan_gpu_and_says_why() {
    if !vulkan_driver() {
        return;
    }
    let dir = tmp();
    let flex = run(dir.path(), "lenet", "flex", 5, "world_size: 1\n");
    let auto = run(dir.path(), "lenet", "auto", 5, "world_size: 1\n");
    // lavapipe is a software adapter, not a GPU: auto keeps the CPU backend.
    let log = &auto.log;
    assert!(
        log.contains("device=flex (auto: 0 Vulkan GPU(s), none at index 0; a software Vulkan adapter (lavapipe) is slower"),
        "{log}"
    );
    auto.assert_tensors_on("auto", "flex", &["peer"]);
    assert_bitwise("auto vs flex", &auto.tensors, &flex.tensors);
}
