//! A small GPT on the vendored `data/text/kjv.txt` beyond sync all-reduce (issue 21 §4): a
//! 2-stage pipeline cut between its transformer blocks trains what one process trains on the
//! same batches, and a pipeline, an async all-reduce and a flat sync parameter server each
//! killed mid-run and resumed from its checkpoint end with the uninterrupted run's
//! parameters, bit for bit, dropout masks included; under ZeRO-3 (parameters sharded, each
//! block gathered for its forward and again for its recomputed forward in backward) it trains
//! what ZeRO-0 trains, bit for bit, and resumes so; recomputing each block in backward
//! (`recompute: true`) it trains what it trains without, bit for bit, with dropout too (the
//! recomputed forward draws the same masks). Real `flotilla` processes over 127.0.0.1.

mod common;

use common::*;

use std::path::Path;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(240);

/// Two blocks of width 32 over windows of 32 bytes: layers 0 token embedding, 1 positional
/// embedding, 2 and 3 the blocks, 4 the norm, 5 the head.
const SPEC: &str = "name: gpt-tiny\ninput: [32]\nlayers:\n  - embedding: {vocab: 256, dim: 32}\n  \
     - pos_embedding: {max_len: 32}\n  - transformer_block: {heads: 2, mlp: 2}\n  \
     - transformer_block: {heads: 2, mlp: 2}\n  - layer_norm\n  - linear: {out: 256}\n";

/// The same with dropout after each block (layers 3 and 5), so that a resume must draw the
/// masks the uninterrupted run drew: the blocks are layers 2 and 4.
const SPEC_DROPOUT: &str = "name: gpt-tiny-dropout\ninput: [32]\nlayers:\n  \
     - embedding: {vocab: 256, dim: 32}\n  - pos_embedding: {max_len: 32}\n  \
     - transformer_block: {heads: 2, mlp: 2}\n  - dropout: {p: 0.1}\n  \
     - transformer_block: {heads: 2, mlp: 2}\n  - dropout: {p: 0.1}\n  - layer_norm\n  \
     - linear: {out: 256}\n";

/// 4 micro-batches scheduled 1F1B (the cut is each test's).
const PIPELINE: &str = "strategy: pipeline\nmicro_batches: 4\nschedule: 1f1b\n";

/// 40 steps (rounds) of 16 windows per rank (per worker, per replica) of the model `spec`
/// with AdamW, through the warm-up into the cosine decay, a checkpoint every 10; `mode` sets
/// the strategy.
fn config(dir: &Path, name: &str, spec: &str, mode: &str) -> String {
    let model = config_file(dir, &format!("{name}-model.yaml"), spec);
    config_file(
        dir,
        &format!("{name}.yaml"),
        &format!(
            "model: {model}\ndata: text:data/text/kjv.txt\nbatch_size: 16\n\
             optimizer: {{name: adamw, lr: 0.003, beta1: 0.9, beta2: 0.99, weight_decay: 0.1}}\n\
             lr_schedule: cosine\nwarmup_steps: 15\nmin_lr_ratio: 0.1\nseed: 5\n\
             checkpoint_every: 10\n{mode}"
        ),
    )
}

/// Peers and stages count steps and evaluate every 20; a parameter server counts rounds.
fn steps(n: u32) -> String {
    format!("max_steps: {n}\neval_every_steps: 20\n")
}

fn run(cfg: &str, out: &Path, extra: &[&str], fault: Option<&str>) -> std::process::Output {
    let mut c = flotilla();
    c.args(["launch", cfg, "--output", out.to_str().expect("utf8")])
        .args(extra);
    if let Some(f) = fault {
        c.env("FLOTILLA_FAULT", f);
    }
    run_with_deadline(c, LIMIT)
}

