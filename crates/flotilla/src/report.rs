//! What a user looks at after a run: rank 0's `metrics.jsonl` (one record per epoch) drawn
//! as `loss.svg` and `accuracy.svg` (each against step and against wall time), and the
//! run's own figures for `summary.json`: final and best accuracy, and the step and wall time
//! at which each accuracy milestone was first reached.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use plotters::prelude::*;
use serde_json::{Value, json};

/// Accuracy milestones reported in `summary.json`.
pub const MILESTONES: &[f64] = &[0.9, 0.95, 0.98, 0.99];

/// One epoch's record of `metrics.jsonl`.
#[derive(Debug, Clone, PartialEq)]
pub struct EpochPoint {
    /// Steps done at its end.
    pub step: f64,
    /// Seconds since the run started.
    pub wall_s: f64,
    /// Mean training loss of the epoch.
    pub train_loss: Option<f64>,
    /// Test loss, when evaluated.
    pub test_loss: Option<f64>,
    /// Test accuracy, when evaluated.
    pub test_acc: Option<f64>,
    /// Samples per second over the epoch.
    pub samples_per_s: Option<f64>,
}

/// Reads `metrics.jsonl` (lines that are not records are skipped).
pub fn read_metrics(path: &Path) -> Result<Vec<EpochPoint>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(text
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| {
            let num = |k: &str| v.get(k).and_then(Value::as_f64).filter(|x| x.is_finite());
            Some(EpochPoint {
                step: num("step")?,
                wall_s: num("wall_s")?,
                train_loss: num("train_loss"),
                test_loss: num("test_loss"),
                test_acc: num("test_acc"),
                samples_per_s: num("samples_per_s"),
            })
        })
        .collect())
}

/// The run's figures: final and best accuracy, each milestone's first step and wall time,
/// and the mean samples per second.
pub fn run_figures(epochs: &[EpochPoint]) -> Value {
    let evaluated: Vec<(&EpochPoint, f64)> = epochs
        .iter()
        .filter_map(|e| e.test_acc.map(|a| (e, a)))
        .collect();
    let best = evaluated
        .iter()
        .map(|(_, a)| *a)
        .fold(None, |m: Option<f64>, a| Some(m.map_or(a, |m| m.max(a))));
    let milestones: serde_json::Map<String, Value> = MILESTONES
        .iter()
        .map(|&m| {
            let hit = evaluated.iter().find(|(_, a)| *a >= m);
            let v = hit.map_or(
                Value::Null,
                |(e, _)| json!({"step": e.step, "wall_s": e.wall_s}),
            );
            (format!("{m}"), v)
        })
        .collect();
    let rates: Vec<f64> = epochs.iter().filter_map(|e| e.samples_per_s).collect();
    json!({
        "final_acc": evaluated.last().map(|(_, a)| *a),
        "best_acc": best,
        "time_to_accuracy": milestones,
        "samples_per_s": (!rates.is_empty()).then(|| rates.iter().sum::<f64>() / rates.len() as f64),
        "epochs": epochs.len(),
    })
}

/// What a point is drawn against: step or wall time.
type Axis = fn(&EpochPoint) -> f64;

/// A named series of `(x, y)` points.
type Series<'a> = (&'a str, RGBColor, Vec<(f64, f64)>);

