//! One stack: every way of training × {the spec model, a user's module}. LeNet-5 as the YAML
//! model `lenet5` (`flotilla launch CONFIG`) and LeNet-5 written in burn by its user with the
//! same layer functions (`examples/lenet5_program.rs` through `flotilla launch CONFIG --
//! PROGRAM`, which hands the program the same settings) start from the same seed's weights,
//! see the same batches and end with bit-identical parameters, compared tensor by tensor in
//! their final checkpoints — under sync all-reduce, ZeRO-2, async all-reduce, a flat sync
//! parameter server, a hierarchical one, model averaging, and across a resume. The program's
//! module is trained by the library's run (`flotilla_burn::train`), not by code of its own;
//! and the same again from the program's own loop (`flotilla_burn::session`, `LOOP=own`).

mod common;
#[path = "common/procfs.rs"]
mod procfs;

use common::*;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

type Tensors = BTreeMap<String, Vec<f32>>;

const LIMIT: Duration = Duration::from_secs(300);

/// Every run: warm-up to step 20, cosine decay, SGD with momentum and weight decay.
const COMMON: &str = "model: lenet5\nwarmup_steps: 20\nlr_schedule: cosine\nseed: 7\n\
    optimizer: {name: sgd, lr: 0.04, momentum: 0.9, weight_decay: 0.0005}\n";

/// The program's binary (`target/release/examples/lenet5_program`).
fn program() -> PathBuf {
    example("lenet5_program")
}

/// The spec's tensor name of the user's: `features.conv1.weight` (the whole module's) and
/// `conv1.weight` (its pipeline stage's) are `layers.0.weight`.
fn spec_name(user: &str) -> String {
    let mut parts = user.rsplitn(3, '.');
    let (what, layer) = (parts.next(), parts.next());
    let (Some(what), Some(layer)) = (what, layer) else {
        panic!("{user} is not a LeNet-5 parameter's name");
    };
    let index = match layer {
        "conv1" => 0,
        "conv2" => 3,
        "fc1" => 7,
        "fc2" => 9,
        "fc3" => 11,
        other => panic!("no LeNet-5 layer {other}"),
    };
    format!("layers.{index}.{what}")
}

/// `t` under the spec's names (a user's checkpoint renamed; a spec's as it is).
fn spec_names(t: Tensors) -> Tensors {
    t.into_iter()
        .map(|(k, v)| match k.starts_with("layers.") {
            true => (k, v),
            false => (spec_name(&k), v),
        })
        .collect()
}

/// Runs `flotilla launch` of `yaml` (plus [`COMMON`]) into `dir/name`, with `extra`
/// arguments after the config; returns the final checkpoint's tensors under the spec's names.
fn run(dir: &Path, name: &str, yaml: &str, extra: &[&str]) -> Tensors {
    run_with_env(dir, name, yaml, extra, &[])
}

