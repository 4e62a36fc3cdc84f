//! An asynchronous flat parameter server's worker that dies is restarted alone by
//! `flotilla launch --max-restarts` and rejoins the running job: it pulls the current
//! parameters and trains on, the server takes it back and applies its pushes, and the job
//! ends normally, as accurate as an undisturbed one. So does a worker of an elastic flat
//! server (`min_world_size`), sync or model averaging, and of an elastic sync local server.

mod common;
#[path = "common/starts.rs"]
mod starts;

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::*;
use starts::numbers_after;

/// A config file of `topology` in `dir` (MLP, 32 samples per batch, plain SGD).
fn config(dir: &Path, name: &str, topology: &str, rounds: u64) -> String {
    config_file(
        dir,
        &format!("{name}.yaml"),
        &format!(
            "{topology}\nmodel: mlp\nbatch_size: 32\nnum_server_rounds: {rounds}\n\
             eval_every: 1000\noptimizer: {{name: sgd, lr: 0.05}}\ntimeout_s: 10\n"
        ),
    )
}

const FLAT_ASYNC: &str = "arch: flat\nparameter_server: {aggr_type: async, num_workers: 2}";

/// Whether start `start` (0: the first) of worker `rank` in `out` pulled and then pushed
/// 100 times (its run.log's `first pull` and `round 100` lines).
fn pushed_100_times(out: &Path, rank: usize, start: usize) -> bool {
    let log = std::fs::read_to_string(out.join(format!("rank-{rank}/run.log"))).unwrap_or_default();
    log.matches("first pull:").count() == start + 1
        && log
            .rfind("first pull:")
            .is_some_and(|at| log[at..].contains("] round 100 v"))
}