/// Runs `cfg` straight, then crashed by `fault` (a rank's exit at step 25, after the
/// checkpoint of step 20) and resumed: the resumed run goes on from step 20 to 40, reports
/// the validation loss in nats and bits per byte, and ends with the uninterrupted run's
/// parameters bitwise.
fn crash_and_resume(name: &str, cfg: &str, dir: &Path, fault: &str) {
    let straight = dir.join(format!("{name}-straight"));
    let o = run(cfg, &straight, &[], None);
    assert!(o.status.success(), "{name}: {}", text(&o));
    let line = final_fields(&o);
    assert_eq!(line["steps"], 40.0, "{name}");
    let crashed = dir.join(format!("{name}-crashed"));
    let o = run(cfg, &crashed, &[], Some(fault));
    assert!(
        !o.status.success(),
        "{name}: the crash must fail the job\n{}",
        text(&o)
    );
    let ck = crashed.join("checkpoints");
    let latest = std::fs::read_to_string(ck.join("latest")).expect("latest");
    assert_eq!(latest.trim(), "step-00000020", "{name}");
    let o = run(cfg, &crashed, &["--resume"], None);
    assert!(o.status.success(), "{name}: resume failed\n{}", text(&o));
    let resumed_line = final_fields(&o);
    assert_eq!(resumed_line["steps"], 40.0, "{name}");
    let log = run_log(&crashed, 0);
    assert!(
        log.contains("(step 20)"),
        "{name}: resumed from step 20\n{log}"
    );
    let (a, b) = (checkpoint_tensors(&crashed), checkpoint_tensors(&straight));
    assert_bitwise(&format!("{name}: resumed vs uninterrupted"), &a, &b);
    // Trained after the resume: step 20's parameters are not the final ones.
    let at_20 = safetensors_file(&ck.join("step-00000020/model.safetensors"));
    assert!(
        relative_error(&at_20, &a) > 1e-3,
        "{name}: nothing trained after the resume"
    );
    // The final line gives the validation loss in nats and bits per byte, the same as the
    // uninterrupted run's, and below the untrained model's ln 256 = 5.55 nats.
    assert_eq!(resumed_line["val_loss"], line["val_loss"], "{name}");
    let (loss, bpb) = (line["val_loss"], line["bpb"]);
    assert!(
        (bpb - loss / std::f64::consts::LN_2).abs() < 1e-3,
        "{name}: {line:?}"
    );
    assert!(loss < 4.0, "{name}: validation loss {loss} after 40 steps");
}

#[test]
fn a_gpt_pipeline_cut_between_blocks_trains_what_one_process_trains() {
    let dir = tmp();
    let d = dir.path();
    let (single, piped) = (d.join("single"), d.join("piped"));
    let cfg = config(d, "single", SPEC, &format!("world_size: 1\n{}", steps(40)));
    launch(&[&cfg, "--output", single.to_str().expect("utf8")], LIMIT);
    let mode = format!("{PIPELINE}split_points: [3]\n{}", steps(40));
    let cfg = config(d, "piped", SPEC, &mode);
    let o = launch(&[&cfg, "--output", piped.to_str().expect("utf8")], LIMIT);
    assert_eq!(final_fields(&o)["steps"], 40.0);
    let e = relative_error(&checkpoint_tensors(&piped), &checkpoint_tensors(&single));
    assert!(
        e <= 1e-5,
        "2-stage 1F1B GPT pipeline vs 1 process: relative error {e}"
    );
    let log = run_log(&piped, 0);
    assert!(
        log.contains("layers 0-2 | 3-5"),
        "cut between the blocks:\n{log}"
    );
}

#[test]
fn a_gpt_pipeline_with_dropout_resumes_bitwise() {
    let dir = tmp();
    let mode = format!("{PIPELINE}split_points: [4]\n{}", steps(40));
    let cfg = config(dir.path(), "piped", SPEC_DROPOUT, &mode);
    crash_and_resume("pipeline", &cfg, dir.path(), "rank=1,step=25,action=exit");
}

