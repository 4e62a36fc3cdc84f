//! What a user looks at after a run, written by rank 0 at its end however the job was
//! started (`flotilla launch`, mpirun, Slurm, torchrun-style variables): `summary.json` —
//! the resolved config, the topology, the run's figures, its evaluation history and every
//! rank's role, figures and traffic — and the plots `loss.svg` and `accuracy.svg`.
//!
//! Bytes moved are the bytes *sent* by all ranks (each byte on the wire counted once, by
//! its sender; frame headers included) plus the bytes they copied into shared-memory
//! segments (ranks of one host); bytes per sample divides them by the training samples of
//! the run.

use std::path::{Path, PathBuf};

use flotilla_train::history::{EvalPoint, History, JobTraffic};
use flotilla_train::{RunSummary, TrainConfig};
use serde_json::{Value, json};

use crate::error::{RankError, Result};
use crate::plots;

/// Accuracy milestones reported in `summary.json`.
pub const MILESTONES: &[f64] = &[0.9, 0.95, 0.98, 0.99];

/// The file name of a run's summary in its output directory.
pub const SUMMARY_FILE: &str = "summary.json";

/// The first evaluation at or above `target`, if any.
pub fn first_at(records: &[EvalPoint], target: f64) -> Option<&EvalPoint> {
    records
        .iter()
        .find(|r| r.test_acc.is_some_and(|a| a >= target))
}

/// The first evaluation whose test loss is at or below `target`, if any.
pub fn first_loss_at(records: &[EvalPoint], target: f64) -> Option<&EvalPoint> {
    records
        .iter()
        .find(|r| r.test_loss.is_some_and(|l| l <= target))
}

/// The run's figures: final and best accuracy, final and best test loss (in nats; a text's
/// also in bits per byte), each milestone's first step and wall time,
/// samples per second, the steps in all, the step this process resumed at and the steps it
/// ran itself, and the bytes moved in all and per sample.
pub fn run_figures(summary: &RunSummary) -> Value {
    let h: &History = &summary.history;
    let best = h
        .evaluations()
        .map(|(_, a)| a)
        .fold(None, |m: Option<f64>, a| Some(m.map_or(a, |m| m.max(a))));
    let last = h.evaluations().last().map(|(_, a)| a);
    let best_loss = h
        .records
        .iter()
        .filter_map(|r| r.test_loss)
        .fold(None, |m: Option<f64>, l| Some(m.map_or(l, |m| m.min(l))));
    let milestones: serde_json::Map<String, Value> = MILESTONES
        .iter()
        .map(|&m| {
            let v = first_at(&h.records, m)
                .map_or(Value::Null, |e| json!({"step": e.step, "wall_s": e.wall_s}));
            (format!("{m}"), v)
        })
        .collect();
    let traffic = summary.ranks.as_deref().map(JobTraffic::of);
    let bytes_per_sample = traffic
        .filter(|_| summary.samples > 0)
        .map(|t| t.moved() as f64 / summary.samples as f64);
    let finite = |x: f64| x.is_finite().then_some(x);
    json!({
        "final_acc": finite(summary.test_acc).or(last),
        "best_acc": best,
        "final_loss": finite(summary.test_loss),
        "best_loss": best_loss,
        "bpb": summary.bpb,
        "time_to_accuracy": milestones,
        "samples_per_s": finite(summary.samples_per_s),
        "samples": summary.samples,
        "steps": summary.steps,
        "resumed_at": summary.resumed_at,
        "steps_run": summary.steps_run,
        "wall_s": summary.wall_s,
        "evaluations": h.evaluations().count(),
        "bytes_moved": traffic.map(|t| t.moved()),
        "bytes_received": traffic.map(|t| t.bytes_received),
        "bytes_shm": traffic.map(|t| t.shm_bytes),
        "bytes_inter_host": traffic.map(|t| t.bytes_sent_inter_host),
        "bytes_per_sample": bytes_per_sample,
    })
}

/// The first evaluation whose test loss fell to `target`: its step and wall time, with the
/// target (`null` when none did).
pub fn time_to_loss(records: &[EvalPoint], target: f64) -> Value {
    first_loss_at(records, target).map_or(
        Value::Null,
        |e| json!({"target": target, "step": e.step, "wall_s": e.wall_s}),
    )
}

/// The whole `summary.json` document (with `run.time_to_loss` when the config has a
/// `target_loss`).
pub fn document(config: &TrainConfig, summary: &RunSummary) -> Result<Value> {
    let topology = config.topology()?;
    let roles: Vec<&str> = (0..topology.world_size())
        .map(|r| flotilla_train::trainer::role_label(&topology, r))
        .collect();
    let mut run = run_figures(summary);
    if let Some(target) = config.schedule.target_loss {
        run["time_to_loss"] = time_to_loss(&summary.history.records, target);
    }
    Ok(json!({
        "run": run,
        "topology": {
            "arch": topology.arch().as_str(),
            "world_size": topology.world_size(),
            "workers": flotilla_train::presets::workers(config)?,
            "roles": roles,
        },
        "config": serde_json::to_value(config).map_err(|e| RankError::Summary {
            path: config.telemetry.output.join(SUMMARY_FILE),
            detail: e.to_string(),
        })?,
        "history": summary.history.records,
        "ranks": summary.ranks,
    }))
}

