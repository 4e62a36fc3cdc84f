//! Fault injection (issue 10) over real processes on 127.0.0.1: SIGKILL and SIGSTOP of a
//! rank (a peer, rank 0, a parameter server — root and local — a worker, a pipeline stage) in
//! every strategy, at a random moment of training; strangers at every listening port; a peer
//! with the wrong secret or another config. Each scenario must end within its deadline with
//! the documented outcome and leave no process behind. The scenarios run one after the other
//! in one test, which prints the table of BENCHMARKS.md §13 (also written to
//! `$CARGO_TARGET_TMPDIR/faults-table.md`). `FLOTILLA_FAULT_SEED=N` replays a run's delays.
//!
//! `cargo test --release -p flotilla --test faults -- --nocapture`

mod common;
#[path = "common/procfs.rs"]
mod procfs;
#[path = "common/running.rs"]
mod running;
#[path = "common/stranger.rs"]
mod stranger;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use running::Running;
use stranger::{SplitMix, Stranger};

/// Every wait on another rank (`comm.timeout_s`).
const TIMEOUT_S: f64 = 5.0;
/// What the launcher may add to `TIMEOUT_S` before it names the culprit: its grace period
/// for the other ranks' reports (1.5 s), and slack for a loaded 2-core machine.
const NAMING_SLACK_S: f64 = 4.5;
/// The bound on a scenario after its fault: past this the job is hung (and killed).
const HANG_S: f64 = 3.0 * TIMEOUT_S + 15.0;

/// Settings shared by every job: the MLP on 8000 samples, short deadlines.
const COMMON: &str = "model: mlp
data: data/mnist
train_limit: 8000
batch_size: 32
optimizer: {name: sgd, lr: 0.05, momentum: 0.5}
warmup_steps: 0
eval_every: 0
seed: 42
comm: {timeout_s: 5, join_timeout_s: 20}
";

/// A strategy and the ranks the suite hits in it.
struct Mode {
    name: &'static str,
    /// Config keys after [`COMMON`].
    yaml: &'static str,
    world: usize,
    /// Ranks to hit, with what they are.
    targets: &'static [(usize, &'static str)],
    /// Ranks whose loss the job absorbs (under an async server): it trains on.
    tolerated: &'static [usize],
    /// Every rank prints a line containing this once it starts its role (the launcher
    /// prefixes it with `[rank ...]`).
    marker: &'static str,
}

const MODES: &[Mode] = &[
    Mode {
        name: "sync all-reduce",
        yaml: "world_size: 3\nepochs: 1000\nmax_steps: 100000\n",
        world: 3,
        targets: &[(0, "peer"), (2, "peer")],
        tolerated: &[],
        marker: "] training: ",
    },
    Mode {
        name: "async all-reduce",
        yaml: "world_size: 3\nstrategy: async_allreduce\nepochs: 1000\nmax_steps: 100000\n",
        world: 3,
        targets: &[(0, "peer"), (2, "peer")],
        tolerated: &[],
        marker: "] training: ",
    },
    Mode {
        name: "pipeline, 2 stages",
        yaml: "strategy: pipeline\nstages: 2\nmicro_batches: 2\nepochs: 1000\nmax_steps: 100000\n",
        world: 2,
        targets: &[(0, "stage 0"), (1, "stage 1")],
        tolerated: &[],
        marker: "] training: ",
    },
    Mode {
        name: "PS flat sync",
        yaml: "arch: flat\nparameter_server: {aggr_type: sync, num_workers: 2}\nnum_server_rounds: 100000\n",
        world: 3,
        targets: &[(0, "root server"), (2, "worker")],
        tolerated: &[],
        marker: "] role ",
    },
    Mode {
        name: "PS sharded sync (2 servers)",
        yaml: "arch: flat\nservers: 2\nparameter_server: {aggr_type: sync, num_workers: 2}\nnum_server_rounds: 100000\n",
        world: 4,
        targets: &[(1, "shard server"), (3, "worker")],
        tolerated: &[],
        marker: "] role ",
    },
    Mode {
        name: "PS flat async",
        yaml: "arch: flat\nparameter_server: {aggr_type: async, num_workers: 2}\nnum_server_rounds: 600\n",
        world: 3,
        targets: &[(0, "root server"), (2, "worker")],
        tolerated: &[1, 2],
        marker: "] role ",
    },
    Mode {
        name: "PS hierarchical sync",
        yaml: "arch: hierarchical\nnum_server_rounds: 100000\nglobal_server:\n  aggr_type: sync\n  local_servers:\n    - {aggr_type: sync, num_workers: 1}\n    - {aggr_type: sync, num_workers: 1}\n",
        world: 5,
        targets: &[(0, "global server"), (1, "local server"), (4, "worker")],
        tolerated: &[],
        marker: "] role ",
    },
    Mode {
        name: "PS hierarchical async",
        yaml: "arch: hierarchical\nnum_server_rounds: 300\nglobal_server:\n  aggr_type: async\n  local_servers:\n    - {aggr_type: async, num_workers: 1}\n    - {aggr_type: async, num_workers: 1}\n",
        world: 5,
        targets: &[(0, "global server"), (1, "local server"), (4, "worker")],
        tolerated: &[1, 2, 3, 4],
        marker: "] role ",
    },
];