#[test]
fn a_gpt_with_dropout_under_async_allreduce_resumes_bitwise() {
    let dir = tmp();
    let mode = format!("world_size: 2\nstrategy: async_allreduce\n{}", steps(40));
    let cfg = config(dir.path(), "async", SPEC_DROPOUT, &mode);
    crash_and_resume("async", &cfg, dir.path(), "rank=1,step=25,action=exit");
}

#[test]
fn a_gpt_with_dropout_under_a_flat_sync_parameter_server_resumes_bitwise() {
    let dir = tmp();
    let mode = "arch: flat\nparameter_server: {aggr_type: sync, num_workers: 2}\n\
                num_server_rounds: 40\neval_every: 20\n";
    let cfg = config(dir.path(), "ps", SPEC_DROPOUT, mode);
    crash_and_resume("ps-flat", &cfg, dir.path(), "rank=2,step=25,action=exit");
}

/// ZeRO stage 3 over 2 ranks, each transformer block a group of its own (20 KiB buckets), every
/// bucket summed in the ring's order (as stage 3's reduce-scatter sums it).
const ZERO_3: &str = "world_size: 2\nzero: 3\nbucket_mb: 0.02\nsmall_all_reduce_kb: 0\n\
                      mid_all_reduce_kb: 0\n";

#[test]
fn a_gpt_under_zero_3_trains_what_zero_0_trains_bitwise_and_resumes_so() {
    let dir = tmp();
    let d = dir.path();
    let zero_0 = ZERO_3.replace("zero: 3", "zero: 0");
    let cfg = config(d, "zero-0", SPEC, &format!("{zero_0}{}", steps(40)));
    let whole = d.join("zero-0");
    launch(&[&cfg, "--output", whole.to_str().expect("utf8")], LIMIT);
    let cfg = config(d, "zero-3", SPEC, &format!("{ZERO_3}{}", steps(40)));
    crash_and_resume("zero-3", &cfg, d, "rank=1,step=25,action=exit");
    let sharded = d.join("zero-3-straight");
    assert_bitwise(
        "ZeRO-3 vs ZeRO-0",
        &checkpoint_tensors(&sharded),
        &checkpoint_tensors(&whole),
    );
    let log = run_log(&sharded, 0);
    assert!(log.contains("ZeRO stage 3"), "{log}");
    // The sharded evaluation and the parameters' hash are the whole model's.
    let after = |log: &str, key: &str| {
        log.lines()
            .find_map(|l| l.split(key).nth(1).map(str::to_string))
            .unwrap_or_default()
    };
    let log_0 = run_log(&whole, 0);
    assert_eq!(after(&log, "(xxh3 "), after(&log_0, "(xxh3 "), "{log}");
    assert_eq!(
        after(&log, "final eval "),
        after(&log_0, "final eval "),
        "{log}"
    );
}

/// Rank `pid`'s all-gathers that started within a training step: how many started while its
/// engine computed (outside every `gather_params` span, in which the engine waits for a
/// gather) and how many while it waited.
fn gathers_ahead_and_waited(events: &[serde_json::Value], pid: u64) -> (usize, usize) {
    let all = spans(events, pid);
    let of = |name: &'static str| all.iter().filter(move |s| s.name == name);
    let within = |t: f64, s: &Span<'_>| s.start <= t && t <= s.end;
    let in_steps = of("all_gather").filter(|g| of("step").any(|s| within(g.start, s)));
    let (waited, ahead): (Vec<_>, Vec<_>) =
        in_steps.partition(|g| of("gather_params").any(|w| within(g.start, w)));
    (ahead.len(), waited.len())
}