/// [`run`] with `env` set for the launcher (and so its ranks).
fn run_with_env(
    dir: &Path,
    name: &str,
    yaml: &str,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Tensors {
    launch_job(dir, name, yaml, extra, env);
    spec_names(checkpoint_tensors(&dir.join(name)))
}

/// `flotilla launch` of `yaml` (plus [`COMMON`]) into `dir/name`, with `extra` arguments
/// after the config and `env` for the launcher; succeeded, its output.
fn launch_job(
    dir: &Path,
    name: &str,
    yaml: &str,
    extra: &[&str],
    env: &[(&str, &str)],
) -> std::process::Output {
    let cfg = config_file(dir, &format!("{name}.yaml"), &format!("{COMMON}{yaml}"));
    let out = dir.join(name);
    let mut c = flotilla();
    c.args(["launch", &cfg, "--output", out.to_str().expect("utf8")])
        .args(extra)
        .envs(env.iter().copied());
    let o = run_with_deadline(c, LIMIT);
    assert!(o.status.success(), "{name} failed\n{}", text(&o));
    o
}

/// The spec model's and the user's module's runs of `yaml`, bitwise equal and trained.
fn both_ways(dir: &Path, name: &str, yaml: &str) {
    both_ways_cut(dir, name, yaml, yaml);
}

/// [`both_ways`] with the spec model's job `spec_yaml` and the user's `user_yaml` (a
/// pipeline: the spec cut by layers, the program by its stage modules).
fn both_ways_cut(dir: &Path, name: &str, spec_yaml: &str, user_yaml: &str) {
    let exe = program();
    let exe = exe.to_str().expect("utf8");
    let spec = run(dir, &format!("{name}-spec"), spec_yaml, &[]);
    let user = run(dir, &format!("{name}-user"), user_yaml, &["--", exe]);
    let own = run_with_env(
        dir,
        &format!("{name}-own-loop"),
        user_yaml,
        &["--", exe],
        &[("LOOP", "own")],
    );
    let initial = run(dir, &format!("{name}-initial"), "max_steps: 0\n", &[]);
    let moved = relative_error(&spec, &initial);
    assert!(
        moved > 1e-2,
        "{name}: the parameters barely moved ({moved})"
    );
    assert_bitwise(&format!("{name}: user module vs spec model"), &user, &spec);
    assert_bitwise(
        &format!("{name}: the program's own loop vs the library's"),
        &own,
        &user,
    );
}

#[test]
fn sync_all_reduce() {
    let dir = tmp();
    let job = "world_size: 2\nbatch_size: 32\nmax_steps: 100\n";
    both_ways(dir.path(), "sync", job);
    // The YAML model from a program's own loop (`flotilla_burn::spec_session`).
    let exe = program();
    let env = [("MODEL", "spec")];
    let looped = run_with_env(
        dir.path(),
        "spec-loop",
        job,
        &["--", exe.to_str().expect("utf8")],
        &env,
    );
    let spec = spec_names(checkpoint_tensors(&dir.path().join("sync-spec")));
    assert_bitwise(
        "the YAML model from a program's loop vs flotilla launch",
        &looped,
        &spec,
    );
}

/// With burn's own `forward`s (`burn::nn` layers) instead of Flotilla's kernels: the same
/// training, up to the rounding of other kernels.
#[test]
fn burn_nn_layers_train_within_rounding_of_the_spec_model() {
    let dir = tmp();
    let exe = program();
    let exe = exe.to_str().expect("utf8");
    let job = "world_size: 2\nbatch_size: 32\nmax_steps: 20\n";
    let spec = run(dir.path(), "spec", job, &[]);
    let burn = run_with_env(dir.path(), "burn", job, &["--", exe], &[("LAYERS", "burn")]);
    let initial = run(dir.path(), "initial", "max_steps: 0\n", &[]);
    let moved = relative_error(&spec, &initial);
    assert!(moved > 1e-3, "the parameters barely moved ({moved})");
    let e = relative_error(&burn, &spec);
    assert!(
        e > 0.0,
        "burn's layers gave the kernels' bits: the switch did nothing"
    );
    assert!(
        e <= 1e-4,
        "burn::nn layers vs the spec model: relative error {e}"
    );
}

#[test]
fn zero_2() {
    let dir = tmp();
    both_ways(
        dir.path(),
        "zero2",
        "world_size: 2\nbatch_size: 32\nmax_steps: 100\nzero: 2\n",
    );
}

/// ZeRO-3 of the program's module runs it as its stage modules (each gathered before it
/// runs, released after, recomputed in backward): the spec model's ZeRO-3 bits, which are its
/// ZeRO-0 bits (`zero_tests.rs`); the same with the gathers not prefetched.
#[test]
fn zero_3() {
    let dir = tmp();
    let job = "world_size: 2\nbatch_size: 32\nmax_steps: 100\nzero: 3\n";
    both_ways(dir.path(), "zero3", job);
    let exe = program();
    let exe = exe.to_str().expect("utf8");
    let user = run(dir.path(), "zero3-user", job, &["--", exe]);
    let zero0 = "world_size: 2\nbatch_size: 32\nmax_steps: 100\n";
    let whole = run(dir.path(), "zero0-user", zero0, &["--", exe]);
    assert_bitwise("the program's module: ZeRO-3 vs ZeRO-0", &user, &whole);
    let prefetch_off = format!("{job}prefetch: false\n");
    let unfetched = run(dir.path(), "zero3-no-prefetch", &prefetch_off, &["--", exe]);
    assert_bitwise("ZeRO-3 without prefetch vs with", &unfetched, &user);
}

/// `recompute: true` runs the program's module as its stage modules, each one's forward
/// recomputed in backward: the bits of the run without it.
#[test]
fn recomputation_of_a_programs_module() {
    let dir = tmp();
    let exe = program();
    let exe = exe.to_str().expect("utf8");
    let job = "world_size: 2\nbatch_size: 32\nmax_steps: 100\n";
    let plain = run(dir.path(), "plain", job, &["--", exe]);
    let with = format!("{job}recompute: true\n");
    let recomputed = run(dir.path(), "recomputed", &with, &["--", exe]);
    let own = run_with_env(
        dir.path(),
        "recomputed-own-loop",
        &with,
        &["--", exe],
        &[("LOOP", "own")],
    );
    assert_bitwise("recomputed vs not", &recomputed, &plain);
    assert_bitwise("the program's own loop, recomputed", &own, &plain);
}

#[test]
fn async_all_reduce() {
    let dir = tmp();
    both_ways(
        dir.path(),
        "async",
        "world_size: 2\nbatch_size: 32\nmax_steps: 100\nstrategy: async_allreduce\n",
    );
}

#[test]
fn flat_sync_parameter_server() {
    let dir = tmp();
    both_ways(
        dir.path(),
        "ps-flat",
        "arch: flat\nparameter_server: {aggr_type: sync, num_workers: 2}\nbatch_size: 32\n\
         num_server_rounds: 100\n",
    );
}

#[test]
fn hierarchical_sync_parameter_server_with_model_averaging() {
    let dir = tmp();
    both_ways(
        dir.path(),
        "ps-hier",
        "arch: hierarchical\nbatch_size: 16\nnum_server_rounds: 60\nlocal_steps: 2\n\
         global_server:\n  aggr_type: sync\n  local_servers:\n\
         \x20   - {aggr_type: sync, num_workers: 2}\n    - {aggr_type: sync, num_workers: 2}\n",
    );
}

#[test]
fn exact_resume_of_a_program() {
    exact_resume("world_size: 2\nbatch_size: 32\n");
}

/// Under ZeRO-3 the resumed start loads the whole module on rank 0 and shards it by its
/// blocks; the run goes on to the same bits.
#[test]
fn exact_resume_of_a_program_under_zero_3() {
    exact_resume("world_size: 2\nbatch_size: 32\nzero: 3\n");
}

/// The program's job `job` (plus `checkpoint_every: 50`, to step 120) stopped at its
/// checkpoint of step 50 and resumed: the bits of the run that never stopped.
fn exact_resume(job: &str) {
    let dir = tmp();
    let exe = program();
    let exe = exe.to_str().expect("utf8");
    let job = format!("{job}max_steps: 120\ncheckpoint_every: 50\n");
    let straight = run(dir.path(), "job", &job, &["--", exe]);
    // Back to the checkpoint of step 50 (mid-epoch), as if the job had stopped there, and
    // resumed from it: the same 70 steps again, to the same bits.
    let root = dir.path().join("job").join("checkpoints");
    for later in ["step-00000100", "step-00000120"] {
        std::fs::remove_dir_all(root.join(later)).expect("remove a later checkpoint");
    }
    std::fs::write(root.join("latest"), "step-00000050\n").expect("latest");
    let cfg = dir.path().join("job.yaml");
    let out = dir.path().join("job");
    let (cfg, out) = (cfg.to_str().expect("utf8"), out.to_str().expect("utf8"));
    launch(&[cfg, "--output", out, "--resume", "--", exe], LIMIT);
    // It took 70 steps from 50 (a run from scratch would give the same bits, in 120).
    let summary = std::fs::read(Path::new(out).join("summary.json")).expect("summary.json");
    let summary: serde_json::Value = serde_json::from_slice(&summary).expect("json");
    let run = &summary["run"];
    assert_eq!(
        (run["resumed_at"].as_f64(), run["steps_run"].as_f64()),
        (Some(50.0), Some(70.0)),
        "{run}"
    );
    let resumed = spec_names(checkpoint_tensors(Path::new(out)));
    assert_bitwise("resumed at 50 vs straight to 120", &resumed, &straight);
}

/// A program's own loop (`flotilla_burn::session`, `LOOP=own`) writes a checkpoint where it
/// asks (after step 30) and stops where it says (after step 70, its final checkpoint there);
/// resumed from that one, it goes on to the bits of a run that never stopped.
#[test]
fn a_programs_own_loop_checkpoints_and_stops_where_it_says_and_resumes_to_the_same_bits() {
    let dir = tmp();
    let exe = program();
    let exe = exe.to_str().expect("utf8");
    let job = "world_size: 2\nbatch_size: 32\nmax_steps: 120\n";
    let straight = run(dir.path(), "straight", job, &["--", exe]);
    let own = [("LOOP", "own"), ("CHECKPOINT_AT", "30"), ("STOP_AT", "70")];
    run_with_env(dir.path(), "own", job, &["--", exe], &own);
    let out = dir.path().join("own");
    let root = out.join("checkpoints");
    let mut written: Vec<String> = std::fs::read_dir(&root)
        .expect("checkpoints")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    written.sort();
    assert_eq!(written, ["step-00000030", "step-00000070"], "{root:?}");
    let own = [("LOOP", "own")];
    let resumed = run_with_env(dir.path(), "own", job, &["--resume", "--", exe], &own);
    assert_bitwise(
        "stopped at 70, resumed to 120 vs straight",
        &resumed,
        &straight,
    );
}

/// A program's `Session::save_model` (`SAVE_MODEL=PATH SAVE_MODEL_AT=40` in its own loop)
/// writes the whole module's parameters where it says as they are after that step: the
/// tensors of the checkpoint written after the same step, bit for bit, under ZeRO-3 (gathered
/// one bucket at a time as the file is written: all-reduce's bits), plain all-reduce, a flat parameter server
/// (the root's) and a pipeline (its stages' merged); and the program loads the file back into
/// a module of its own (a pipeline's names each tensor by its stage module: not loaded there).
#[test]
fn a_programs_module_is_saved_where_it_says_as_that_steps_checkpoint_holds_it() {
    let dir = tmp();
    let exe = program();
    let exe = exe.to_str().expect("utf8");
    let jobs = [
        (
            "zero3",
            "world_size: 2\nbatch_size: 32\nmax_steps: 60\nzero: 3\n",
        ),
        (
            "allreduce",
            "world_size: 2\nbatch_size: 32\nmax_steps: 60\n",
        ),
        (
            "flat",
            "arch: flat\nparameter_server: {aggr_type: sync, num_workers: 2}\nbatch_size: 32\n\
             num_server_rounds: 60\n",
        ),
        (
            "pipeline",
            "arch: pipeline\nstages: 2\nbatch_size: 32\nmicro_batches: 4\nmax_steps: 60\n",
        ),
    ];
    for (name, job) in jobs {
        let file = dir.path().join(format!("{name}.safetensors"));
        let env = [
            ("LOOP", "own"),
            ("CHECKPOINT_AT", "40"),
            ("SAVE_MODEL_AT", "40"),
            ("SAVE_MODEL", file.to_str().expect("utf8")),
        ];
        let o = launch_job(dir.path(), name, job, &["--", exe], &env);
        let out = String::from_utf8_lossy(&o.stdout);
        let at_40 = dir.path().join(name).join("checkpoints/step-00000040");
        let want = safetensors_file(&at_40.join("model.safetensors"));
        assert_eq!(want.len(), 10, "{name}: LeNet-5's tensors");
        assert_bitwise(
            &format!("{name}: saved vs checkpoint"),
            &safetensors_file(&file),
            &want,
        );
        let last = safetensors_file(
            &dir.path()
                .join(name)
                .join("checkpoints/step-00000060/model.safetensors"),
        );
        assert!(
            relative_error(&last, &want) > 1e-4,
            "{name}: saved after step 40, not at the end"
        );
        let loaded = out
            .matches("own loop: loaded back, 61706 parameters")
            .count();
        assert_eq!(loaded, usize::from(name != "pipeline"), "{name}\n{out}");
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .expect("dir")
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().contains(".tmp"))
            .collect();
        assert!(left.is_empty(), "{name}: temporary files left: {left:?}");
    }
    // ZeRO-3 trains to ZeRO-0's bits (`zero_3`): its file, gathered as written, is theirs.
    let saved = |name: &str| safetensors_file(&dir.path().join(format!("{name}.safetensors")));
    assert_bitwise(
        "saved: ZeRO-3 vs all-reduce",
        &saved("zero3"),
        &saved("allreduce"),
    );
}