/// One row of the table, and whether it is what the documentation says.
struct Row {
    fault: String,
    mode: String,
    target: String,
    detected_s: Option<f64>,
    outcome: String,
    /// `None`: as documented; `Some(why)`: not.
    problem: Option<String>,
}

/// A signal the suite sends.
#[derive(Clone, Copy)]
struct Signal {
    number: i32,
    name: &'static str,
}

const SIGNALS: [Signal; 2] = [
    Signal {
        number: libc::SIGKILL,
        name: "kill -9",
    },
    Signal {
        number: libc::SIGSTOP,
        name: "SIGSTOP",
    },
];

#[test]
fn every_fault_ends_within_its_deadline_as_documented_and_leaves_no_process() {
    let seed = std::env::var("FLOTILLA_FAULT_SEED")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    println!("fault injection: seed {seed} (replay with FLOTILLA_FAULT_SEED={seed})");
    let mut rng = SplitMix(seed);
    let dir = tmp();
    let started = Instant::now();
    let only = std::env::var("FLOTILLA_FAULT_ONLY").unwrap_or_default();
    let mut rows = Vec::new();
    for mode in MODES {
        for signal in SIGNALS {
            for &(rank, what) in mode.targets {
                let delay = rng.uniform(0.2, 1.7);
                if !format!("{} {}", signal.name, mode.name).contains(&only) {
                    continue;
                }
                let row = signal_scenario(mode, (rank, what), signal, delay, dir.path());
                println!("{}", row_line(&row));
                rows.push(row);
            }
        }
    }
    if only.is_empty() || only == "strangers" {
        rows.extend(stranger_rows(&mut rng, dir.path()));
    }
    if only.is_empty() || only == "intruders" {
        rows.extend(intruder_rows(dir.path()));
    }
    let wall = started.elapsed().as_secs_f64();
    let table = table(&rows, seed, wall);
    println!("\n{table}");
    let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join("faults-table.md");
    std::fs::write(&path, &table).expect("write the table");
    println!("(written to {})", path.display());
    let problems: Vec<String> = rows
        .iter()
        .filter_map(|r| {
            let why = r.problem.as_ref()?;
            Some(format!("{} / {} / {}: {why}", r.fault, r.mode, r.target))
        })
        .collect();
    assert!(
        problems.is_empty(),
        "{} scenario(s) not as documented (seed {seed}):\n\n{}",
        problems.len(),
        problems.join("\n\n")
    );
}

/// A job of `mode` under `flotilla launch`; `signal` hits `rank` at a random moment of
/// training (0.2–1.7 s after every rank started its role).
fn signal_scenario(
    mode: &Mode,
    (rank, what): (usize, &str),
    signal: Signal,
    delay: f64,
    dir: &Path,
) -> Row {
    let slug = format!("{}-{}-{rank}", slug(mode.name), signal.number);
    let cfg = config_file(
        dir,
        &format!("{slug}.yaml"),
        &format!("{COMMON}{}", mode.yaml),
    );
    let out = dir.join(&slug);
    let mut row = Row {
        fault: format!("{} at +{delay:.2} s", signal.name),
        mode: mode.name.to_string(),
        target: format!("rank {rank} ({what})"),
        detected_s: None,
        outcome: String::new(),
        problem: None,
    };
    let mut c = flotilla();
    c.args(["launch", &cfg, "--output", out.to_str().expect("utf8")]);
    let mut launcher = Running::start(c);
    let mut pids = vec![launcher.pid()];
    match hit(&mut launcher, mode, rank, signal, delay) {
        Err(why) => fail(&mut row, why, &launcher.text()),
        Ok((ranks, t0)) => {
            pids.extend(ranks.values());
            judge(&mut row, &mut launcher, mode, rank, signal, t0);
        }
    }
    drop(launcher);
    check_nothing_left(&mut row, &pids, &out);
    row
}