/// Waits until rank 0's run.log in `out` has reached round `round` and start `start` of
/// `rank` has pushed 100 times (so that each replacement surely had its say), then SIGKILLs
/// `rank`.
fn kill_after_round(out: &Path, round: u64, rank: usize, start: usize) {
    let log = out.join("rank-0/run.log");
    let needle = format!("] round {round} ");
    let started = Instant::now();
    loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.contains(&needle)
            && pushed_100_times(out, rank, start)
            && let Some(pid) = rank_pid(out, rank)
        {
            // SAFETY: kill(2) on a pid of this test's own job; no memory is involved.
            let rc = unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            assert_eq!(rc, 0, "kill -9 {pid}");
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "round {round} never came"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// How the job's ranks are started.
#[derive(Clone, Copy, PartialEq)]
enum Ranks {
    /// `flotilla launch CONFIG`.
    Plain,
    /// The same, with TLS and a cluster secret on every connection.
    Secure,
    /// `flotilla launch CONFIG -- examples/lenet5_program` (its own LeNet-5 module, trained
    /// by the library's run).
    Program,
}

/// Launches `yaml` with `--max-restarts 2`, SIGKILLs worker `victim` after rank 0's rounds
/// `kills`, and checks that it rejoined twice (as each of `servers` logs) and each replacement
/// contributed to each, that the job was never restarted as a whole and ended normally above
/// `min_acc` and within 0.02 of an undisturbed run, and that nothing is left.
fn killed_twice_rejoins(
    yaml: &str,
    rounds: u64,
    victim: usize,
    servers: &[usize],
    kills: [u64; 2],
    min_acc: f64,
    ranks: Ranks,
) {
    let dir = tmp();
    let cfg = config(dir.path(), "job", yaml, rounds);
    let out = dir.path().join("out");
    let program = example("lenet5_program");
    let program_args: Vec<&std::ffi::OsStr> = match ranks {
        Ranks::Program => vec!["--".as_ref(), program.as_os_str()],
        _ => Vec::new(),
    };
    let mut c = flotilla();
    if ranks == Ranks::Secure {
        // Every connection, the replacement's included, in TLS and authenticated.
        let certs = dir.path().join("certs");
        let mut make = flotilla();
        make.args(["certs", "--hosts", "127.0.0.1", "--out"])
            .arg(&certs);
        let o = run_with_deadline(make, Duration::from_secs(30));
        assert!(o.status.success(), "{}", text(&o));
        c.env("FLOTILLA_TLS_CA", certs.join("ca.pem"))
            .env("FLOTILLA_TLS_CERT", certs.join("127.0.0.1.pem"))
            .env("FLOTILLA_TLS_KEY", certs.join("127.0.0.1.key"))
            .env("FLOTILLA_SECRET", "rejoin-test-secret");
    }
    c.args(["launch", &cfg, "--max-restarts", "2", "--output"])
        .arg(&out)
        .args(&program_args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let killed = out.clone();
    let killer = std::thread::spawn(move || {
        for (start, round) in kills.into_iter().enumerate() {
            kill_after_round(&killed, round, victim, start);
        }
    });
    let o = run_with_deadline(c, Duration::from_secs(300));
    killer.join().expect("killer");
    assert!(o.status.success(), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    for k in [1, 2] {
        assert!(
            err.contains(&format!(
                "[launcher] restart {k}/2 after: rank {victim} failed (killed by signal 9); it rejoins the running job"
            )),
            "{}",
            text(&o)
        );
    }
    for &server in servers {
        let log = run_log(&out, server);
        let back = format!("rank {victim} rejoined (a replaced worker)");
        assert_eq!(log.matches(&back).count(), 2, "{log}");
    }
    // The job was never restarted as a whole: one start of rank 0, all rounds done.
    let root = run_log(&out, 0);
    assert_eq!(root.matches("rank 0/").count(), 1, "{root}");
    let f = final_fields_in(&String::from_utf8_lossy(&o.stdout));
    assert_eq!(f["steps"], rounds as f64, "{}", text(&o));
    assert!(f["test_acc"] > min_acc, "{}", text(&o));
    let needle = out.join("launch-config.yaml");
    assert_none_left(needle.to_str().expect("utf8"), Duration::from_secs(10));
    for (k, &server) in servers.iter().enumerate() {
        assert_replacements_contributed(&out, victim, server, k == 0);
    }

    let calm = dir.path().join("calm");
    let mut c = flotilla();
    c.args(["launch", &cfg, "--output"])
        .arg(&calm)
        .args(&program_args);
    let p = run_with_deadline(c, Duration::from_secs(300));
    assert!(p.status.success(), "{}", text(&p));
    let undisturbed = final_fields_in(&String::from_utf8_lossy(&p.stdout))["test_acc"];
    let acc = f["test_acc"];
    assert!(
        (acc - undisturbed).abs() <= 0.02,
        "accuracy {acc} with two rejoins, {undisturbed} undisturbed"
    );
}

/// Each replacement of `victim` contributed, by the numbers it and its server logged: the
/// server took it back at version `V` and its first pull got a version at least `V` (the
/// job's current parameters, not the initial ones of version 0); the server accepted some
/// of its pushes; and the last one, which ran to the stop, pushed exactly as many times as
/// the server accepted, plus those refused and at most one in flight at the stop. Of a
/// shard server that is not the worker's first (`first` false: the worker logs its first
/// pull's version from the first, and shards may be a round apart), what that server logged:
/// it took each back past version 0 and accepted its pushes.
fn assert_replacements_contributed(out: &Path, victim: usize, server: usize, first: bool) {
    let slog = run_log(out, server);
    let back_lines: Vec<&str> = slog
        .lines()
        .filter(|l| l.contains(&format!("rank {victim} rejoined (a replaced worker) at ")))
        .collect();
    let back = numbers_after(&back_lines.join("\n"), " version ");
    let ledger: Vec<(u64, u64)> = slog
        .lines()
        .filter_map(|l| l.split(&format!(" of rank {victim} at version ")).nth(1))
        .map(|rest| {
            let (v, n) = rest.split_once(": ").expect("version: count");
            let n = n.split_whitespace().next().expect("count");
            (v.parse().expect("version"), n.parse().expect("count"))
        })
        .collect();
    assert_eq!(back.len(), 2, "{slog}");
    assert_eq!(
        ledger.iter().map(|l| l.0).collect::<Vec<_>>(),
        back,
        "{slog}"
    );
    if !first {
        let taken = back.iter().zip(&ledger).all(|(&v, l)| v > 0 && l.1 > 0);
        return assert!(taken, "each replacement taken back and heard:\n{slog}");
    }
    let vlog = run_log(out, victim);
    let first = numbers_after(&vlog, "first pull: version ");
    assert_eq!(first.len(), 3, "three starts of rank {victim}\n{vlog}");
    for k in 0..2 {
        assert!(
            back[k] > 0 && first[k + 1] >= back[k],
            "replacement {}: first pull got version {}, the server was at version {} when it came back",
            k + 1,
            first[k + 1],
            back[k]
        );
        assert!(
            ledger[k].1 > 0,
            "no push of replacement {} accepted\n{slog}",
            k + 1
        );
    }
    let last = &vlog[vlog.rfind("first pull:").expect("first pull")..];
    let pushed = numbers_after(last, ") after ");
    let refused = last.matches("push rejected by rank").count() as u64;
    // A replacement taken back by shard servers in rounds one apart closes the round behind
    // with a push of no samples (`worker.rs::align`): the server accepts it, the worker does
    // not count it among its rounds.
    let aligned = last
        .matches(&format!(" of rank {server} closed with no samples"))
        .count() as u64;
    assert_eq!(pushed.len(), 1, "the last replacement's stop line\n{last}");
    let unaccounted = (pushed[0] + aligned) as i64 - refused as i64 - ledger[1].1 as i64;
    assert!(
        (0..=1).contains(&unaccounted),
        "the last replacement pushed {} times and {aligned} to align, {refused} were refused, \
         the server accepted {}",
        pushed[0],
        ledger[1].1
    );
}

#[test]
fn an_async_worker_killed_twice_rejoins_the_running_job() {
    killed_twice_rejoins(FLAT_ASYNC, 1500, 2, &[0], [300, 900], 0.92, Ranks::Plain);
}

/// An elastic flat job (`min_world_size: 2`): its sync server leaves the lost worker out of
/// the rounds and takes each replacement back into the round under way; with model averaging
/// (`local_steps: 4`) the same.
#[test]
fn a_worker_of_an_elastic_sync_server_killed_twice_rejoins_the_running_job() {
    let sync = "arch: flat\nworld_size: 3\nmin_world_size: 2\nparameter_server: {aggr_type: sync, num_workers: 2}";
    killed_twice_rejoins(sync, 600, 1, &[0], [150, 400], 0.9, Ranks::Plain);
    let averaging = format!("{sync}\nlocal_steps: 4");
    killed_twice_rejoins(&averaging, 600, 2, &[0], [150, 400], 0.9, Ranks::Plain);
}

/// An elastic sharded job (`servers: 2`, `min_world_size: 3`): both shard servers leave the
/// lost worker out and take each replacement back; the one that is not the root hears the
/// job's stop from the root, not from workers that leave.
#[test]
fn a_worker_of_elastic_sync_shard_servers_killed_twice_rejoins_both() {
    let sharded = "arch: flat\nworld_size: 4\nmin_world_size: 3\nservers: 2\nparameter_server: {aggr_type: sync, num_workers: 2}";
    killed_twice_rejoins(sharded, 600, 3, &[0, 1], [150, 400], 0.9, Ranks::Plain);
}

/// A program's own burn module (`examples/lenet5_program.rs` on `flotilla_burn::train`) as
/// the workers of an elastic flat sync server: a lost worker's replacement is the program
/// started again, which rejoins through the library's run.
#[test]
fn a_programs_worker_of_an_elastic_sync_server_killed_twice_rejoins() {
    let sync = "arch: flat\nworld_size: 3\nmin_world_size: 2\nparameter_server: {aggr_type: sync, num_workers: 2}";
    killed_twice_rejoins(sync, 600, 2, &[0], [150, 400], 0.9, Ranks::Program);
}

/// Under an async local server (global server 0; local server 1 with workers 2 and 3):
/// the replacement links to rank 0 for the peer table and to its local server, here with
/// TLS and a cluster secret on every connection.
#[test]
fn a_worker_under_an_async_local_server_rejoins() {
    let hier = "arch: hierarchical\nglobal_server:\n  aggr_type: sync\n  local_servers:\n    - {aggr_type: async, num_workers: 2}\n    - {aggr_type: async, num_workers: 1}";
    killed_twice_rejoins(hier, 600, 3, &[1], [150, 400], 0.9, Ranks::Secure);
}

/// An elastic hierarchical job (global server 0; sync local server 1 with workers 2 and 3,
/// local server 4 with worker 5; `min_world_size: 5`): the local server leaves the lost
/// worker out, tells the global server, and takes each replacement back.
#[test]
fn a_worker_under_an_elastic_sync_local_server_killed_twice_rejoins() {
    let hier = "arch: hierarchical\nmin_world_size: 5\nglobal_server:\n  aggr_type: sync\n  local_servers:\n    - {aggr_type: sync, num_workers: 2}\n    - {aggr_type: sync, num_workers: 1}";
    killed_twice_rejoins(hier, 600, 3, &[1], [150, 400], 0.9, Ranks::Plain);
}

/// Only a worker of an asynchronous single-server job can rejoin; asking elsewhere fails at
/// once, saying so.
#[test]
fn a_rejoin_where_it_cannot_work_is_refused_at_once() {
    let dir = tmp();
    let sync = "arch: flat\nparameter_server: {aggr_type: sync, num_workers: 2}";
    let cfg = config(dir.path(), "sync", sync, 100);
    let mut c = flotilla();
    c.args(["train", &cfg])
        .env("RANK", "1")
        .env("WORLD_SIZE", "3")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", "9")
        .env("FLOTILLA_REJOIN", "1");
    let t = Instant::now();
    let o = run_with_deadline(c, Duration::from_secs(30));
    assert!(!o.status.success());
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    assert!(
        text(&o).contains("only a worker") && text(&o).contains("FLOTILLA_REJOIN"),
        "{}",
        text(&o)
    );
}
