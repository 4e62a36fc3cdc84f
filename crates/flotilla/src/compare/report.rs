//! The report of `flotilla compare`: `compare.md` (one table row per strategy: shape, time to
//! the target, final and best accuracy — for a text job, loss —, samples/s, bytes moved per
//! sample, wall time; a strategy that failed says why in its row) and `compare.svg` (test
//! accuracy, or loss, against wall time, one line per strategy). What is compared is a
//! [`Target`].

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use flotilla_train::history::EvalPoint;
use plotters::prelude::*;
use serde_json::Value;

use flotilla_rank::plots::{self, PALETTE, Series};
use flotilla_rank::report;

/// What the report needs of one strategy's `summary.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct RunFacts {
    /// Ranks in the job.
    pub world_size: u64,
    /// The roles, counted: `1 root, 2 worker`.
    pub roles: String,
    /// Epoch ends and evaluations, in order.
    pub records: Vec<EvalPoint>,
    /// Final test accuracy.
    pub final_acc: Option<f64>,
    /// Best test accuracy of any evaluation.
    pub best_acc: Option<f64>,
    /// Final test (validation) loss.
    pub final_loss: Option<f64>,
    /// Lowest test loss of any evaluation.
    pub best_loss: Option<f64>,
    /// Training samples per second over the run (all ranks).
    pub samples_per_s: Option<f64>,
    /// Bytes sent by all ranks per training sample.
    pub bytes_per_sample: Option<f64>,
    /// Seconds from start to end of rank 0.
    pub wall_s: Option<f64>,
}

impl RunFacts {
    /// Reads the facts out of a run's `summary.json` document.
    pub fn from_summary(v: &Value) -> Result<Self> {
        let run = &v["run"];
        let num = |k: &str| run[k].as_f64();
        let records: Vec<EvalPoint> = serde_json::from_value(v["history"].clone())
            .context("summary.json: `history` is not a list of records")?;
        let mut counted: Vec<(String, usize)> = Vec::new();
        for role in v["topology"]["roles"].as_array().into_iter().flatten() {
            let role = role.as_str().unwrap_or("?");
            match counted.iter_mut().find(|(r, _)| r == role) {
                Some((_, n)) => *n += 1,
                None => counted.push((role.to_string(), 1)),
            }
        }
        Ok(Self {
            world_size: v["topology"]["world_size"]
                .as_u64()
                .context("summary.json: no `topology.world_size`")?,
            roles: counted
                .iter()
                .map(|(r, n)| format!("{n} {r}"))
                .collect::<Vec<_>>()
                .join(", "),
            records,
            final_acc: num("final_acc"),
            best_acc: num("best_acc"),
            final_loss: num("final_loss"),
            best_loss: num("best_loss"),
            samples_per_s: num("samples_per_s"),
            bytes_per_sample: num("bytes_per_sample"),
            wall_s: num("wall_s"),
        })
    }
}

/// One strategy's run: its facts, or why it could not run.
#[derive(Debug)]
pub struct StrategyRun {
    /// The strategy's name.
    pub name: &'static str,
    /// What it runs, in a line.
    pub about: &'static str,
    /// The facts of its run, or the reason it failed (one line).
    pub outcome: std::result::Result<RunFacts, String>,
}

/// A whole comparison.
#[derive(Debug)]
pub struct Comparison {
    /// What every strategy ran (model, data, budget, ...), one line.
    pub setup: String,
    /// The accuracy (or loss) whose time to reach is compared.
    pub target: Target,
    /// The runs, in the order they ran.
    pub runs: Vec<StrategyRun>,
}

/// What a comparison measures its runs by.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Target {
    /// Test accuracy, to reach at least this.
    Accuracy(f64),
    /// Test (validation) loss in nats, to fall to at most this (a text job, where accuracy
    /// is not what is trained for).
    Loss(f64),
}

impl Target {
    /// The target as the table's header and the plot's legend write it.
    fn label(self) -> String {
        match self {
            Target::Accuracy(a) => pct(Some(a)),
            Target::Loss(l) => format!("loss {l}"),
        }
    }

    /// The figure of an evaluation that is compared.
    fn figure(self, r: &EvalPoint) -> Option<f64> {
        match self {
            Target::Accuracy(_) => r.test_acc,
            Target::Loss(_) => r.test_loss,
        }
    }

