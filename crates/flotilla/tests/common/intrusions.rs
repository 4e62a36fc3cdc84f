//! The fault-injection suite's rows of processes that are not the job's ranks: strangers at
//! every port the ranks listen on (at rendezvous and while they train), and intruders that
//! try to join as a rank. Each job must end as the same job undisturbed: bit for bit where
//! the mode is deterministic.

use std::path::Path;
use std::time::Duration;

use crate::common::config_file;
use crate::fault_row::{Row, check_nothing_left, checkpoint_difference, fail, row_line, slug};
use crate::hand_job::{Baseline, Baselines, HandJob};
use crate::procfs;
use crate::running::Running;
use crate::stranger::{SplitMix, Stranger};
use crate::{COMMON, HANG_S, PS_HIERARCHICAL_ASYNC};

/// How far an asynchronous job's accuracy may be from its undisturbed run's.
pub const ASYNC_ACC_TOLERANCE: f64 = 0.02;

/// A job the strangers visit.
struct Visited {
    mode: &'static str,
    /// Config keys after [`COMMON`].
    yaml: &'static str,
    world: usize,
    marker: &'static str,
    /// Sync: it ends bit for bit as undisturbed. Async: its accuracy is within
    /// [`ASYNC_ACC_TOLERANCE`], and its servers lost and took back no child.
    deterministic: bool,
    /// Its ranks accept rejoins, so while it trains rank 0's rendezvous port and its
    /// servers' mesh listeners stay open (`flotilla-tcp` `rendezvous/rejoin.rs`).
    rejoinable: bool,
    /// How many of its ranks are servers that report the children they lost and took
    /// back (`lost_children`, `rejoined_children` in `summary.json`): the async one's.
    servers: usize,
}

const VISITED: [Visited; 3] = [
    Visited {
        mode: "sync all-reduce",
        yaml: "world_size: 3\nepochs: 8\n",
        world: 3,
        marker: "training: ",
        deterministic: true,
        rejoinable: false,
        servers: 0,
    },
    Visited {
        mode: "PS hierarchical sync",
        yaml: "arch: hierarchical\nnum_server_rounds: 400\nglobal_server:\n  aggr_type: sync\n  local_servers:\n    - {aggr_type: sync, num_workers: 1}\n    - {aggr_type: sync, num_workers: 1}\n",
        world: 5,
        marker: "role ",
        deterministic: true,
        rejoinable: false,
        servers: 0,
    },
    Visited {
        mode: "PS hierarchical async",
        yaml: PS_HIERARCHICAL_ASYNC,
        world: 5,
        marker: "role ",
        deterministic: false,
        rejoinable: true,
        servers: 3,
    },
];

/// The ports visited: (rank, port).
type Ports = Vec<(usize, u16)>;

/// Sends a stranger of every kind (each on its own connection, `seeds` making the random
/// bytes) to every port the processes `pids` (by rank) listen on.
fn visit_all(pids: &[u32], seeds: &[u64], wait: Duration) -> Result<Ports, String> {
    let mut visited = Vec::new();
    for (rank, &pid) in pids.iter().enumerate() {
        for port in procfs::wait_listening(pid, 1, wait) {
            for (kind, &seed) in Stranger::ALL.into_iter().zip(seeds) {
                kind.visit(port, seed).map_err(|e| {
                    format!(
                        "{}: port {port} of rank {rank} (process {pid}): {e}",
                        kind.name()
                    )
                })?;
            }
            visited.push((rank, port));
        }
    }
    Ok(visited)
}

/// Strangers of every kind, one after the other, at every listening port — rank 0's
/// rendezvous port and the mesh listeners while the last rank has not joined; while
/// training, every `/metrics` port and, in the rejoinable job, rank 0's rendezvous port and
/// the servers' mesh listeners: the job ends as it does without them. One job per mode
/// visited by all the kinds (a job each cost the suite six more trainings; a kind that
/// breaks a job fails its row all the same, and the error names the kind a port refused).
pub fn stranger_rows(rng: &mut SplitMix, dir: &Path, baselines: &Baselines) -> Vec<Row> {
    let mut rows = Vec::new();
    let kinds: Vec<&str> = Stranger::ALL.iter().map(|k| k.name()).collect();
    for v in &VISITED {
        let text = format!("{COMMON}{}", v.yaml);
        let baseline = baselines.of(&slug(v.mode), &text, v.world, v.marker);
        let seeds: Vec<u64> = Stranger::ALL.iter().map(|_| rng.next()).collect();
        let name = format!("{}-strangers", slug(v.mode));
        let job = HandJob::new(dir, &name, &text, v.world, v.marker);
        let (mut early, mut late) = (Vec::new(), Vec::new());
        let (acc, pids) = job.run(
            &mut |pids| visit_all(pids, &seeds, Duration::ZERO).map(|p| early = p),
            &mut |pids| visit_all(pids, &seeds, Duration::from_secs(3)).map(|p| late = p),
        );
        // While training, the ports other than `/metrics` are kept rendezvous and mesh
        // listeners.
        let kept: Ports = late
            .iter()
            .copied()
            .filter(|&(r, p)| p != job.metrics_port(r))
            .collect();
        let mut row = Row::new(
            format!("strangers: {}", kinds.join("; ").replace("stranger: ", "")),
            v.mode,
            format!(
                "every listening port: {} at rendezvous, {} in training ({} of them rendezvous/mesh)",
                early.len(),
                late.len(),
                kept.len()
            ),
        );
        judge_visited(&mut row, v, &job, acc, &baseline);
        let mesh_in_training = kept.iter().any(|&(r, _)| r != 0);
        if early.is_empty() || late.is_empty() || (v.rejoinable && !mesh_in_training) {
            let why = "no listening port (or, rejoinable, no mesh listener) in a phase";
            fail(&mut row, why.into(), "");
        }
        check_nothing_left(&mut row, &pids, &job.out);
        println!("{}", row_line(&row));
        rows.push(row);
    }
    rows
}

