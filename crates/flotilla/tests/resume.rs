//! Resume after a crash: a run killed mid-way and resumed with the same config ends with
//! exactly the parameters of a run that was never interrupted.

mod common;
#[path = "common/starts.rs"]
mod starts;

use common::*;
use starts::summary;

use std::path::Path;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(300);

/// 1,280 samples at 2 x 16 per step: 40 steps per epoch. Checkpoints at steps 25, 50, 75; the
/// crash comes at step 60 (after the checkpoint of step 50, before the epoch ends at 80); the
/// warm-up ends at step 60 and cosine decay follows, so the learning rate changes across the
/// resumed window.
fn config(optimizer: &str, extra: &str) -> String {
    format!(
        "world_size: 2\nbatch_size: 16\ntrain_limit: 1280\nepochs: 3\nmax_steps: 100\n\
         checkpoint_every: 25\nwarmup_steps: 60\nlr_schedule: cosine\noptimizer: {optimizer}\n{extra}"
    )
}

fn launch_config(
    cfg: &str,
    out: &Path,
    extra: &[&str],
    fault: Option<&str>,
) -> std::process::Output {
    let mut c = flotilla();
    c.args(["launch", cfg, "--output", out.to_str().expect("utf8")])
        .args(extra);
    if let Some(f) = fault {
        c.env("FLOTILLA_FAULT", f);
    }
    run_with_deadline(c, LIMIT)
}

/// The resumed run's own count, from its `summary.json`: it started at step (round) 50 and
/// took exactly the 50 steps left to 100 itself — on rank 0 and, with `every_rank`, on
/// every rank (an async server's workers push as often as they get to, so not theirs).
fn assert_ran_the_rest(name: &str, out: &Path, every_rank: bool) {
    let s = summary(out);
    let run = &s["run"];
    assert_eq!(
        (&run["steps"], &run["resumed_at"], &run["steps_run"]),
        (&100.into(), &50.into(), &50.into()),
        "{name}: rank 0 must resume at 50 and run 50 of 100 steps: {run}"
    );
    let ranks = s["ranks"].as_array().expect("every rank's report");
    for r in ranks.iter().filter(|r| every_rank || r["rank"] == 0) {
        let f = &r["figures"];
        assert_eq!(
            (f["resumed_at"].as_f64(), f["steps_run"].as_f64()),
            (Some(50.0), Some(50.0)),
            "{name}: rank {} must resume at 50 and run 50 steps: {f}",
            r["rank"]
        );
    }
    assert_eq!(
        ranks.len(),
        s["topology"]["world_size"].as_u64().expect("n") as usize
    );
}

/// The part of rank 0's run.log written by the last run into `out` (the log appends).
fn last_run_log(out: &Path) -> String {
    let log = run_log(out, 0);
    let start = log.rfind("resuming from").expect("the resumed run says so");
    log[start..].to_string()
}