/// A program's own data (`DATA=data/mnist TRAIN_SAMPLES=8000`: the first 8,000 training
/// images read and held by the program, handed to `flotilla_burn::session_with_data`) trains
/// to the bits of the job's data cut to the same images (`train_limit: 8000`) on 2 ranks,
/// past an epoch's end (125 steps): the run shards and shuffles a program's samples as it
/// does `data.path`'s. Its data is the one trained on: the job's whole data gives others.
#[test]
fn a_programs_own_data_trains_to_the_bits_of_the_jobs_data() {
    let dir = tmp();
    let exe = program();
    let exe = exe.to_str().expect("utf8");
    let job = "world_size: 2\nbatch_size: 32\nmax_steps: 160\n";
    let cut = format!("{job}train_limit: 8000\n");
    let limited = run(dir.path(), "limited", &cut, &["--", exe]);
    let env = [
        ("LOOP", "own"),
        ("DATA", "data/mnist"),
        ("TRAIN_SAMPLES", "8000"),
    ];
    let own = run_with_env(dir.path(), "own", job, &["--", exe], &env);
    assert_bitwise(
        "the program's 8000 images vs train_limit: 8000",
        &own,
        &limited,
    );
    let whole = run(dir.path(), "whole", job, &["--", exe]);
    assert_ne!(own, whole, "the program's data made no difference");
}