    /// The first evaluation that reached the target.
    fn first(self, records: &[EvalPoint]) -> Option<&EvalPoint> {
        match self {
            Target::Accuracy(a) => report::first_at(records, a),
            Target::Loss(l) => report::first_loss_at(records, l),
        }
    }

    /// The final and best figure of a run, written for the table.
    fn final_and_best(self, f: &RunFacts) -> (String, String) {
        let loss = |x: Option<f64>| x.map_or("–".into(), |l| format!("{l:.4}"));
        match self {
            Target::Accuracy(_) => (pct(f.final_acc), pct(f.best_acc)),
            Target::Loss(_) => (loss(f.final_loss), loss(f.best_loss)),
        }
    }

    /// What is plotted and tabled: `accuracy` or `loss`.
    fn what(self) -> &'static str {
        match self {
            Target::Accuracy(_) => "accuracy",
            Target::Loss(_) => "loss",
        }
    }

    fn value(self) -> f64 {
        match self {
            Target::Accuracy(x) | Target::Loss(x) => x,
        }
    }
}

fn pct(x: Option<f64>) -> String {
    x.map_or("–".into(), |a| format!("{:.2}%", a * 100.0))
}

fn bytes(x: f64) -> String {
    match x {
        x if x >= 1024.0 * 1024.0 => format!("{:.2} MiB", x / (1024.0 * 1024.0)),
        x if x >= 1024.0 => format!("{:.1} KiB", x / 1024.0),
        x => format!("{x:.0} B"),
    }
}

/// The table row of one run.
fn row(run: &StrategyRun, target: Target) -> String {
    let f = match &run.outcome {
        Ok(f) => f,
        Err(reason) => {
            let reason = reason.replace('|', "\\|");
            return format!("| {} | – | failed: {reason} | | | | | |", run.name);
        }
    };
    let reached = target.first(&f.records).map_or("not reached".into(), |r| {
        format!("{:.1} s (step {})", r.wall_s, r.step)
    });
    let (last, best) = target.final_and_best(f);
    let opt = |x: Option<f64>, show: &dyn Fn(f64) -> String| x.map_or("–".into(), show);
    format!(
        "| {} | {} ({}) | {reached} | {} | {} | {} | {} | {} |",
        run.name,
        f.world_size,
        f.roles,
        last,
        best,
        opt(f.samples_per_s, &|x| format!("{x:.0}")),
        opt(f.bytes_per_sample, &bytes),
        opt(f.wall_s, &|x| format!("{x:.1} s")),
    )
}

/// `compare.md`.
pub fn markdown(c: &Comparison) -> String {
    let mut md = String::from("# flotilla compare\n\n");
    let _ = writeln!(md, "{}\n", c.setup);
    let _ = writeln!(
        md,
        "| strategy | ranks (roles) | time to {} | final {acc} | best {acc} | samples/s | bytes moved / sample | wall time |",
        c.target.label(),
        acc = match c.target {
            Target::Accuracy(_) => "acc.",
            Target::Loss(_) => "loss",
        }
    );
    md.push_str("|---|---|---|---|---|---|---|---|\n");
    for run in &c.runs {
        md.push_str(&row(run, c.target));
        md.push('\n');
    }
    md.push_str(
        "\nTimes are wall seconds since the ranks started, at the first evaluation at or above \
         the target (evaluations once per epoch). Bytes moved: bytes sent by all ranks \
         (frame headers included) and copied into shared memory (ranks of one host), over \
         the training samples of the run. \
         The figure against wall time: `compare.svg`.\n\n",
    );
    for run in &c.runs {
        let _ = writeln!(md, "- `{}`: {}", run.name, run.about);
    }
    md
}

