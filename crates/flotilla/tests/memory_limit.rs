//! `flotilla launch --memory-per-rank SIZE` over real processes: each rank runs inside a
//! memory cgroup of its own with that limit (read by the rank itself from its
//! `/proc/self/cgroup`); a launch whose ranks' estimate is above it is refused before any
//! rank starts, naming the ranks and the estimate; a rank the kernel's OOM killer takes at
//! the limit is named as such, one killed by a signal otherwise is not; the cgroups are gone
//! when the launch ends.

mod common;

use std::time::{Duration, Instant};

use common::*;

/// The launcher's stderr and whether it succeeded, for `flotilla launch -n 2
/// --memory-per-rank LIMIT --output OUT` with `rest` after.
fn launch(limit: &str, out: &std::path::Path, rest: &[&str]) -> (bool, String, String) {
    let mut c = flotilla();
    c.args(["launch", "-n", "2", "--memory-per-rank", limit, "--output"])
        .arg(out)
        .args(rest);
    let o = run_with_deadline(c, Duration::from_secs(60));
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).to_string(),
        err,
    )
}

#[test]
fn a_launch_whose_ranks_need_more_than_the_limit_is_refused_before_any_starts() {
    let dir = tmp();
    let out = dir.path().join("out");
    let t = Instant::now();
    let (ok, _, err) = launch("100MiB", &out, &[]);
    assert!(!ok, "{err}");
    assert!(
        err.contains("every rank (0 to 1) is estimated to need about")
            && err.contains("above --memory-per-rank 100.0 MiB; no rank was started"),
        "{err}"
    );
    assert!(!out.join("rank-0").exists(), "a rank started");
    assert!(t.elapsed() < Duration::from_secs(20));
}

/// A shell program as the ranks: rank 0 says its memory cgroup and its limit, read from
/// inside (then sleeps); rank 1 runs `what` a second later.
fn ranks(what: &str) -> String {
    format!(
        "if [ \"$RANK\" = 1 ]; then sleep 1; {what}; fi; \
         group=$(grep ':memory:' /proc/self/cgroup | cut -d: -f3); \
         echo \"limit $(cat /sys/fs/cgroup/memory$group/memory.limit_in_bytes) in $group\"; \
         exec sleep 60"
    )
}

#[test]
fn a_rank_the_oom_killer_takes_at_its_limit_is_named_and_the_cgroups_are_removed() {
    let dir = tmp();
    // Rank 1 reads an endless line: its memory grows until the kernel stops it at 300 MiB.
    let program = ranks("exec tail /dev/zero");
    let t = Instant::now();
    let (ok, stdout, err) = launch(
        "300MiB",
        &dir.path().join("oom"),
        &["--", "sh", "-c", &program],
    );
    assert!(!ok, "{err}");
    assert!(
        err.contains(
            "rank 1 failed (killed by signal 9: the kernel's OOM killer took it at its memory \
             limit of 300.0 MiB (--memory-per-rank; cgroup /sys/fs/cgroup/memory/flotilla-"
        ),
        "{err}"
    );
    assert!(t.elapsed() < Duration::from_secs(40), "{:?}", t.elapsed());
    // Rank 0 was inside a cgroup of its own, of that limit.
    let line = (stdout.lines().find(|l| l.starts_with("[rank 0] limit ")))
        .unwrap_or_else(|| panic!("{stdout}\n{err}"));
    assert!(line.contains("limit 314572800 in /flotilla-"), "{line}");
    assert!(line.ends_with("/rank-0"), "{line}");
    let cgroup = err
        .split("cgroup ")
        .nth(1)
        .and_then(|s| s.split(':').next())
        .expect("the cgroup named");
    let job = std::path::Path::new(cgroup)
        .parent()
        .expect("the job's cgroup");
    assert!(!job.exists(), "{} is left", job.display());

    // A rank killed by a signal well under its limit: named as killed, not as out of memory.
    let program = ranks("kill -9 $$");
    let (ok, stdout, err) = launch(
        "300MiB",
        &dir.path().join("kill"),
        &["--", "sh", "-c", &program],
    );
    assert!(!ok, "{err}");
    assert!(
        err.contains("rank 1 failed (killed by signal 9); stopped all ranks"),
        "{err}"
    );
    assert!(!err.contains("OOM"), "{err}");
    let line = (stdout.lines().find(|l| l.starts_with("[rank 0] limit ")))
        .unwrap_or_else(|| panic!("{stdout}\n{err}"));
    assert!(line.contains("limit 314572800 in /flotilla-"), "{line}");
}