/// A program's own evaluations (`Session::evaluate`, `EVAL_AT=60,120`): the one after the
/// last step gives the run's final accuracy on every rank, and the one mid-run changes
/// nothing in training (the bits of a run without them).
#[test]
fn a_programs_own_evaluation_is_the_runs_and_changes_nothing() {
    let dir = tmp();
    let exe = program();
    let exe = exe.to_str().expect("utf8");
    let job = "world_size: 2\nbatch_size: 32\nmax_steps: 120\n";
    let straight = run(dir.path(), "straight", job, &["--", exe]);
    let env = [("LOOP", "own"), ("EVAL_AT", "60,120")];
    let o = launch_job(dir.path(), "eval", job, &["--", exe], &env);
    let out = dir.path().join("eval");
    let stdout = String::from_utf8_lossy(&o.stdout);
    let accuracy_at = |rank: usize, step: u64| -> f64 {
        let head = format!("[rank {rank}] own loop: eval at step {step} test_acc=");
        let line = stdout.lines().find_map(|l| l.strip_prefix(head.as_str()));
        let line = line.unwrap_or_else(|| panic!("no `{head}` line\n{stdout}"));
        line.trim().parse().expect("an accuracy")
    };
    let summary = std::fs::read(out.join("summary.json")).expect("summary.json");
    let summary: serde_json::Value = serde_json::from_slice(&summary).expect("json");
    let fin = summary["run"]["final_acc"].as_f64().expect("final_acc");
    for rank in [0, 1] {
        assert_eq!(
            accuracy_at(rank, 120),
            (fin * 1e6).round() / 1e6,
            "rank {rank}"
        );
        assert!(
            accuracy_at(rank, 60) > 0.1,
            "rank {rank} evaluated an untrained model"
        );
    }
    let evaluated = spec_names(checkpoint_tensors(&out));
    assert_bitwise(
        "with evaluations at 60 and 120 vs without",
        &evaluated,
        &straight,
    );
}