fn crash_and_resume(name: &str, optimizer: &str, extra: &str) {
    let dir = tmp();
    let cfg = config_file(
        dir.path(),
        &format!("{name}.yaml"),
        &config(optimizer, extra),
    );

    let straight = dir.path().join("straight");
    let o = launch_config(&cfg, &straight, &[], None);
    assert!(o.status.success(), "{name}: {}", text(&o));
    assert_eq!(final_fields(&o)["steps"], 100.0);

    let crashed = dir.path().join("crashed");
    let o = launch_config(&cfg, &crashed, &[], Some("rank=1,step=60,action=exit"));
    assert!(
        !o.status.success(),
        "{name}: the crash must fail the job\n{}",
        text(&o)
    );
    let ck = crashed.join("checkpoints");
    assert_eq!(
        std::fs::read_to_string(ck.join("latest"))
            .expect("latest")
            .trim(),
        "step-00000050"
    );
    // What a crash in the middle of the next save leaves behind: a hidden temporary
    // directory, a step directory without its optimizer state, and `latest` naming it.
    std::fs::create_dir_all(ck.join(".step-00000075.tmp-4242")).expect("tmp dir");
    let partial = ck.join("step-00000075");
    std::fs::create_dir_all(&partial).expect("partial");
    std::fs::copy(
        ck.join("step-00000050/model.safetensors"),
        partial.join("model.safetensors"),
    )
    .expect("copy");
    std::fs::write(ck.join("latest"), "step-00000075").expect("latest");

    let o = launch_config(&cfg, &crashed, &["--resume"], None);
    assert!(o.status.success(), "{name}: resume failed\n{}", text(&o));
    assert_eq!(final_fields(&o)["steps"], 100.0);
    assert_ran_the_rest(name, &crashed, true);
    let log = last_run_log(&crashed);
    assert!(
        log.contains("(step 50)"),
        "{name}: resumed from step 50\n{log}"
    );
    assert!(
        !log.contains("another config"),
        "{name}: same config, no warning\n{log}"
    );
    let full = run_log(&crashed, 0);
    assert!(
        full.contains("not resuming from it") && full.contains("step-00000075"),
        "{name}: the incomplete checkpoint is passed over with a warning\n{full}"
    );
    // The resumed run starts inside epoch 2: its first epoch line is epoch 2, never 1.
    let first_epoch = log
        .lines()
        .find_map(|l| l.split("] epoch ").nth(1))
        .expect("an epoch line");
    assert!(
        first_epoch.starts_with("2/3"),
        "{name}: first epoch after resume: {first_epoch}\n{log}"
    );

    let (a, b) = (checkpoint_tensors(&crashed), checkpoint_tensors(&straight));
    assert_bitwise(&format!("{name}: resumed vs uninterrupted"), &a, &b);
    // The parameters did move in the resumed window (step 50 vs 100 differ).
    let at_50 = {
        let bytes = std::fs::read(ck.join("step-00000050/model.safetensors")).expect("read");
        let st = safetensors::SafeTensors::deserialize(&bytes).expect("st");
        st.tensor("layers.0.weight")
            .expect("tensor")
            .data()
            .to_vec()
    };
    let final_0: Vec<u8> = a["layers.0.weight"]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    assert_ne!(at_50, final_0, "{name}: nothing trained after the resume");
}

#[test]
fn sgd_with_momentum_resumes_bitwise() {
    crash_and_resume("sgd", "{name: sgd, lr: 0.05, momentum: 0.9}", "");
}

#[test]
fn adam_resumes_bitwise() {
    crash_and_resume("adam", "{name: adam, lr: 0.001}", "");
}

/// Async all-reduce drains every step in flight before a checkpoint and forgets its last
/// update (the weight prediction starts afresh), so a resumed run is the uninterrupted one.
#[test]
fn async_allreduce_resumes_bitwise() {
    crash_and_resume(
        "async",
        "{name: sgd, lr: 0.05, momentum: 0.9}",
        "strategy: async_allreduce\n",
    );
}

/// A parameter-server job of `topology` (100 rounds of 16 samples per worker, checkpoints
/// every 25 rounds) crashed by `crash` (a rank's exit at round 60) and resumed: it goes on
/// from round 50 to round 100 (`sync`: every rank ran exactly those rounds). Returns the
/// uninterrupted and the resumed final parameters, and those of the checkpoint resumed from.
fn ps_crash_and_resume(
    name: &str,
    topology: &str,
    optimizer: &str,
    crash: &str,
    sync: bool,
) -> [std::collections::BTreeMap<String, Vec<f32>>; 3] {
    let dir = tmp();
    let yaml = format!(
        "{topology}\nbatch_size: 16\ntrain_limit: 1280\nnum_server_rounds: 100\neval_every: 50\n\
         checkpoint_every: 25\nwarmup_steps: 60\nlr_schedule: cosine\noptimizer: {optimizer}\n"
    );
    let cfg = config_file(dir.path(), &format!("{name}.yaml"), &yaml);
    let straight = dir.path().join("straight");
    let o = launch_config(&cfg, &straight, &[], None);
    assert!(o.status.success(), "{name}: {}", text(&o));
    assert_eq!(final_fields(&o)["steps"], 100.0, "{name}");

    let crashed = dir.path().join("crashed");
    let o = launch_config(&cfg, &crashed, &[], Some(crash));
    assert!(!o.status.success(), "{name}: the crash fails the job");
    let latest = crashed.join("checkpoints/latest");
    assert_eq!(
        std::fs::read_to_string(latest).expect("latest").trim(),
        "step-00000050",
        "{name}"
    );
    let resumed_from = checkpoint_tensors(&crashed);
    let o = launch_config(&cfg, &crashed, &["--resume"], None);
    assert!(o.status.success(), "{name}: resume failed\n{}", text(&o));
    assert_eq!(final_fields(&o)["steps"], 100.0, "{name}");
    assert_ran_the_rest(name, &crashed, sync);
    let log = last_run_log(&crashed);
    assert!(log.contains("(step 50)"), "{name}: from round 50\n{log}");
    // The root's first round after the resume is round 51 (an async round is an update per
    // worker: version 102 there).
    assert!(
        !log.contains("round 1 v") && log.contains("round 51 v"),
        "{name}: rounds go on from 50\n{log}"
    );
    [
        checkpoint_tensors(&straight),
        checkpoint_tensors(&crashed),
        resumed_from,
    ]
}