/// The launcher's estimate in MiB from its refusal (`... estimated to need about N MiB ...`).
fn estimated_mib(err: &str) -> u64 {
    err.split("estimated to need about ")
        .nth(1)
        .and_then(|s| s.split(" MiB").next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no estimate in: {err}"))
}

/// The model's state counts by ZeRO stage: an MLP of 23 M parameters (SGD with momentum) on
/// 2 ranks under a limit halfway between the estimates of ZeRO-0 and ZeRO-2 (each read from
/// the refusal of a 1 MiB limit): ZeRO-0 is refused before any rank starts, ZeRO-2 trains to
/// its end inside the cgroups of that limit, and each of its ranks' peak resident memory (the
/// kernel's `VmHWM`, in the run's report) is below the estimate.
#[test]
fn between_the_needs_of_zero_0_and_zero_2_zero_2_trains_and_zero_0_is_refused() {
    let dir = tmp();
    let spec = dir.path().join("wide.yaml");
    std::fs::write(
        &spec,
        "name: wide\ninput: [1, 28, 28]\nlayers:\n  - flatten\n  - linear: {out: 8192}\n  \
         - relu\n  - linear: {out: 2048}\n  - relu\n  - linear: {out: 10}\n",
    )
    .expect("the spec written");
    let spec = spec.to_string_lossy().to_string();
    let job = |zero: &'static str| {
        let mut args = vec!["--model", spec.as_str(), "--zero", zero];
        args.extend(["--max-steps", "3", "--batch-size", "16"]);
        args
    };
    let (_, sharded, limit) = limit_between(dir.path(), &job, ("0", "2"));

    let (ok, _, err) = launch(&limit, &dir.path().join("zero-0"), &job("0"));
    assert!(!ok, "{err}");
    assert!(
        err.contains("ZeRO stage 0 over 2 rank(s)") && err.contains("no rank was started"),
        "{err}"
    );
    let out = dir.path().join("zero-2");
    let (ok, stdout, err) = launch(&limit, &out, &job("2"));
    assert!(ok, "{stdout}\n{err}");
    let bytes = std::fs::read(out.join("summary.json")).expect("summary.json");
    let summary: serde_json::Value = serde_json::from_slice(&bytes).expect("JSON");
    let ranks = summary["ranks"].as_array().expect("every rank's report");
    assert_eq!(ranks.len(), 2, "{summary}");
    for r in ranks {
        let peak = r["figures"]["peak_resident_bytes"]
            .as_f64()
            .expect("measured");
        let peak_mib = peak / f64::from(1 << 20);
        println!("rank {}: peak resident {peak_mib:.0} MiB", r["rank"]);
        assert!(
            peak_mib < sharded as f64,
            "{peak_mib} MiB above the estimate"
        );
    }
}

/// The spec of a GPT of 28.8 M parameters (4 blocks of d 768, context 64) written in `dir`:
/// its path.
fn gpt_29m(dir: &std::path::Path) -> String {
    let spec = dir.join("gpt.yaml");
    let block = "  - transformer_block: {heads: 12, mlp: 4}\n";
    std::fs::write(
        &spec,
        format!(
            "name: gpt-29m\ninput: [64]\nlayers:\n  - embedding: {{vocab: 256, dim: 768}}\n  \
             - pos_embedding: {{max_len: 64}}\n{}  - layer_norm\n  - linear: {{out: 256}}\n",
            block.repeat(4)
        ),
    )
    .expect("the spec written");
    spec.to_string_lossy().to_string()
}