/// Under a parameter server every rank of a program's own loop says `stop` after step 20:
/// the root's ends the job there and tells the workers (a worker's own does nothing, so no
/// worker leaves a round unfinished); the final checkpoint is round 20's.
#[test]
fn a_programs_own_stop_under_a_parameter_server_ends_the_job_at_the_roots_round() {
    let dir = tmp();
    let exe = program();
    let job = "arch: flat\nparameter_server: {aggr_type: sync, num_workers: 2}\nbatch_size: 32\n\
               num_server_rounds: 60\n";
    let env = [("LOOP", "own"), ("STOP_AT", "20")];
    run_with_env(
        dir.path(),
        "ps",
        job,
        &["--", exe.to_str().expect("utf8")],
        &env,
    );
    let root = dir.path().join("ps").join("checkpoints");
    let latest = std::fs::read_to_string(root.join("latest")).expect("latest");
    assert_eq!(latest.trim(), "step-00000020");
}

/// `flotilla launch --max-restarts 1 -- PROGRAM` with one rank SIGKILLed after the checkpoint
/// of step 50: the launcher starts the program again, its ranks resume from the newest
/// checkpoint, and the run ends bitwise where an uninterrupted one does.
#[test]
fn a_program_killed_mid_run_restarts_from_its_checkpoint_to_the_same_bits() {
    let dir = tmp();
    let exe = program();
    let exe = exe.to_str().expect("utf8");
    let job = "world_size: 2\nbatch_size: 32\nmax_steps: 150\ncheckpoint_every: 25\n\
               train_limit: 20000\n";
    let straight = run(dir.path(), "straight", job, &["--", exe]);
    let cfg = config_file(dir.path(), "killed.yaml", &format!("{COMMON}{job}"));
    let out = dir.path().join("killed");
    let log = std::fs::File::create(dir.path().join("killed.log")).expect("log");
    let mut c = flotilla();
    c.args(["launch", &cfg, "--max-restarts", "1", "--output"])
        .arg(&out)
        .args(["--", exe])
        .stdout(log.try_clone().expect("log"))
        .stderr(log);
    let mut launcher = Proc(c.spawn().expect("spawn the launcher"));
    let started = std::time::Instant::now();
    let ck = out.join("checkpoints/step-00000050");
    while !ck.is_dir() {
        assert!(started.elapsed() < LIMIT, "{} never appeared", ck.display());
        std::thread::sleep(Duration::from_millis(10));
    }
    let ranks = procfs::children_of(launcher.0.id());
    let victim = *ranks.last().expect("the launcher's ranks");
    let killed = std::process::Command::new("kill")
        .args(["-9", &victim.to_string()])
        .status()
        .expect("kill");
    assert!(killed.success(), "kill -9 {victim}");
    let status = loop {
        if let Some(status) = launcher.0.try_wait().expect("wait") {
            break status;
        }
        assert!(started.elapsed() < LIMIT, "the launcher did not end");
        std::thread::sleep(Duration::from_millis(50));
    };
    let printed = std::fs::read_to_string(dir.path().join("killed.log")).expect("log");
    assert!(status.success(), "{printed}");
    assert!(
        printed.contains("[launcher] restart 1/1 after: rank"),
        "no restart:\n{printed}"
    );
    let summary = std::fs::read(out.join("summary.json")).expect("summary.json");
    let summary: serde_json::Value = serde_json::from_slice(&summary).expect("json");
    let resumed_at = summary["run"]["resumed_at"].as_f64().expect("resumed_at");
    assert!(
        resumed_at >= 50.0,
        "the restart did not resume from a checkpoint: {}",
        summary["run"]
    );
    let ended = spec_names(checkpoint_tensors(&out));
    assert_bitwise("killed and restarted vs uninterrupted", &ended, &straight);
}