/// A flat sync server's rounds are deterministic (pushes summed in worker order), and its
/// resume restores parameters, momentum, the round (learning-rate schedule, versions) and
/// each worker's place in its data: the resumed run is the uninterrupted one, bit for bit.
#[test]
fn flat_sync_parameter_server_resumes_bitwise() {
    let t = ps_crash_and_resume(
        "ps-flat",
        "arch: flat\nparameter_server: {aggr_type: sync, num_workers: 2}",
        "{name: sgd, lr: 0.05, momentum: 0.9}",
        "rank=2,step=60,action=exit",
        true,
    );
    assert_bitwise("ps-flat", &t[0], &t[1]);
}

/// Two shard servers: the root's checkpoint holds every shard's optimizer state (momentum
/// here), and sends the other shard server its parameters and state on resume.
#[test]
fn sharded_and_hierarchical_parameter_servers_resume_bitwise() {
    let t = ps_crash_and_resume(
        "ps-sharded",
        "arch: flat\nservers: 2\nparameter_server: {aggr_type: sync, num_workers: 2}",
        "{name: sgd, lr: 0.05, momentum: 0.9}",
        "rank=1,step=60,action=exit",
        true,
    );
    assert_bitwise("ps-sharded", &t[0], &t[1]);
    let t = ps_crash_and_resume(
        "ps-hier",
        "arch: hierarchical\nglobal_server:\n  aggr_type: sync\n  local_servers:\n    - {aggr_type: sync, num_workers: 2}\n    - {aggr_type: sync, num_workers: 1}",
        "{name: sgd, lr: 0.05, momentum: 0.9}",
        "rank=5,step=60,action=exit",
        true,
    );
    assert_bitwise("ps-hier", &t[0], &t[1]);
}

/// An async server resumes too: it goes on from the checkpoint's round and ends at the
/// planned one. With one worker its updates arrive in one order, so the resumed run is the
/// uninterrupted one bit for bit: it went on from exactly the checkpoint's parameters (and
/// the worker from its place in the data). With two, arrival order decides the bits; the
/// resumed run still trained on from the checkpoint. (A lost async worker does not fail the
/// job, so the root is the rank that crashes here.)
#[test]
fn async_parameter_server_resumes() {
    let [a, b, _] = ps_crash_and_resume(
        "ps-async-1",
        "arch: flat\nparameter_server: {aggr_type: async, num_workers: 1}",
        "{name: sgd, lr: 0.05}",
        "rank=0,step=60,action=exit",
        false,
    );
    assert_bitwise("ps-async, one worker", &a, &b);
    let [a, b, from] = ps_crash_and_resume(
        "ps-async",
        "arch: flat\nparameter_server: {aggr_type: async, num_workers: 2}",
        "{name: sgd, lr: 0.05}",
        "rank=0,step=60,action=exit",
        false,
    );
    // The checkpoint is this far from where the uninterrupted run ended; the resumed run,
    // gone on from it along the same schedule, ends much nearer (about a fifth of it: the
    // two runs' arrival orders differ from the start).
    let (moved, apart) = (relative_error(&from, &a), relative_error(&b, &a));
    assert!(
        moved > 1e-2 && apart < 0.5 * moved,
        "ps-async, two workers: rounds 50-100 moved {moved}, the resumed run ends {apart} away"
    );
}