/// `compare.svg`: test accuracy (or loss) against wall time, one line per strategy that ran,
/// and the target.
fn draw(path: &Path, c: &Comparison) -> Result<()> {
    let mut series: Vec<Series> = c
        .runs
        .iter()
        .filter_map(|r| r.outcome.as_ref().ok().map(|f| (r.name, f)))
        .zip(PALETTE.iter().cycle())
        .map(|((name, f), &color)| Series {
            name: name.to_string(),
            color,
            points: f
                .records
                .iter()
                .filter_map(|r| c.target.figure(r).map(|a| (r.wall_s, a)))
                .collect(),
            markers: true,
        })
        .collect();
    let x_max = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.0))
        .fold(0.0, f64::max);
    let level = c.target.value();
    series.push(Series {
        name: format!("target {}", c.target.label()),
        color: RGBColor(150, 150, 150),
        points: vec![(0.0, level), (x_max, level)],
        markers: false,
    });
    let root = SVGBackend::new(path, (900, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let what = format!("test {}", c.target.what());
    plots::chart(
        &root,
        &format!("{what} against wall time"),
        ("wall time (s)", &what),
        &series,
    )
    .map_err(anyhow::Error::msg)?;
    root.present()?;
    Ok(())
}

/// Writes `compare.md` and `compare.svg` into `dir`; returns their paths.
pub fn write(dir: &Path, c: &Comparison) -> Result<Vec<PathBuf>> {
    let md = dir.join("compare.md");
    std::fs::write(&md, markdown(c)).with_context(|| format!("writing {}", md.display()))?;
    let svg = dir.join("compare.svg");
    draw(&svg, c).with_context(|| format!("drawing {}", svg.display()))?;
    Ok(vec![md, svg])
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn summary() -> Value {
        json!({
            "run": {"final_acc": 0.97, "best_acc": 0.975, "samples_per_s": 1500.0,
                    "bytes_per_sample": 2048.0, "wall_s": 12.5},
            "topology": {"world_size": 3, "roles": ["root", "worker", "worker"]},
            "history": [
                {"step": 10, "wall_s": 4.0, "train_loss": 0.5, "test_loss": 0.3,
                 "test_acc": 0.91, "samples_per_s": 1400.0},
                {"step": 20, "wall_s": 8.0, "train_loss": 0.2, "test_loss": 0.1,
                 "test_acc": 0.975, "samples_per_s": 1600.0},
            ],
        })
    }

    #[test]
    fn rows_give_time_to_target_or_the_reason_of_a_failure() {
        let facts = RunFacts::from_summary(&summary()).expect("facts");
        assert_eq!(facts.roles, "1 root, 2 worker");
        let c = Comparison {
            setup: "lenet5 on data/mnist".into(),
            target: Target::Accuracy(0.95),
            runs: vec![
                StrategyRun {
                    name: "ps_flat_sync",
                    about: "one server",
                    outcome: Ok(facts.clone()),
                },
                StrategyRun {
                    name: "pipeline",
                    about: "stages",
                    outcome: Err("the model has 1 layer | cannot cut".into()),
                },
            ],
        };
        let md = markdown(&c);
        assert!(md.contains("| time to 95.00% |"), "{md}");
        assert!(
            md.contains("| ps_flat_sync | 3 (1 root, 2 worker) | 8.0 s (step 20) | 97.00% | 97.50% | 1500 | 2.0 KiB | 12.5 s |"),
            "{md}"
        );
        assert!(
            md.contains("| pipeline | – | failed: the model has 1 layer \\| cannot cut"),
            "{md}"
        );
        let high = row(&c.runs[0], Target::Accuracy(0.99));
        assert!(high.contains("not reached"), "{high}");
        let dir = tempfile::tempdir().expect("tmp");
        let paths = write(dir.path(), &c).expect("report");
        let svg = std::fs::read_to_string(&paths[1]).expect("svg");
        assert!(
            svg.contains("ps_flat_sync") && svg.contains("target 95.00%"),
            "{svg}"
        );
    }

    #[test]
    fn a_loss_target_compares_time_to_the_loss_and_final_losses() {
        let mut v = summary();
        v["run"]["final_loss"] = json!(0.12);
        v["run"]["best_loss"] = json!(0.1);
        let c = Comparison {
            setup: "gpt-char on text:kjv.txt".into(),
            target: Target::Loss(0.2),
            runs: vec![StrategyRun {
                name: "allreduce",
                about: "peers",
                outcome: Ok(RunFacts::from_summary(&v).expect("facts")),
            }],
        };
        let md = markdown(&c);
        assert!(
            md.contains("| time to loss 0.2 | final loss | best loss |"),
            "{md}"
        );
        // Loss 0.3 at step 10, 0.1 at step 20.
        assert!(
            md.contains("| allreduce | 3 (1 root, 2 worker) | 8.0 s (step 20) | 0.1200 | 0.1000 |"),
            "{md}"
        );
        assert!(row(&c.runs[0], Target::Loss(0.05)).contains("not reached"));
        let dir = tempfile::tempdir().expect("tmp");
        let paths = write(dir.path(), &c).expect("report");
        let svg = std::fs::read_to_string(&paths[1]).expect("svg");
        assert!(
            svg.contains("target loss 0.2") && svg.contains("test loss"),
            "{svg}"
        );
    }
}