/// Writes `summary.json` and the plots into the run's output directory; returns the paths
/// written. A plot that cannot be drawn is a warning; the summary is not optional.
pub fn write_run(config: &TrainConfig, summary: &RunSummary) -> Result<Vec<PathBuf>> {
    let dir = &config.telemetry.output;
    let path = dir.join(SUMMARY_FILE);
    let body =
        serde_json::to_vec_pretty(&document(config, summary)?).map_err(|e| RankError::Summary {
            path: path.clone(),
            detail: e.to_string(),
        })?;
    std::fs::write(&path, body).map_err(|e| RankError::file("write", &path, e))?;
    let mut written = vec![path];
    match plots::write_run_plots(dir, &summary.history) {
        Ok(paths) => written.extend(paths),
        Err(e) => eprintln!("warning: plots: {e}"),
    }
    Ok(written)
}

/// Reads the `summary.json` of the run in `dir`.
pub fn read_summary(dir: &Path) -> Result<Value> {
    let path = dir.join(SUMMARY_FILE);
    let bytes = std::fs::read(&path).map_err(|e| RankError::file("read", &path, e))?;
    serde_json::from_slice(&bytes).map_err(|e| RankError::Summary {
        path,
        detail: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_train::history::RankReport;

    fn point(step: u64, wall_s: f64, acc: Option<f64>) -> EvalPoint {
        EvalPoint {
            step,
            wall_s,
            train_loss: Some(1.0 / step as f64),
            test_loss: acc.map(|_| 0.5 / step as f64),
            test_acc: acc,
            samples_per_s: Some(100.0),
        }
    }

    fn summary(records: Vec<EvalPoint>) -> RunSummary {
        let rank = |rank, sent| RankReport {
            rank,
            role: "peer".into(),
            bytes_sent: sent,
            bytes_received: sent,
            shm_bytes: 0,
            bytes_sent_inter_host: 0,
            figures: Default::default(),
        };
        RunSummary {
            role: "peer",
            rank: 0,
            world_size: 2,
            test_acc: 0.982,
            test_loss: 0.05,
            bpb: None,
            train_loss: 0.1,
            steps: 40,
            resumed_at: 10,
            steps_run: 30,
            wall_s: 4.5,
            samples_per_s: 250.0,
            samples: 1000,
            param_hash: 0,
            checkpoint: None,
            figures: Default::default(),
            history: History {
                losses: Vec::new(),
                records,
            },
            ranks: Some(vec![rank(0, 3000), rank(1, 2000)]),
        }
    }

    #[test]
    fn milestones_are_the_first_evaluation_at_or_above_them() {
        let s = summary(vec![
            point(10, 1.0, Some(0.93)),
            point(20, 2.0, None),
            point(30, 3.0, Some(0.985)),
            point(40, 4.0, Some(0.982)),
        ]);
        let f = run_figures(&s);
        assert_eq!(f["final_acc"], json!(0.982));
        assert_eq!(f["best_acc"], json!(0.985));
        assert_eq!(
            f["time_to_accuracy"]["0.9"],
            json!({"step": 10, "wall_s": 1.0})
        );
        assert_eq!(
            f["time_to_accuracy"]["0.98"],
            json!({"step": 30, "wall_s": 3.0})
        );
        assert_eq!(f["time_to_accuracy"]["0.99"], Value::Null);
        assert_eq!(f["samples_per_s"], json!(250.0));
        assert_eq!(f["evaluations"], json!(3));
        assert_eq!(
            (&f["resumed_at"], &f["steps_run"]),
            (&json!(10), &json!(30))
        );
        assert_eq!(f["bytes_moved"], json!(5000));
        assert_eq!(f["bytes_per_sample"], json!(5.0));
        // Losses 0.05, 0.0167, 0.0125 at steps 10, 30, 40; the lowest is the best.
        assert_eq!(f["final_loss"], json!(0.05));
        assert!((f["best_loss"].as_f64().expect("best") - 0.0125).abs() < 1e-12);
        assert_eq!(
            time_to_loss(&s.history.records, 0.02),
            json!({"target": 0.02, "step": 30, "wall_s": 3.0})
        );
        assert_eq!(time_to_loss(&s.history.records, 0.01), Value::Null);
    }

    #[test]
    fn without_the_ranks_traffic_bytes_are_unknown_not_zero() {
        let mut s = summary(vec![point(10, 1.0, Some(0.9))]);
        s.ranks = None;
        let f = run_figures(&s);
        assert_eq!(f["bytes_moved"], Value::Null);
        assert_eq!(f["bytes_per_sample"], Value::Null);
    }
}