/// Waits for the job to train, finds the rank's process and signals it after `delay`;
/// returns the ranks' pids and the instant of the signal.
fn hit(
    launcher: &mut Running,
    mode: &Mode,
    rank: usize,
    signal: Signal,
    delay: f64,
) -> Result<(BTreeMap<usize, u32>, Instant), String> {
    let marker = mode.marker;
    launcher
        .wait_lines(mode.world, Duration::from_secs(90), |l| l.contains(marker))
        .ok_or("the job never started training")?;
    let ranks = procfs::rank_pids(launcher.pid(), mode.world, Duration::from_secs(5))
        .ok_or("the launcher's rank processes were not found")?;
    std::thread::sleep(Duration::from_secs_f64(delay));
    if launcher.exited().is_some() {
        return Err("the job ended before the fault".into());
    }
    procfs::signal(ranks[&rank], signal.number)
        .map_err(|e| format!("signalling rank {rank}: {e}"))?;
    Ok((ranks, Instant::now()))
}

/// Whether the job ended as documented: a rank the job needs is named by the launcher,
/// which exits non-zero within `TIMEOUT_S` + slack; a rank under an async server is named
/// too, and the job trains to its end.
fn judge(row: &mut Row, launcher: &mut Running, mode: &Mode, rank: usize, s: Signal, t0: Instant) {
    let status = launcher.wait_exit(Duration::from_secs_f64(HANG_S));
    let Some(status) = status else {
        let why = format!("HANG: the launcher still ran {HANG_S} s after the fault");
        return fail(row, why, &launcher.text());
    };
    let goes_on = mode.tolerated.contains(&rank);
    let named = naming_line(launcher, rank, s, goes_on);
    row.detected_s = named
        .as_ref()
        .map(|l| l.at.saturating_duration_since(t0).as_secs_f64());
    let headline = named.as_ref().map_or("rank not named".to_string(), |l| {
        let t = l.text.trim_start_matches("error: ");
        let t = t.trim_start_matches("[launcher] ");
        t.split(';').next().unwrap_or(t).to_string()
    });
    let text = launcher.text();
    let code = status.code().map_or("killed".into(), |c| c.to_string());
    if goes_on {
        let acc = final_acc(&text);
        row.outcome = match acc {
            Some(a) => format!("finished (exit {code}), acc {a:.4}; {headline}"),
            None => format!("exit {code}; {headline}"),
        };
        if !status.success() || acc.is_none_or(|a| a < 0.5) || named.is_none() {
            fail(row, "the job must train on without the rank".into(), &text);
        }
    } else {
        row.outcome = format!("launcher exit {code}: {headline}");
        let late = row
            .detected_s
            .is_none_or(|d| d > TIMEOUT_S + NAMING_SLACK_S);
        if status.success() || named.is_none() || late {
            fail(
                row,
                format!("rank {rank} must be named within {TIMEOUT_S} s + {NAMING_SLACK_S} s"),
                &text,
            );
        }
    }
}

/// The launcher's line that names `rank` as the documentation says for this fault.
fn naming_line(launcher: &Running, rank: usize, s: Signal, goes_on: bool) -> Option<running::Line> {
    let killed = s.number == libc::SIGKILL;
    launcher.find(|l| match (goes_on, killed) {
        (false, true) => l.contains(&format!("rank {rank} failed (killed by signal 9)")),
        (false, false) => l.contains(&format!("rank {rank} stopped responding")),
        (true, true) => l.starts_with(&format!(
            "[launcher] rank {rank} exited (killed by signal 9); the job goes on"
        )),
        (true, false) => l.strip_prefix("[launcher] rank(s) ").is_some_and(|rest| {
            let list = rest.split(" still running").next().unwrap_or_default();
            list.split(", ").any(|r| r == rank.to_string())
        }),
    })
}

