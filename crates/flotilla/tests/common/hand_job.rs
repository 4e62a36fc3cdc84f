//! A job whose ranks the fault-injection suite starts itself (as mpirun would): no launcher
//! stops the others, so each rank shows how it ends by itself. Every rank serves `/metrics`
//! (at the job's metrics port + its rank). Its processes are killed when dropped.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use crate::common::{config_file, flotilla, free_port};
use crate::procfs;
use crate::running::Running;

/// A job of `flotilla train` processes started by hand on 127.0.0.1.
pub struct HandJob<'a> {
    /// Its config file.
    pub cfg: String,
    /// The output directory every rank writes to (rank 0 its checkpoint).
    pub out: PathBuf,
    /// How many ranks.
    pub world: usize,
    /// Every rank prints a line starting with this once it starts its role.
    pub marker: &'a str,
    /// `FLOTILLA_SECRET` of every rank (`None`: the tests' own, `TEST_SECRET`).
    pub secret: Option<&'a str>,
    /// Rank 0's rendezvous port.
    pub port: String,
    /// The first `/metrics` port (rank `r` serves `metrics + r`).
    pub metrics: String,
}

impl<'a> HandJob<'a> {
    /// A job of `world` ranks of the config `text`, written to `dir/name.yaml`, writing to
    /// `dir/name`.
    pub fn new(dir: &Path, name: &str, text: &str, world: usize, marker: &'a str) -> Self {
        HandJob {
            cfg: config_file(dir, &format!("{name}.yaml"), text),
            out: dir.join(name),
            world,
            marker,
            secret: None,
            port: free_port(),
            metrics: free_port(),
        }
    }

    /// `flotilla train` as rank `rank` (of `cfg`, with `secret`), writing to `out`.
    pub fn rank(&self, rank: usize, cfg: &str, secret: Option<&str>, out: &Path) -> Running {
        let mut c = flotilla();
        c.args(["train", cfg, "--rank", &rank.to_string()])
            .args(["--master-port", &self.port, "--metrics-port", &self.metrics])
            .args(["--output", out.to_str().expect("utf8")]);
        c.env(
            "FLOTILLA_SECRET",
            secret.unwrap_or(crate::common::TEST_SECRET),
        );
        Running::start(c)
    }

    /// The `/metrics` port of rank `rank`.
    pub fn metrics_port(&self, rank: usize) -> u16 {
        self.metrics.parse::<u16>().expect("port") + rank as u16
    }

    /// Starts every rank at once and waits (at most `limit`) until each started its role.
    pub fn start_all(&self, limit: Duration) -> Result<Vec<Running>, (String, Vec<Running>)> {
        let ranks: Vec<Running> = (0..self.world)
            .map(|r| self.rank(r, &self.cfg, self.secret, &self.out))
            .collect();
        for (r, p) in ranks.iter().enumerate() {
            if p.wait_lines(1, limit, |l| l.starts_with(self.marker))
                .is_none()
            {
                return Err((format!("rank {r} never started its role"), ranks));
            }
        }
        Ok(ranks)
    }

    /// Runs the job, every rank but the last first: `joined` once every rank but the last
    /// listens (rank 0 for joins, the others for their mesh: they are joining), `training`
    /// once every rank started training, each given the ranks' pids. Rank 0's final accuracy
    /// (or what went wrong), and every rank's pid.
    pub fn run(
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

/// `test_acc` of the last `final ...` line of `text` (a launcher's or rank 0's output).
pub fn final_acc(text: &str) -> Option<f64> {
    let line = text.lines().rev().find(|l| l.starts_with("final "))?;
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix("test_acc="))
        .and_then(|v| v.parse().ok())
}

/// An undisturbed run of a job: rank 0's final accuracy and the output holding its
/// checkpoint.
#[derive(Debug, Clone)]
pub struct Baseline {
    /// Rank 0's final `test_acc`.
    pub acc: f64,
    /// The run's output directory (`checkpoints/latest`).
    pub out: PathBuf,
    /// How long it ran, in seconds.
    pub secs: f64,
}

/// Undisturbed runs by hand, one per config text, each run when first asked for; shared by
/// the suite's lanes (a run asked for while another lane makes it is waited for, not run
/// twice).
pub struct Baselines {
    dir: PathBuf,
    runs: Mutex<BTreeMap<String, Arc<Once>>>,
}

/// One undisturbed run, made by the first lane that asks for it.
type Once = OnceLock<Result<Baseline, String>>;

impl Baselines {
    /// Baselines written under `dir`.
    pub fn new(dir: &Path) -> Self {
        Baselines {
            dir: dir.to_path_buf(),
            runs: Mutex::new(BTreeMap::new()),
        }
    }

    /// The undisturbed run of the config `text` (`world` ranks, role `marker`), named `name`.
    pub fn of(
        &self,
        name: &str,
        text: &str,
        world: usize,
        marker: &str,
    ) -> Result<Baseline, String> {
        let once = {
            let mut runs = self.runs.lock().unwrap_or_else(|e| e.into_inner());
            Arc::clone(runs.entry(text.to_string()).or_default())
        };
        once.get_or_init(|| {
            let job = HandJob::new(&self.dir, &format!("{name}-baseline"), text, world, marker);
            let started = std::time::Instant::now();
            let (acc, _) = job.run(&mut |_| Ok(()), &mut |_| Ok(()));
            let secs = started.elapsed().as_secs_f64();
            let run = acc
                .map(|acc| Baseline {
                    acc,
                    out: job.out.clone(),
                    secs,
                })
                .map_err(|e| format!("the undisturbed run failed: {e}"));
            println!("baseline {name}: {run:?} in {secs:.1} s");
            run
        })
        .clone()
    }
}