/// Stage 3 one stage up: a GPT of 28.8 M parameters (4 blocks of d 768) on 2 ranks
/// under a limit halfway between the estimates of ZeRO-2 and ZeRO-3: ZeRO-2 is refused before
/// any rank starts, ZeRO-3 (the parameters sharded too, each group gathered for its forward
/// and again for its recomputed forward in backward) trains, evaluates and checkpoints inside
/// the cgroups of that limit, and each rank's measured peak is below ZeRO-3's estimate.
#[test]
fn between_the_needs_of_zero_2_and_zero_3_zero_3_trains_and_zero_2_is_refused() {
    let dir = tmp();
    let spec = gpt_29m(dir.path());
    let job = |zero: &'static str| {
        let mut args = vec!["--model", spec.as_str(), "--zero", zero];
        args.extend(["--data", "text:data/text/kjv.txt", "--test-limit", "16"]);
        args.extend(["--max-steps", "2", "--batch-size", "4"]);
        args
    };
    let (_, stage_3, limit) = limit_between(dir.path(), &job, ("2", "3"));
    let (ok, _, err) = launch(&limit, &dir.path().join("zero-2"), &job("2"));
    assert!(!ok, "{err}");
    assert!(
        err.contains("ZeRO stage 2 over 2 rank(s)") && err.contains("no rank was started"),
        "{err}"
    );
    let out = dir.path().join("zero-3");
    let (ok, stdout, err) = launch(&limit, &out, &job("3"));
    assert!(ok, "{stdout}\n{err}");
    assert!(out.join("checkpoints/latest").exists(), "checkpointed");
    // ZeRO-2 on the same job without that limit, for its measured peaks.
    let whole = dir.path().join("zero-2-unlimited");
    let (ok, stdout, err) = launch("16GiB", &whole, &job("2"));
    assert!(ok, "{stdout}\n{err}");
    // Each rank's peak over the whole run (the end's evaluation and checkpoint included)
    // is below the estimate; to the end of its last step, below ZeRO-2's.
    let whole_run = peaks_mib(&out, "peak_resident_bytes");
    let steps = peaks_mib(&out, "steps_peak_resident_bytes");
    let steps_2 = peaks_mib(&whole, "steps_peak_resident_bytes");
    for rank in 0..2 {
        let (peak, at_steps, at_steps_2) = (whole_run[rank], steps[rank], steps_2[rank]);
        println!(
            "rank {rank}: peak resident {peak:.0} MiB; to the last step {at_steps:.0} MiB \
             (ZeRO-2: {at_steps_2:.0} MiB)"
        );
        assert!(peak < stage_3 as f64, "{peak} MiB above the estimate");
        // A model of 115 MB next to a runtime of about 150 MB: ZeRO-2 holds the parameters,
        // burn's gradients and their flat copy whole; ZeRO-3 a group of them.
        assert!(
            at_steps < 0.7 * at_steps_2,
            "rank {rank}: {at_steps} MiB against ZeRO-2's {at_steps_2}"
        );
    }
}