/// `test_acc` of the launcher's (or rank 0's) final line.
fn final_acc(text: &str) -> Option<f64> {
    let line = text.lines().rev().find(|l| l.starts_with("final "))?;
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix("test_acc="))
        .and_then(|v| v.parse().ok())
}

/// Marks the row as not documented behaviour, keeping the end of the output for the report.
fn fail(row: &mut Row, why: String, output: &str) {
    if row.outcome.is_empty() {
        row.outcome = why.clone();
    }
    let tail: Vec<&str> = output.lines().rev().take(25).collect();
    let tail: Vec<&str> = tail.into_iter().rev().collect();
    let msg = format!("{why}\n    {}", tail.join("\n    "));
    row.problem = Some(match row.problem.take() {
        Some(p) => format!("{p}\n{msg}"),
        None => msg,
    });
}

/// No process of the scenario may be left: none of `pids` (zombies count as gone), and no
/// `flotilla` process whose command line names its output directory.
fn check_nothing_left(row: &mut Row, pids: &[u32], out: &Path) {
    let left = procfs::wait_gone(pids, Duration::from_secs(5));
    let needle = out.to_str().expect("utf8");
    let named: Vec<(u32, String)> = processes_mentioning(needle)
        .into_iter()
        .filter(|(pid, _)| procfs::alive(*pid))
        .collect();
    if !left.is_empty() || !named.is_empty() {
        for pid in left.iter().chain(named.iter().map(|(p, _)| p)) {
            let _ = procfs::signal(*pid, libc::SIGKILL);
        }
        let why = format!("ORPHANS: processes left after the scenario: {left:?} {named:?}");
        row.outcome = format!("{}; {why}", row.outcome);
        fail(row, why, "");
    }
}

/// `name` as a file name.
fn slug(name: &str) -> String {
    name.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect()
}

/// A job whose ranks the test starts itself (as mpirun would), every rank but the last
/// first: while the last has not joined, rank 0's rendezvous port and the others' mesh
/// listeners are open to strangers and intruders. Each rank serves `/metrics`.
struct HandJob<'a> {
    cfg: String,
    out: std::path::PathBuf,
    world: usize,
    /// Every rank prints a line starting with this once it starts its role.
    marker: &'a str,
    secret: Option<&'a str>,
    port: String,
    metrics: String,
}

impl<'a> HandJob<'a> {
    fn new(dir: &Path, name: &str, yaml: &str, world: usize, marker: &'a str) -> Self {
        HandJob {
            cfg: config_file(dir, &format!("{name}.yaml"), &format!("{COMMON}{yaml}")),
            out: dir.join(name),
            world,
            marker,
            secret: None,
            port: free_port(),
            metrics: free_port(),
        }
    }

    /// `flotilla train` as rank `rank` (of `cfg`, with `secret`), writing to `out`.
    fn rank(&self, rank: usize, cfg: &str, secret: Option<&str>, out: &Path) -> Running {
        let mut c = flotilla();
        c.args(["train", cfg, "--rank", &rank.to_string()])
            .args(["--master-port", &self.port, "--metrics-port", &self.metrics])
            .args(["--output", out.to_str().expect("utf8")]);
        if let Some(s) = secret {
            c.env("FLOTILLA_SECRET", s);
        }
        Running::start(c)
    }

    /// Runs the job: `joined` once every rank but the last listens (rank 0 for joins, the
    /// others for their mesh: they are joining), `training` once every rank started
    /// training, each given the ranks' pids. Rank 0's final accuracy (or what went wrong),
    /// and every rank's pid.
    fn run(
        &self,
        joined: &mut dyn FnMut(&[u32]) -> Result<(), String>,
        training: &mut dyn FnMut(&[u32]) -> Result<(), String>,
    ) -> (Result<f64, String>, Vec<u32>) {
        let mut ranks: Vec<Running> = (0..self.world - 1)
            .map(|r| self.rank(r, &self.cfg, self.secret, &self.out))
            .collect();
        let mut pids: Vec<u32> = ranks.iter().map(Running::pid).collect();
        let result = (|| {
            // Rank 0 listens for joins; the others listen for their mesh once they joined.
            for &pid in &pids {
                if procfs::wait_listening(pid, 1, Duration::from_secs(30)).is_empty() {
                    return Err(format!("process {pid} never listened"));
                }
            }
            joined(&pids)?;
            ranks.push(self.rank(self.world - 1, &self.cfg, self.secret, &self.out));
            pids.push(ranks[self.world - 1].pid());
            for r in &ranks {
                r.wait_lines(1, Duration::from_secs(60), |l| l.starts_with(self.marker))
                    .ok_or("a rank never started training")?;
            }
            training(&pids)?;
            self.finish(&mut ranks)
        })();
        (result, pids)
    }