/// ZeRO-3 with each group's all-gather prefetched (the default) and without
/// (`prefetch: false`): the same parameters, bit for bit. On the timeline of the run without,
/// every all-gather of a step starts while the engine waits for it; with it, many start
/// while the engine still computes the group before (FSDP's prefetch). How many depends on
/// the load: a prefetch that the comm thread reaches only after the engine caught up starts
/// inside the engine's wait (on 2 idle cores about 4 of 5 start early; the CI that runs
/// two tests at once on 2 cores saw 2 of 3), so the bound is at least 3 of a step's 11.
#[test]
fn a_gpt_under_zero_3_gathers_the_next_block_while_one_computes_bitwise_as_without() {
    let dir = tmp();
    let d = dir.path();
    let run = |name: &str, extra: &str| {
        let cfg = config(d, name, SPEC, &format!("{ZERO_3}{extra}{}", steps(20)));
        let out = d.join(name);
        let (o, events) = launch_traced(&cfg, &out, LIMIT);
        assert!(o.status.success(), "{name}: {}", text(&o));
        (checkpoint_tensors(&out), events)
    };
    let (ahead, ahead_events) = run("prefetch", "");
    let (waited, waited_events) = run("no-prefetch", "prefetch: false\n");
    assert_bitwise("ZeRO-3 prefetching vs not", &ahead, &waited);
    for pid in 0..2 {
        let (early, late) = gathers_ahead_and_waited(&waited_events, pid);
        assert!(
            early == 0 && late >= 20 * 3,
            "rank {pid} without prefetch: {early} early, {late} waited for"
        );
        let (early, late) = gathers_ahead_and_waited(&ahead_events, pid);
        println!("rank {pid} prefetching: {early} all-gathers started early, {late} waited for");
        assert!(
            early >= 20 * 3,
            "rank {pid} prefetching: {early} early, {late} waited for"
        );
    }
}

#[test]
fn a_gpt_recomputing_its_blocks_or_offloading_its_optimizer_trains_what_it_trains_without_bitwise()
{
    let dir = tmp();
    let d = dir.path();
    let zero_0 = ZERO_3.replace("zero: 3", "zero: 0");
    let cfg = config(d, "plain", SPEC, &format!("{zero_0}{}", steps(20)));
    let out = |name: &str| d.join(name).to_str().expect("utf8").to_string();
    launch(&[&cfg, "--output", &out("plain")], LIMIT);
    let recomputing = config(
        d,
        "recomputed",
        SPEC,
        &format!("{zero_0}recompute: true\n{}", steps(20)),
    );
    launch(&[&recomputing, "--output", &out("recomputed")], LIMIT);
    // The flag, under ZeRO-2 (its gradients reduce-scattered as each block's backward ends).
    launch(
        &[
            &cfg,
            "--recompute",
            "--zero",
            "2",
            "--output",
            &out("zero-2"),
        ],
        LIMIT,
    );
    // ZeRO-3 with each rank's optimizer state in files (the flag), streamed through the step.
    let offload = d.join("offload");
    launch(
        &[
            &cfg,
            "--zero",
            "3",
            "--offload",
            offload.to_str().expect("utf8"),
            "--output",
            &out("offloaded"),
        ],
        LIMIT,
    );
    let left: Vec<_> = std::fs::read_dir(&offload).expect("offload dir").collect();
    assert!(
        left.is_empty(),
        "the ranks' state files left behind: {left:?}"
    );
    let plain = checkpoint_tensors(&d.join("plain"));
    for name in ["recomputed", "zero-2", "offloaded"] {
        assert_bitwise(
            &format!("{name} vs plain"),
            &checkpoint_tensors(&d.join(name)),
            &plain,
        );
    }
}