/// LeNet-5 cut after its convolutions (layer 7) into 2 stages, 4 micro-batches, 1F1B: the
/// spec cut by `split_points`, the program's two stage modules (`Features`, `Classifier`)
/// in the same pipeline.
#[test]
fn two_pipeline_stages() {
    let dir = tmp();
    let job = "arch: pipeline\nbatch_size: 32\nmicro_batches: 4\nmax_steps: 200\n";
    both_ways_cut(
        dir.path(),
        "pipeline",
        &format!("{job}split_points: [7]\n"),
        &format!("{job}stages: 2\n"),
    );
}

/// A program's stages are its modules: a cut by layers is refused, naming the key and
/// what to give instead.
#[test]
fn a_programs_pipeline_refuses_a_cut_by_layers() {
    let dir = tmp();
    let cfg = config_file(
        dir.path(),
        "pipe.yaml",
        &format!("{COMMON}arch: pipeline\nsplit_points: [7]\nmax_steps: 5\n"),
    );
    let mut c = flotilla();
    c.args(["launch", &cfg, "--output"])
        .arg(dir.path().join("pipe"))
        .arg("--")
        .arg(program());
    let o = run_with_deadline(c, LIMIT);
    assert!(!o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("pipeline.stages") && text(&o).contains("stages: N"),
        "the refusal does not say what to do:\n{}",
        text(&o)
    );
}

/// `flotilla compare -- PROGRAM` runs each strategy with the program as its ranks: the
/// user's module ends each strategy as the spec model's comparison does, bit for bit.
#[test]
fn compare_runs_a_program_in_each_strategy_as_the_spec_model() {
    let dir = tmp();
    let exe = program();
    let compare = |name: &str, extra: &[&str]| -> PathBuf {
        let out = dir.path().join(name);
        let mut c = flotilla();
        c.args(["compare", "--strategies", "sync_allreduce,ps_flat_sync"])
            .args(["--max-steps", "40", "--batch-size", "32", "--seed", "5"])
            .args(["--output", out.to_str().expect("utf8")])
            .args(extra);
        let o = run_with_deadline(c, LIMIT);
        assert!(o.status.success(), "{name}: {}", text(&o));
        out
    };
    let spec = compare("spec", &[]);
    let user = compare("user", &["--", exe.to_str().expect("utf8")]);
    for strategy in ["sync_allreduce", "ps_flat_sync"] {
        let a = spec_names(checkpoint_tensors(&spec.join(strategy)));
        let b = checkpoint_tensors(&user.join(strategy));
        // The program's ranks wrote it: its module's own names, not the spec's.
        assert!(
            b.contains_key("features.conv1.weight"),
            "{strategy}: {:?}",
            b.keys()
        );
        let b = spec_names(b);
        assert_bitwise(&format!("compare {strategy}: program vs spec"), &b, &a);
    }
}