    /// Waits for every rank to succeed; rank 0's final accuracy.
    fn finish(&self, ranks: &mut [Running]) -> Result<f64, String> {
        for (r, p) in ranks.iter_mut().enumerate() {
            match p.wait_exit(Duration::from_secs(90)) {
                Some(s) if s.success() => {}
                other => return Err(format!("rank {r} ended {other:?}:\n{}", p.text())),
            }
        }
        final_acc(&ranks[0].text()).ok_or_else(|| "rank 0 printed no final line".to_string())
    }
}

/// Sends stranger `kind` to every port the processes `pids` listen on; how many.
fn visit_all(kind: Stranger, pids: &[u32], seed: u64, wait: Duration) -> Result<usize, String> {
    let mut visited = 0;
    for &pid in pids {
        for port in procfs::wait_listening(pid, 1, wait) {
            kind.visit(port, seed)
                .map_err(|e| format!("port {port} of process {pid}: {e}"))?;
            visited += 1;
        }
    }
    Ok(visited)
}

/// Strangers of each kind at every listening port — rank 0's rendezvous port and the mesh
/// listeners while the last rank has not joined, every `/metrics` port while training — in
/// sync all-reduce and in a hierarchical parameter server: the job trains to the accuracy it
/// reaches without them.
fn stranger_rows(rng: &mut SplitMix, dir: &Path) -> Vec<Row> {
    let modes = [
        (
            "sync all-reduce",
            "world_size: 3\nepochs: 8\n",
            3,
            "training: ",
        ),
        (
            "PS hierarchical sync",
            "arch: hierarchical\nnum_server_rounds: 400\nglobal_server:\n  aggr_type: sync\n  local_servers:\n    - {aggr_type: sync, num_workers: 1}\n    - {aggr_type: sync, num_workers: 1}\n",
            5,
            "role ",
        ),
    ];
    let mut rows = Vec::new();
    for (mode, yaml, world, marker) in modes {
        let base = HandJob::new(
            dir,
            &format!("{}-baseline", slug(mode)),
            yaml,
            world,
            marker,
        );
        let (baseline, _) = base.run(&mut |_| Ok(()), &mut |_| Ok(()));
        for kind in Stranger::ALL {
            let seed = rng.next();
            let name = format!("{}-{kind:?}", slug(mode));
            let job = HandJob::new(dir, &name, yaml, world, marker);
            let (mut early, mut late) = (0, 0);
            let (acc, pids) = job.run(
                &mut |pids| visit_all(kind, pids, seed, Duration::ZERO).map(|n| early = n),
                &mut |pids| visit_all(kind, pids, seed, Duration::from_secs(3)).map(|n| late = n),
            );
            let mut row = Row {
                fault: kind.name().into(),
                mode: mode.into(),
                target: format!("every listening port: {early} at rendezvous, {late} in training"),
                detected_s: None,
                outcome: String::new(),
                problem: None,
            };
            judge_same_accuracy(&mut row, acc, &baseline, early > 0 && late > 0);
            check_nothing_left(&mut row, &pids, &job.out);
            println!("{}", row_line(&row));
            rows.push(row);
        }
    }
    rows
}

/// The job finished with the accuracy of the same job undisturbed.
fn judge_same_accuracy(
    row: &mut Row,
    acc: Result<f64, String>,
    baseline: &Result<f64, String>,
    visited: bool,
) {
    match (&acc, baseline) {
        (Ok(a), Ok(b)) => {
            row.outcome = format!("finished, acc {a:.4} (undisturbed: {b:.4})");
            if a != b {
                fail(
                    row,
                    "the accuracy differs from the undisturbed run".into(),
                    "",
                );
            }
        }
        (Err(e), _) | (_, Err(e)) => {
            row.outcome = "the job failed".into();
            fail(row, format!("the job must finish normally: {e}"), "");
        }
    }
    if !visited {
        fail(row, "no listening port was found in a phase".into(), "");
    }
}