/// With dropout after each block, the recomputed forward (`recompute: true`, and ZeRO-3's
/// sharded backward) draws the masks the first forward drew: the bits of the run without it;
/// so does ZeRO-3 keeping each block from its forward to its backward (nothing recomputed).
#[test]
fn a_gpt_with_dropout_recomputed_or_under_zero_3_trains_its_zero_0_bits() {
    let dir = tmp();
    let d = dir.path();
    let zero_0 = ZERO_3.replace("zero: 3", "zero: 0");
    let out = |name: &str| d.join(name).to_str().expect("utf8").to_string();
    let plain = config(d, "plain", SPEC_DROPOUT, &format!("{zero_0}{}", steps(20)));
    launch(&[&plain, "--output", &out("plain")], LIMIT);
    launch(
        &[&plain, "--recompute", "--output", &out("recomputed")],
        LIMIT,
    );
    let zero_3 = config(d, "zero-3", SPEC_DROPOUT, &format!("{ZERO_3}{}", steps(20)));
    launch(&[&zero_3, "--output", &out("zero-3")], LIMIT);
    // Each block's gathered parameters and activations kept from its forward to its
    // backward (FSDP's `reshard_after_forward=False`): the masks drawn once.
    let kept = format!("{ZERO_3}reshard_after_forward: false\n{}", steps(20));
    let kept = config(d, "zero-3-kept", SPEC_DROPOUT, &kept);
    launch(&[&kept, "--output", &out("zero-3-kept")], LIMIT);
    let log = run_log(&d.join("zero-3-kept"), 0);
    assert!(
        log.contains("kept gathered from its forward to its backward"),
        "{log}"
    );
    let plain = checkpoint_tensors(&d.join("plain"));
    let other_seed = config(
        d,
        "more-dropout",
        &SPEC_DROPOUT.replace("p: 0.1", "p: 0.2"),
        &format!("{zero_0}{}", steps(20)),
    );
    launch(&[&other_seed, "--output", &out("other")], LIMIT);
    let other = checkpoint_tensors(&d.join("other"));
    assert!(
        relative_error(&other, &plain) > 0.0,
        "dropout changes the run"
    );
    for name in ["recomputed", "zero-3", "zero-3-kept"] {
        assert_bitwise(
            &format!("{name} vs plain, with dropout"),
            &checkpoint_tensors(&d.join(name)),
            &plain,
        );
    }
}

/// The resident memory (MiB) rank `rank` of `out` reported at its evaluation after `step`
/// (`rss=` of its run.log line: the kernel's `VmRSS`).
fn rss_after(out: &Path, rank: usize, step: u64) -> f64 {
    let log = run_log(out, rank);
    let line = log
        .lines()
        .find(|l| {
            // An evaluation within the epoch, or the last step's line.
            l.contains(&format!("] eval step {step} ")) || l.contains(&format!(" step={step} "))
        })
        .unwrap_or_else(|| panic!("rank {rank}: no line of step {step}\n{log}"));
    let rss = line
        .split(" rss=")
        .nth(1)
        .and_then(|r| r.strip_suffix("MiB"));
    rss.and_then(|r| r.parse().ok())
        .unwrap_or_else(|| panic!("rank {rank}: no rss in {line}"))
}

/// After its warm-up, a run holds what it held: a ZeRO-3 GPT's resident memory after step 300
/// is within 5 % of after step 50 on every rank (the kernel's `VmRSS`, which each evaluation
/// line reports). The allocator's own growth after every path ran once is up to 1.6 % of this
/// 55 MiB process; a leak of 16 KiB a step (a tiny group's buffer) is 8 % and fails. (The
/// issue asks 2 % from step 10 to 100 of the 57 M-parameter GPT: 10 MiB there.)
#[test]
fn a_gpt_under_zero_3_holds_no_more_memory_after_step_300_than_after_step_50() {
    let dir = tmp();
    let d = dir.path();
    let mode = format!("{ZERO_3}max_steps: 300\neval_every_steps: 50\n");
    let cfg = config(d, "leak", SPEC, &mode);
    let out = d.join("leak");
    launch(&[&cfg, "--output", out.to_str().expect("utf8")], LIMIT);
    for rank in 0..2 {
        let (early, late) = (rss_after(&out, rank, 50), rss_after(&out, rank, 300));
        println!("rank {rank}: {early:.1} MiB resident after step 50, {late:.1} after step 300");
        assert!(
            late <= early * 1.05,
            "rank {rank}: {early:.1} MiB after step 50, {late:.1} after step 300 (more than 5 %)"
        );
    }
}