/// ZeRO stage 2 (each rank holds its shard's Adam moments; checkpoints by shard), real
/// processes: crashed and resumed it ends as the uninterrupted run, bit for bit. Every bucket
/// takes the ring (`small_all_reduce_kb` and `mid_all_reduce_kb` 0), whose order the
/// reduce-scatter keeps.
#[test]
fn zero_2_resumes_bitwise() {
    crash_and_resume(
        "zero2",
        "{name: adam, lr: 0.001}",
        "zero: 2\nsmall_all_reduce_kb: 0\nmid_all_reduce_kb: 0\n",
    );
}

/// Through the CLI on 3 ranks: ZeRO stages 1 and 2 end with the parameters of the unsharded
/// run, bit for bit (AdamW decaying matrices only), and each rank's optimizer state and the
/// averaged gradient it keeps are a third of the unsharded one's.
#[test]
fn zero_1_and_2_equal_zero_0_on_3_ranks() {
    let dir = tmp();
    let optimizer = "{name: adamw, lr: 0.001, weight_decay: 0.1, decay_params: matrices}";
    let run = |zero: u8| {
        let extra =
            format!("zero: {zero}\nsmall_all_reduce_kb: 0\nmid_all_reduce_kb: 0\nmax_steps: 30\n");
        let yaml = config(optimizer, &extra).replace("max_steps: 100\n", "");
        let cfg = config_file(dir.path(), &format!("zero{zero}.yaml"), &yaml);
        let out = dir.path().join(format!("zero{zero}"));
        let o = launch_config(&cfg, &out, &["-n", "3"], None);
        assert!(o.status.success(), "zero {zero}: {}", text(&o));
        let s = summary(&out);
        let figure = |name: &str| -> Vec<f64> {
            s["ranks"]
                .as_array()
                .expect("ranks")
                .iter()
                .map(|r| r["figures"][name].as_f64().expect("a figure"))
                .collect()
        };
        let bytes = figure("optimizer_state_bytes");
        (checkpoint_tensors(&out), bytes, figure("gradient_bytes"))
    };
    let (whole, whole_bytes, whole_grads) = run(0);
    for zero in [1, 2] {
        let (got, bytes, grads) = run(zero);
        // Each rank keeps its third of the averaged gradient (the loss slot aside).
        assert_eq!(grads.iter().sum::<f64>(), whole_grads[0], "zero {zero}");
        for g in &grads {
            assert!(
                (g - whole_grads[0] / 3.0).abs() <= 4.0 * 2.0,
                "zero {zero}: gradient bytes {g} of {whole_grads:?}"
            );
        }
        assert_bitwise(&format!("zero {zero} vs zero 0"), &got, &whole);
        let sum: f64 = bytes.iter().sum();
        assert_eq!(
            sum, whole_bytes[0],
            "zero {zero}: the shards add up to the state"
        );
        for b in &bytes {
            assert!(
                (b - whole_bytes[0] / 3.0).abs() <= 8.0 * 2.0,
                "zero {zero}: {b} of {whole_bytes:?}"
            );
        }
    }
}