/// A process that is not one of the job's ranks tries to join as its last rank while the
/// real ranks wait: with another secret, and with another config. It is refused with a
/// clear error; the real last rank then joins and the job finishes.
fn intruder_rows(dir: &Path) -> Vec<Row> {
    let yaml = "world_size: 3\nepochs: 4\n";
    let secret = format!("job-secret-{}", std::process::id());
    let base = HandJob::new(dir, "intruder-baseline", yaml, 3, "training: ");
    let (baseline, _) = base.run(&mut |_| Ok(()), &mut |_| Ok(()));
    let other = format!("{COMMON}{yaml}").replace("momentum: 0.5", "momentum: 0.6");
    let other = config_file(dir, "other.yaml", &other);
    let cases = [
        (
            "peer with the wrong secret",
            "another-secret",
            None,
            "does not share this job's secret",
        ),
        (
            "peer with a different config",
            secret.as_str(),
            Some(other.as_str()),
            "config hash",
        ),
    ];
    let mut rows = Vec::new();
    for (i, (fault, intruder_secret, intruder_cfg, expected)) in cases.into_iter().enumerate() {
        let mut job = HandJob::new(dir, &format!("intruder-{i}"), yaml, 3, "training: ");
        job.secret = Some(&secret);
        let mut row = Row {
            fault: fault.into(),
            mode: "sync all-reduce (secret)".into(),
            target: "joins as rank 2 at rendezvous".into(),
            detected_s: None,
            outcome: String::new(),
            problem: None,
        };
        let mut refusal = Err("not run".to_string());
        let mut intruder_pid = 0;
        let (acc, mut pids) = job.run(
            &mut |_| {
                let cfg = intruder_cfg.unwrap_or(job.cfg.as_str());
                let mut p = job.rank(
                    2,
                    cfg,
                    Some(intruder_secret),
                    &dir.join(format!("intruder-{i}-out")),
                );
                intruder_pid = p.pid();
                refusal = refused(&mut p, expected);
                Ok(())
            },
            &mut |_| Ok(()),
        );
        pids.push(intruder_pid);
        judge_same_accuracy(&mut row, acc, &baseline, true);
        match refusal {
            Ok((s, msg)) => {
                row.detected_s = Some(s);
                row.outcome = format!("refused: {msg}; {}", row.outcome);
            }
            Err(e) => fail(&mut row, format!("the intruder must be refused: {e}"), ""),
        }
        check_nothing_left(&mut row, &pids, &job.out);
        println!("{}", row_line(&row));
        rows.push(row);
    }
    rows
}

/// The intruder's exit: non-zero within the deadline, its error containing `expected`;
/// seconds it took and the error line.
fn refused(p: &mut Running, expected: &str) -> Result<(f64, String), String> {
    let status = p
        .wait_exit(Duration::from_secs_f64(HANG_S))
        .ok_or("it still ran at the deadline")?;
    let took = p.started.elapsed().as_secs_f64();
    let text = p.text();
    let line = text
        .lines()
        .find(|l| l.contains(expected))
        .ok_or_else(|| format!("no error containing {expected:?}:\n{text}"))?;
    if status.success() {
        return Err(format!("it exited successfully:\n{text}"));
    }
    let line = line.trim_start_matches("error: ");
    Ok((took, line.to_string()))
}

fn row_line(r: &Row) -> String {
    let detected = r.detected_s.map_or("–".to_string(), |s| format!("{s:.1}"));
    let mark = if r.problem.is_some() {
        " **(not as documented)**"
    } else {
        ""
    };
    format!(
        "| {} | {} | {} | {detected} | {}{mark} |",
        r.fault,
        r.mode,
        r.target,
        r.outcome.replace('|', "\\|")
    )
}

fn table(rows: &[Row], seed: u64, wall_s: f64) -> String {
    let mut t = format!(
        "Seed {seed}, {} scenarios in {wall_s:.0} s; `comm.timeout_s` {TIMEOUT_S} s.\n\n\
         | fault | mode | target | detected in s | outcome |\n|---|---|---|---|---|\n",
        rows.len()
    );
    for r in rows {
        t.push_str(&row_line(r));
        t.push('\n');
    }
    t
}
