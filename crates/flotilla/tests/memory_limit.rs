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