/// A checkpoint whose optimizer state does not fit the run (files of another shard cut:
/// ZeRO shards swapped between ranks, or a shard's state where an unsharded run keeps the
/// whole model's) is refused on resume with the tensor and both shapes named, the job
/// exits non-zero, and nothing panics (burn never sees the state).
#[test]
fn a_mismatched_optimizer_state_is_refused_on_resume() {
    let dir = tmp();
    let crashed = |zero: u8| {
        let yaml = format!(
            "world_size: 2\nbatch_size: 16\ntrain_limit: 640\nepochs: 1\nmax_steps: 20\n\
             checkpoint_every: 5\noptimizer: {{name: adam, lr: 0.001}}\nzero: {zero}\n"
        );
        let cfg = config_file(dir.path(), &format!("mismatch{zero}.yaml"), &yaml);
        let out = dir.path().join(format!("zero{zero}"));
        let o = launch_config(&cfg, &out, &[], Some("rank=1,step=8,action=exit"));
        assert!(!o.status.success(), "zero {zero}: the crash fails the job");
        (cfg, out.clone(), out.join("checkpoints/step-00000005"))
    };
    let refused = |cfg: &str, out: &Path, what: &str| {
        let o = launch_config(cfg, out, &["--resume"], None);
        let all = format!("{}\n{}", text(&o), run_log(out, 0));
        assert!(!o.status.success(), "{what}: the resume must fail\n{all}");
        assert!(
            all.contains("optimizer state: tensor") && all.contains("has shape"),
            "{what}: the tensor and both shapes named\n{all}"
        );
        assert!(!all.contains("panicked"), "{what}: no panic\n{all}");
    };
    // Files put in with their checksums (as a copy from another run would bring them), so
    // the checkpoint is whole and only its state does not fit.
    let sums = |ck: &Path| -> serde_json::Map<String, serde_json::Value> {
        let text = std::fs::read(ck.join("checksums.json")).expect("checksums");
        serde_json::from_slice(&text).expect("a map")
    };
    let put = |ck: &Path, name: &str, bytes: &[u8], sum: &serde_json::Value| {
        std::fs::write(ck.join(name), bytes).expect("write");
        let mut all = sums(ck);
        all.insert(name.to_string(), sum.clone());
        let json = serde_json::to_vec(&all).expect("json");
        std::fs::write(ck.join("checksums.json"), json).expect("checksums");
    };
    let (cfg2, out2, ck2) = crashed(2);
    let (a, b) = ("optimizer-shard-0.bpk", "optimizer-shard-1.bpk");
    let bytes_a = std::fs::read(ck2.join(a)).expect("a");
    let bytes_b = std::fs::read(ck2.join(b)).expect("b");
    let original = sums(&ck2);
    put(&ck2, a, &bytes_b, &original[b]);
    put(&ck2, b, &bytes_a, &original[a]);
    refused(&cfg2, &out2, "zero 2, shards swapped");
    let (cfg0, out0, ck0) = crashed(0);
    put(&ck0, "optimizer.bpk", &bytes_a, &original[a]);
    refused(&cfg0, &out0, "zero 0, a shard's state");
}

/// A checkpoint of 2 shard servers resumes at 1 and at 3: it holds the whole model and every
/// shard's optimizer state (Adam's moments, cut anywhere inside a tensor), so each resumed
/// run ends on the bits of the uninterrupted 2-server run (the number of shard servers
/// changes no bit of a sync server's run: `tests/equality.rs`).
#[test]
fn a_parameter_server_checkpoint_resumes_at_another_number_of_shard_servers() {
    let dir = tmp();
    let yaml = |servers: usize| {
        format!(
            "arch: flat\nservers: {servers}\nparameter_server: {{aggr_type: sync, num_workers: 2}}\n\
             batch_size: 16\ntrain_limit: 1280\nnum_server_rounds: 100\neval_every: 50\n\
             checkpoint_every: 25\noptimizer: {{name: adam, lr: 0.002}}\n"
        )
    };
    let cfg = |servers: usize| config_file(dir.path(), &format!("s{servers}.yaml"), &yaml(servers));
    let straight = dir.path().join("straight");
    let o = launch_config(&cfg(2), &straight, &[], None);
    assert!(o.status.success(), "{}", text(&o));
    let whole = checkpoint_tensors(&straight);
    for servers in [1, 3] {
        let crashed = dir.path().join(format!("crashed-{servers}"));
        let o = launch_config(&cfg(2), &crashed, &[], Some("rank=1,step=60,action=exit"));
        assert!(!o.status.success(), "the crash fails the job");
        let o = launch_config(&cfg(servers), &crashed, &["--resume"], None);
        assert!(o.status.success(), "resumed by {servers}: {}", text(&o));
        assert!(
            last_run_log(&crashed).contains("(step 50)"),
            "resumed at 50"
        );
        let name = format!("saved by 2 shard servers, resumed by {servers}");
        assert_bitwise(&name, &checkpoint_tensors(&crashed), &whole);
    }
}

