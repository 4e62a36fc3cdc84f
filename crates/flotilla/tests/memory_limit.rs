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
    let estimate = |zero: &'static str| {
        let out = dir.path().join(format!("probe-{zero}"));
        let (ok, _, err) = launch("1MiB", &out, &job(zero));
        assert!(!ok, "{err}");
        estimated_mib(&err)
    };
    let (whole, sharded) = (estimate("0"), estimate("2"));
    println!("estimates: ZeRO-0 {whole} MiB, ZeRO-2 {sharded} MiB a rank");
    assert!(sharded < whole, "ZeRO-2 {sharded} MiB, ZeRO-0 {whole} MiB");
    let limit = format!("{}MiB", (whole + sharded) / 2);

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