/// [`SPEC`] with its head tied to its token embedding (`tie_embedding: true`: GPT-2's
/// `lm_head.weight = wte.weight`): the head has a bias and no weight of its own.
const SPEC_TIED: &str = "name: gpt-tiny-tied\ninput: [32]\nlayers:\n  \
     - embedding: {vocab: 256, dim: 32}\n  - pos_embedding: {max_len: 32}\n  \
     - transformer_block: {heads: 2, mlp: 2}\n  - transformer_block: {heads: 2, mlp: 2}\n  \
     - layer_norm\n  - linear: {out: 256, tie_embedding: true}\n";

/// A GPT whose head is tied to its token embedding trains on 2 ranks with its backward in
/// groups (the table's gradient summed over the head's group and the embedding's, handed on
/// with the embedding's) to the bits of one backward pass, and so it does recomputing its
/// groups, under ZeRO-1 and ZeRO-2, and under ZeRO-3 (the table kept from the first group's
/// gather for the head's group), resharding or kept; its checkpoint holds the one table and
/// no head weight; it learns; a pipeline, whose stages would part the table from the head, is
/// refused before any rank starts, by name.
#[test]
fn a_gpt_with_its_head_tied_to_its_embedding_trains_one_passs_bits_in_every_data_parallel_way() {
    let dir = tmp();
    let d = dir.path();
    let ring = "world_size: 2\nsmall_all_reduce_kb: 0\nmid_all_reduce_kb: 0\n";
    let runs = [
        ("one-pass", "bucket_mb: 1000\n"),
        ("grouped", "bucket_mb: 0.02\n"),
        ("zero-1", "bucket_mb: 0.02\nzero: 1\n"),
        ("zero-2", "bucket_mb: 0.02\nzero: 2\n"),
        ("recomputed", "bucket_mb: 0.02\nrecompute: true\n"),
        ("zero-3", "bucket_mb: 0.02\nzero: 3\n"),
        (
            "zero-3-kept",
            "bucket_mb: 0.02\nzero: 3\nreshard_after_forward: false\n",
        ),
    ];
    let mut tensors = Vec::new();
    for (name, mode) in runs {
        let cfg = config(d, name, SPEC_TIED, &format!("{ring}{mode}{}", steps(40)));
        let out = d.join(name);
        let o = launch(&[&cfg, "--output", out.to_str().expect("utf8")], LIMIT);
        assert!(o.status.success(), "{name}: {}", text(&o));
        let log = run_log(&out, 0);
        let buckets: usize = log
            .split(" buckets")
            .next()
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{name}: no bucket count\n{log}"));
        assert_eq!(buckets > 1, name != "one-pass", "{name}: {buckets} buckets");
        tensors.push((name, checkpoint_tensors(&out)));
    }
    let (_, one) = &tensors[0];
    assert!(one.contains_key("layers.0.weight") && one.contains_key("layers.5.bias"));
    assert!(!one.contains_key("layers.5.weight"), "{:?}", one.keys());
    for (name, t) in &tensors[1..] {
        assert_bitwise(&format!("tied: {name} vs one pass"), t, one);
    }
    let initial = d.join("initial");
    let cfg = config(d, "initial", SPEC_TIED, &format!("{ring}{}", steps(0)));
    launch(&[&cfg, "--output", initial.to_str().expect("utf8")], LIMIT);
    let moved = relative_error(&checkpoint_tensors(&initial), one);
    assert!(moved > 1e-2, "the parameters barely moved ({moved})");
    let pipeline = format!("{PIPELINE}split_points: [3]\n{}", steps(40));
    let cfg = config(d, "pipeline", SPEC_TIED, &pipeline);
    let o = run(&cfg, &d.join("pipeline"), &[], None);
    let said = text(&o);
    assert!(
        !o.status.success(),
        "a pipeline trained a tied model: {said}"
    );
    assert!(
        said.contains("topology.arch") && said.contains("tie_embedding"),
        "{said}"
    );
}