/// A ZeRO-2 checkpoint changes size and back: 30 steps on 4 ranks x 16, resumed on 2 ranks
/// x 32 (each shard of the optimizer state re-cut) for 30 more, then on 4 x 16 again to 90:
/// the same global batches (64, the same samples in every step), so the run ends where an
/// uninterrupted 4-rank one does, up to the order of the gradient sums (2 ranks add in
/// another order than 4: 2.7e-7 relative, not bitwise). Each start ran from its
/// checkpoint's step.
#[test]
fn a_zero_2_checkpoint_goes_from_4_ranks_to_2_and_back() {
    let dir = tmp();
    let yaml = "batch_size: 16\ntrain_limit: 1280\nepochs: 10\nzero: 2\nlr_schedule: constant\n\
                warmup_steps: 0\noptimizer: {name: sgd, lr: 0.05, momentum: 0.9}\n";
    let cfg = config_file(dir.path(), "zero2.yaml", yaml);
    let (trip, whole) = (dir.path().join("trip"), dir.path().join("whole"));
    let o = launch_config(&cfg, &whole, &["-n", "4", "--max-steps", "90"], None);
    assert!(o.status.success(), "uninterrupted: {}", text(&o));
    let legs: [(&str, &str, &str, Option<u64>); 3] = [
        ("4", "16", "30", None),
        ("2", "32", "60", Some(30)),
        ("4", "16", "90", Some(60)),
    ];
    for (n, batch, steps, from) in legs {
        let mut args = vec!["-n", n, "--batch-size", batch, "--max-steps", steps];
        if from.is_some() {
            args.push("--resume");
        }
        let o = launch_config(&cfg, &trip, &args, None);
        assert!(
            o.status.success(),
            "{n} ranks to step {steps}: {}",
            text(&o)
        );
        let run = &summary(&trip)["run"];
        assert_eq!(run["resumed_at"].as_u64(), Some(from.unwrap_or(0)), "{run}");
    }
    let (got, want) = (checkpoint_tensors(&trip), checkpoint_tensors(&whole));
    let err = relative_error(&got, &want);
    assert!(
        err < 1e-5,
        "4 -> 2 -> 4 ranks vs 4 throughout: relative error {err:e}"
    );
    assert!(
        err > 0.0,
        "2 ranks sum in another order than 4: not bitwise"
    );
}

/// A pipeline checkpoint written by 2 stages resumes on 3, and one by 3 on 2: each new
/// stage's weights and Adam state are taken from the old stages' and cut again. A
/// pipeline's maths does not depend on its cut, so 2 stages to step 10, 3 to 20 and 2 to
/// 30 end on the bits of 2 stages throughout (without the optimizer state re-cut, Adam's
/// moments and step count restart and they do not).
#[test]
fn a_pipeline_checkpoint_resumes_at_another_cut() {
    let dir = tmp();
    let base = "examples/mnist-pipeline.yaml";
    let (trip, whole) = (dir.path().join("trip"), dir.path().join("whole"));
    let run = |out: &Path, stages: &str, steps: &str, resume: bool| {
        let mut c = flotilla();
        c.args(["launch", base, "--train-limit", "4000", "--stages", stages])
            .args(["--max-steps", steps, "--checkpoint-every", "10", "--output"])
            .arg(out);
        if resume {
            c.arg("--resume");
        }
        let o = run_with_deadline(c, Duration::from_secs(240));
        assert!(
            o.status.success(),
            "{stages} stages to {steps}: {}",
            text(&o)
        );
    };
    run(&whole, "2", "30", false);
    for (stages, steps, from) in [("2", "10", 0), ("3", "20", 10), ("2", "30", 20)] {
        run(&trip, stages, steps, from > 0);
        let resumed = summary(&trip)["run"]["resumed_at"].as_u64();
        assert_eq!(resumed, Some(from), "{stages} stages to {steps}");
    }
    let (got, want) = (checkpoint_tensors(&trip), checkpoint_tensors(&whole));
    assert!(
        got == want,
        "2 -> 3 -> 2 stages vs 2 throughout: relative error {:e}",
        relative_error(&got, &want)
    );
}