/// Gradient accumulation (`accumulation_steps: 2`, DDP's `no_sync`): 2 ranks of 2
/// micro-batches of 16 train as 1 rank on the global batch of 64 (to rounding); ZeRO-1, 2 and
/// 3 (the earlier micro-batch through the shards, summed on the rank) give the bits of plain
/// all-reduce; the user's module, whole and under ZeRO-3, the bits of the spec model;
/// async all-reduce with `staleness: 0` the bits of sync; a sync parameter server's workers
/// of 2 micro-batches what they train on one batch of both.
#[test]
fn gradient_accumulation() {
    let dir = tmp();
    let exe = program();
    let exe = exe.to_str().expect("utf8");
    let two = "world_size: 2\nbatch_size: 16\naccumulation_steps: 2\nmax_steps: 50\n";
    let spec = run(dir.path(), "two", two, &[]);
    let one = run(
        dir.path(),
        "one",
        "world_size: 1\nbatch_size: 64\nmax_steps: 50\n",
        &[],
    );
    let initial = run(dir.path(), "initial", "max_steps: 0\n", &[]);
    let moved = relative_error(&one, &initial);
    assert!(moved > 1e-2, "the parameters barely moved ({moved})");
    let e = relative_error(&spec, &one);
    assert!(
        e <= 1e-5,
        "2 ranks x 2 micro-batches vs 1 rank: relative error {e}"
    );
    let unaccumulated = run(
        dir.path(),
        "two-plain",
        "world_size: 2\nbatch_size: 16\nmax_steps: 50\n",
        &[],
    );
    let e = relative_error(&unaccumulated, &one);
    assert!(
        e > 1e-3,
        "the check cannot tell half the batch from all of it ({e})"
    );
    for zero in [1, 2, 3] {
        let name = format!("two-zero{zero}");
        let sharded = run(dir.path(), &name, &format!("{two}zero: {zero}\n"), &[]);
        assert_bitwise(
            &format!("accumulation: ZeRO-{zero} vs all-reduce"),
            &sharded,
            &spec,
        );
    }
    let user = run(dir.path(), "two-user", two, &["--", exe]);
    assert_bitwise("accumulation: user module vs spec model", &user, &spec);
    // ZeRO-3 by its stage modules; kept gathered from forward to backward, nothing recomputed.
    for (name, keep) in [
        ("two-user-zero3", ""),
        ("two-user-zero3-kept", "reshard_after_forward: false\n"),
    ] {
        let user_3 = run(
            dir.path(),
            name,
            &format!("{two}zero: 3\n{keep}"),
            &["--", exe],
        );
        assert_bitwise(
            &format!("accumulation: user module, {name}"),
            &user_3,
            &spec,
        );
    }
    // Async all-reduce with nothing in flight (`staleness: 0`) steps as sync does.
    let async_ = run(
        dir.path(),
        "two-async",
        &format!("{two}strategy: async_allreduce\nstaleness: 0\n"),
        &[],
    );
    assert_bitwise("accumulation: async (staleness 0) vs sync", &async_, &spec);
    // A sync parameter server's workers push the mean over their micro-batches: as a
    // batch of all of them (to rounding).
    let ps = "arch: flat\nworld_size: 3\nmax_steps: 50\n";
    let whole = run(dir.path(), "ps", &format!("{ps}batch_size: 32\n"), &[]);
    let micro = run(
        dir.path(),
        "ps-micro",
        &format!("{ps}batch_size: 16\naccumulation_steps: 2\n"),
        &[],
    );
    let e = relative_error(&micro, &whole);
    assert!(
        e <= 1e-5,
        "PS workers: 2 micro-batches of 16 vs 32: relative error {e}"
    );
    let e = relative_error(&whole, &initial);
    assert!(e > 1e-2, "the PS run barely moved ({e})");
}

/// Every micro-batch reduced on its own (`reduce_each_micro_batch: true`: DDP without
/// `no_sync`, FSDP's default, a ZeRO-3 rank never holding a whole gradient): 2 ranks of 2
/// micro-batches train as they do summing the micro-batches first (to rounding, and not to
/// the bit: the sums are in another order, so the setting took effect), and ZeRO-1, 2 and 3
/// and the user's module under ZeRO-3 give the bits of plain all-reduce reducing each.
#[test]
fn reducing_each_micro_batch() {
    let dir = tmp();
    let exe = program();
    let exe = exe.to_str().expect("utf8");
    let two = "world_size: 2\nbatch_size: 16\naccumulation_steps: 2\nmax_steps: 50\n";
    let summed = run(dir.path(), "summed", two, &[]);
    let each = format!("{two}reduce_each_micro_batch: true\n");
    let spec = run(dir.path(), "each", &each, &[]);
    let e = relative_error(&spec, &summed);
    assert!(
        e <= 1e-5,
        "each reduced vs summed first: relative error {e}"
    );
    assert!(
        spec != summed,
        "reducing each micro-batch gave the bits of summing them first: not in effect"
    );
    for zero in [1, 2, 3] {
        let name = format!("each-zero{zero}");
        let sharded = run(dir.path(), &name, &format!("{each}zero: {zero}\n"), &[]);
        assert_bitwise(
            &format!("each micro-batch reduced: ZeRO-{zero} vs all-reduce"),
            &sharded,
            &spec,
        );
    }
    let user_3 = run(
        dir.path(),
        "each-user-zero3",
        &format!("{each}zero: 3\n"),
        &["--", exe],
    );
    assert_bitwise(
        "each micro-batch reduced: user module under ZeRO-3",
        &user_3,
        &spec,
    );
}