/// The job ended as the same job undisturbed (see [`Visited::deterministic`]).
fn judge_visited(
    row: &mut Row,
    v: &Visited,
    job: &HandJob,
    acc: Result<f64, String>,
    baseline: &Result<Baseline, String>,
) {
    let (a, b) = match (acc.as_ref(), baseline) {
        (Ok(&a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => {
            row.outcome = "the job failed".into();
            return fail(row, format!("the job must finish normally: {e}"), "");
        }
    };
    if v.deterministic {
        judge_bitwise(row, &job.out, b, a);
        return;
    }
    let disturbed = servers_disturbed(&job.out, v.servers);
    row.outcome = format!(
        "finished, acc {a:.4} (undisturbed: {:.4}); servers lost/took back {}",
        b.acc,
        disturbed.as_deref().unwrap_or("no child")
    );
    if (a - b.acc).abs() > ASYNC_ACC_TOLERANCE {
        let why =
            format!("the accuracy is {ASYNC_ACC_TOLERANCE} or more from the undisturbed run's");
        fail(row, why, "");
    }
    if let Some(d) = disturbed {
        fail(row, format!("a server was disturbed: {d}"), "");
    }
}

/// The job's checkpoint (under `out`) is the undisturbed one's, bit for bit.
fn judge_bitwise(row: &mut Row, out: &Path, baseline: &Baseline, acc: f64) {
    match checkpoint_difference(out, &baseline.out) {
        None => row.outcome = format!("finished, acc {acc:.4}, checkpoint bitwise = undisturbed"),
        Some(d) => {
            row.outcome = format!("finished, acc {acc:.4}, checkpoint ≠ undisturbed");
            fail(
                row,
                format!("the checkpoint differs from the undisturbed run's: {d}"),
                "",
            );
        }
    }
}

/// Which servers (rank 0's `summary.json`: every rank's figures) lost or took back a child,
/// if any did; also when the summary is missing or fewer than `servers` ranks report.
fn servers_disturbed(out: &Path, servers: usize) -> Option<String> {
    let path = out.join("summary.json");
    let summary: serde_json::Value = match std::fs::read(&path).map(|b| serde_json::from_slice(&b))
    {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => return Some(format!("{}: {e}", path.display())),
        Err(e) => return Some(format!("{}: {e}", path.display())),
    };
    let ranks = summary["ranks"].as_array().cloned().unwrap_or_default();
    let mut found = Vec::new();
    let mut reporting = 0;
    for r in &ranks {
        let f = &r["figures"];
        let (Some(lost), Some(back)) =
            (f["lost_children"].as_f64(), f["rejoined_children"].as_f64())
        else {
            continue;
        };
        reporting += 1;
        if lost != 0.0 || back != 0.0 {
            found.push(format!("rank {}: lost {lost}, took back {back}", r["rank"]));
        }
    }
    if reporting < servers {
        found.push(format!(
            "{reporting} of {servers} servers report their children"
        ));
    }
    (!found.is_empty()).then(|| found.join("; "))
}

/// A process that is not one of the job's ranks tries to join as its last rank while the
/// real ranks wait: with another secret, and with another config. It is refused with a
/// clear error; the real last rank then joins and the job ends bit for bit as undisturbed.
pub fn intruder_rows(dir: &Path, baselines: &Baselines) -> Vec<Row> {
    let yaml = "world_size: 3\nepochs: 4\n";
    let text = format!("{COMMON}{yaml}");
    let secret = format!("flotilla-job-secret-{}", std::process::id());
    let baseline = baselines.of("intruder", &text, 3, "training: ");
    let other = text.replace("momentum: 0.5", "momentum: 0.6");
    let other = config_file(dir, "other.yaml", &other);
    let cases = [
        (
            "peer with the wrong secret",
            "another-secret-of-another-job",
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
        let mut job = HandJob::new(dir, &format!("intruder-{i}"), &text, 3, "training: ");
        job.secret = Some(&secret);
        let mut row = Row::new(
            fault,
            "sync all-reduce (secret)",
            "joins as rank 2 at rendezvous",
        );
        let mut refusal = Err("not run".to_string());
        let mut intruder_pid = 0;
        let (acc, mut pids) = job.run(
            &mut |_| {
                let cfg = intruder_cfg.unwrap_or(job.cfg.as_str());
                let out = dir.join(format!("intruder-{i}-out"));
                let mut p = job.rank(2, cfg, Some(intruder_secret), &out);
                intruder_pid = p.pid();
                refusal = refused(&mut p, expected);
                Ok(())
            },
            &mut |_| Ok(()),
        );
        pids.push(intruder_pid);
        match (acc.as_ref(), &baseline) {
            (Ok(&a), Ok(b)) => judge_bitwise(&mut row, &job.out, b, a),
            (Err(e), _) | (_, Err(e)) => fail(&mut row, format!("the job must finish: {e}"), ""),
        }
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