/// Draws `series` against step (left) and wall time (right) into `path`.
fn two_panels(
    path: &Path,
    what: &str,
    by_step: &[Series<'_>],
    by_time: &[Series<'_>],
) -> Result<()> {
    let root = SVGBackend::new(path, (1000, 380)).into_drawing_area();
    root.fill(&WHITE)?;
    let (left, right) = root.split_horizontally(500);
    for (area, x_desc, series) in [(&left, "step", by_step), (&right, "wall time (s)", by_time)] {
        let points = series.iter().flat_map(|(_, _, p)| p.iter());
        let (mut x_max, mut y_min, mut y_max) = (1e-9f64, f64::INFINITY, f64::NEG_INFINITY);
        for &(x, y) in points {
            x_max = x_max.max(x);
            y_min = y_min.min(y);
            y_max = y_max.max(y);
        }
        if !y_min.is_finite() {
            (y_min, y_max) = (0.0, 1.0);
        }
        let pad = ((y_max - y_min) * 0.05).max(1e-3);
        let mut chart = ChartBuilder::on(area)
            .caption(format!("{what} against {x_desc}"), ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(35)
            .y_label_area_size(55)
            .build_cartesian_2d(0f64..x_max, (y_min - pad)..(y_max + pad))?;
        chart.configure_mesh().x_desc(x_desc).y_desc(what).draw()?;
        for (name, color, pts) in series {
            let color = *color;
            chart
                .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))?
                .label(*name)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        }
        chart
            .configure_series_labels()
            .border_style(BLACK)
            .background_style(WHITE.mix(0.8))
            .draw()?;
    }
    root.present()?;
    Ok(())
}

/// Writes `loss.svg` and `accuracy.svg` into `dir`; returns their paths.
pub fn write_plots(dir: &Path, epochs: &[EpochPoint]) -> Result<Vec<PathBuf>> {
    let pick = |f: fn(&EpochPoint) -> Option<f64>, x: Axis| -> Vec<(f64, f64)> {
        epochs
            .iter()
            .filter_map(|e| f(e).map(|y| (x(e), y)))
            .collect()
    };
    let (step, wall): (Axis, Axis) = (|e| e.step, |e| e.wall_s);
    let loss = |x| -> Vec<Series<'_>> {
        vec![
            ("train loss", BLUE, pick(|e| e.train_loss, x)),
            ("test loss", RED, pick(|e| e.test_loss, x)),
        ]
    };
    let acc = |x| -> Vec<Series<'_>> { vec![("test accuracy", GREEN, pick(|e| e.test_acc, x))] };
    let loss_svg = dir.join("loss.svg");
    two_panels(&loss_svg, "loss", &loss(step), &loss(wall))
        .with_context(|| format!("drawing {}", loss_svg.display()))?;
    let acc_svg = dir.join("accuracy.svg");
    two_panels(&acc_svg, "accuracy", &acc(step), &acc(wall))
        .with_context(|| format!("drawing {}", acc_svg.display()))?;
    Ok(vec![loss_svg, acc_svg])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(step: f64, wall_s: f64, acc: Option<f64>) -> EpochPoint {
        EpochPoint {
            step,
            wall_s,
            train_loss: Some(1.0 / step),
            test_loss: Some(0.5 / step),
            test_acc: acc,
            samples_per_s: Some(100.0),
        }
    }

    #[test]
    fn milestones_are_the_first_epoch_at_or_above_them() {
        let epochs = [
            point(10.0, 1.0, Some(0.93)),
            point(20.0, 2.0, None),
            point(30.0, 3.0, Some(0.985)),
            point(40.0, 4.0, Some(0.982)),
        ];
        let f = run_figures(&epochs);
        assert_eq!(f["final_acc"], json!(0.982));
        assert_eq!(f["best_acc"], json!(0.985));
        assert_eq!(
            f["time_to_accuracy"]["0.9"],
            json!({"step": 10.0, "wall_s": 1.0})
        );
        assert_eq!(
            f["time_to_accuracy"]["0.98"],
            json!({"step": 30.0, "wall_s": 3.0})
        );
        assert_eq!(f["time_to_accuracy"]["0.99"], Value::Null);
        assert_eq!(f["samples_per_s"], json!(100.0));
    }

    #[test]
    fn plots_are_svg_with_their_series() {
        let dir = tempfile::tempdir().expect("tmp");
        let epochs = [point(10.0, 1.0, Some(0.9)), point(20.0, 2.5, Some(0.95))];
        let paths = write_plots(dir.path(), &epochs).expect("plots");
        let loss = std::fs::read_to_string(&paths[0]).expect("loss.svg");
        assert!(
            loss.starts_with("<svg") && loss.contains("train loss"),
            "{loss}"
        );
        assert!(loss.contains("against wall time"));
        let acc = std::fs::read_to_string(&paths[1]).expect("accuracy.svg");
        assert!(
            acc.contains("test accuracy") && acc.contains("<polyline"),
            "{acc}"
        );
        // No records (a run that never finished an epoch): still drawn, empty.
        write_plots(dir.path(), &[]).expect("empty plots");
    }
}