/// Clipping by global norm (`clip_grad_norm: 0.5`, PyTorch's `clip_grad_norm_`): 2 ranks
/// train as 1 rank on the global batch (to rounding), the clipping changes the run, ZeRO-1,
/// 2 and 3 (the norm summed from the ranks' shards) give the bits of plain all-reduce, and
/// the user's module (whole, and under ZeRO-3) and async all-reduce with `staleness: 0` the
/// bits of sync. So do 2 pipeline stages of 2
/// accumulated batches of 32 in 2 micro-batches each (to rounding; the program's stage
/// modules: the spec's bits).
#[test]
fn clipping_by_global_norm() {
    let dir = tmp();
    let exe = program();
    let exe = exe.to_str().expect("utf8");
    let clip = "clip_grad_norm: 0.5\nmax_steps: 50\n";
    let two = run(
        dir.path(),
        "two",
        &format!("world_size: 2\nbatch_size: 32\n{clip}"),
        &[],
    );
    let one = run(
        dir.path(),
        "one",
        &format!("world_size: 1\nbatch_size: 64\n{clip}"),
        &[],
    );
    let e = relative_error(&two, &one);
    assert!(e <= 1e-5, "clipped: 2 ranks vs 1 rank: relative error {e}");
    let unclipped = run(
        dir.path(),
        "unclipped",
        "world_size: 1\nbatch_size: 64\nmax_steps: 50\n",
        &[],
    );
    let e = relative_error(&unclipped, &one);
    assert!(e > 1e-3, "clipping at 0.5 changed nothing ({e})");
    for zero in [1, 2, 3] {
        let sharded = run(
            dir.path(),
            &format!("zero{zero}"),
            &format!("world_size: 2\nbatch_size: 32\nzero: {zero}\n{clip}"),
            &[],
        );
        assert_bitwise(
            &format!("clipped: ZeRO-{zero} vs all-reduce"),
            &sharded,
            &two,
        );
    }
    let user = run(
        dir.path(),
        "user",
        &format!("world_size: 2\nbatch_size: 32\n{clip}"),
        &["--", exe],
    );
    assert_bitwise("clipped: user module vs spec model", &user, &two);
    let user_zero_3 = run(
        dir.path(),
        "user-zero3",
        &format!("world_size: 2\nbatch_size: 32\nzero: 3\n{clip}"),
        &["--", exe],
    );
    assert_bitwise("clipped: user module under ZeRO-3", &user_zero_3, &two);
    let async_ = run(
        dir.path(),
        "async",
        &format!("world_size: 2\nbatch_size: 32\nstrategy: async_allreduce\nstaleness: 0\n{clip}"),
        &[],
    );
    assert_bitwise("clipped: async (staleness 0) vs sync", &async_, &two);
    // A pipeline: the norm over both stages' gradients (shares summed in stage order), and
    // accumulation as twice the micro-batches.
    let pipe =
        format!("arch: pipeline\nbatch_size: 32\naccumulation_steps: 2\nmicro_batches: 2\n{clip}");
    let spec = run(
        dir.path(),
        "pipe",
        &format!("{pipe}split_points: [7]\n"),
        &[],
    );
    let e = relative_error(&spec, &one);
    assert!(e <= 1e-5, "clipped pipeline vs 1 rank: relative error {e}");
    let user = run(
        dir.path(),
        "pipe-user",
        &format!("{pipe}stages: 2\n"),
        &["--", exe],
    );
    assert_bitwise("clipped pipeline: user stages vs spec", &user, &spec);
}

/// Clipping at a sync parameter server that holds every parameter: each mean gradient it
/// applies, so its 2 workers train as 2 all-reduce ranks do (to rounding).
#[test]
fn clipping_at_a_parameter_server() {
    let dir = tmp();
    let clip = "clip_grad_norm: 0.5\nmax_steps: 50\n";
    let two = run(
        dir.path(),
        "two",
        &format!("world_size: 2\nbatch_size: 32\n{clip}"),
        &[],
    );
    let ps = run(
        dir.path(),
        "ps",
        &format!("arch: flat\nworld_size: 3\nbatch_size: 32\n{clip}"),
        &[],
    );
    let e = relative_error(&ps, &two);
    assert!(
        e <= 1e-5,
        "clipped: flat sync PS vs all-reduce: relative error {e}"
    );
}