/// Below ZeRO-3's need: the same GPT of 28.8 M parameters on 2 ranks (AdamW: 115 MB of
/// optimizer state a rank) under a limit halfway between the estimates of ZeRO-3 and ZeRO-3
/// with its optimizer state offloaded to files (`--offload`): ZeRO-3 is refused before any
/// rank starts; offloaded, it trains and checkpoints inside the cgroups of that limit (which
/// the files' page cache is charged to as well), each rank's peak below the estimate, and to
/// the end of its last step at least three quarters of the state below ZeRO-3 in memory.
#[test]
fn between_the_needs_of_zero_3_and_zero_3_offloaded_only_the_offloaded_trains() {
    let dir = tmp();
    let spec = gpt_29m(dir.path());
    let config = dir.path().join("adamw.yaml");
    std::fs::write(&config, "optimizer: {name: adamw, lr: 0.0003}\n").expect("config");
    let config = config.to_string_lossy().to_string();
    let files = dir
        .path()
        .join("optimizer-files")
        .to_string_lossy()
        .to_string();
    let job = |label: &'static str| {
        let mut args = vec![config.as_str(), "--model", spec.as_str(), "--zero", "3"];
        args.extend(["--data", "text:data/text/kjv.txt", "--test-limit", "16"]);
        args.extend(["--max-steps", "2", "--batch-size", "4"]);
        if label == "3-offloaded" {
            args.extend(["--offload", files.as_str()]);
        }
        args
    };
    let (_, offloaded, limit) = limit_between(dir.path(), &job, ("3", "3-offloaded"));
    let (ok, _, err) = launch(&limit, &dir.path().join("in-memory"), &job("3"));
    assert!(!ok, "{err}");
    assert!(err.contains("no rank was started"), "{err}");
    let out = dir.path().join("offloaded");
    let (ok, stdout, err) = launch(&limit, &out, &job("3-offloaded"));
    assert!(ok, "{stdout}\n{err}");
    assert!(out.join("checkpoints/latest").exists(), "checkpointed");
    let memory = dir.path().join("in-memory-unlimited");
    let (ok, stdout, err) = launch("16GiB", &memory, &job("3"));
    assert!(ok, "{stdout}\n{err}");
    let whole_run = peaks_mib(&out, "peak_resident_bytes");
    let steps = peaks_mib(&out, "steps_peak_resident_bytes");
    let steps_in_memory = peaks_mib(&memory, "steps_peak_resident_bytes");
    // AdamW's two moments of half the parameters.
    let state_mib = 28_800_000.0 * 8.0 / 2.0 / f64::from(1 << 20);
    for rank in 0..2 {
        let (peak, at_steps, in_memory) = (whole_run[rank], steps[rank], steps_in_memory[rank]);
        println!(
            "rank {rank}: peak resident {peak:.0} MiB; to the last step {at_steps:.0} MiB \
             (in memory: {in_memory:.0} MiB)"
        );
        assert!(peak < offloaded as f64, "{peak} MiB above the estimate");
        assert!(
            at_steps < in_memory - 0.75 * state_mib,
            "rank {rank}: {at_steps} MiB against {in_memory} in memory"
        );
    }
}

/// The estimates in MiB of the job `job(stage)` at two ZeRO stages, `more` needing more than
/// `less` (each read from the refusal of a 1 MiB limit), and the limit halfway between.
fn limit_between<'a>(
    dir: &std::path::Path,
    job: &dyn Fn(&'static str) -> Vec<&'a str>,
    (more, less): (&'static str, &'static str),
) -> (u64, u64, String) {
    let estimate = |zero: &'static str| {
        let out = dir.join(format!("probe-{zero}"));
        let (ok, _, err) = launch("1MiB", &out, &job(zero));
        assert!(!ok, "{err}");
        estimated_mib(&err)
    };
    let (high, low) = (estimate(more), estimate(less));
    println!("estimates: ZeRO-{more} {high} MiB, ZeRO-{less} {low} MiB a rank");
    assert!(low < high, "ZeRO-{less} {low} MiB, ZeRO-{more} {high} MiB");
    (high, low, format!("{}MiB", (high + low) / 2))
}

/// Each rank's figure `name` in MiB from the run's report (`peak_resident_bytes`: the
/// kernel's `VmHWM` at the end; `steps_peak_resident_bytes`: at the end of the last step).
fn peaks_mib(out: &std::path::Path, name: &str) -> Vec<f64> {
    let bytes = std::fs::read(out.join("summary.json")).expect("summary.json");
    let summary: serde_json::Value = serde_json::from_slice(&bytes).expect("JSON");
    let ranks = summary["ranks"].as_array().expect("every rank's report");
    assert_eq!(ranks.len(), 2, "{summary}");
    ranks
        .iter()
        .map(|r| {
            let peak = r["figures"][name].as_f64();
            peak.expect("measured") / f64::from(1 << 20)
        })
        .collect()
}
