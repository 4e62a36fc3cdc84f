//! Line charts as SVG (plotters' SVG backend, no fonts or system libraries): a run's
//! `loss.svg` and `accuracy.svg`, each against step and against wall time, and the one chart
//! of `flotilla compare`.

use std::path::{Path, PathBuf};

use flotilla_train::history::{EvalPoint, History};

use crate::error::{RankError, Result};
use plotters::coord::Shift;
use plotters::prelude::*;

/// A plotters failure, as text (its error type is generic over the drawing backend).
type Drawn<T> = std::result::Result<T, String>;

/// Plotters' result as [`Drawn`].
fn drawn<T, E: std::fmt::Display>(r: std::result::Result<T, E>) -> Drawn<T> {
    r.map_err(|e| e.to_string())
}

/// Most points drawn of a per-step series (longer ones are averaged in runs of steps).
const MAX_POINTS: usize = 1000;

/// Colours of successive series.
pub const PALETTE: &[RGBColor] = &[
    BLUE,
    RED,
    RGBColor(0, 150, 0),
    MAGENTA,
    RGBColor(230, 140, 0),
    CYAN,
    BLACK,
];

/// A named line of `(x, y)` points.
#[derive(Debug, Clone)]
pub struct Series {
    /// The legend's text.
    pub name: String,
    /// The line's colour.
    pub color: RGBColor,
    /// The points, in order of x.
    pub points: Vec<(f64, f64)>,
    /// Also mark every point (series of few points, e.g. evaluations).
    pub markers: bool,
}

/// Draws `series` into `area` as a line chart with a legend.
pub fn chart(
    area: &DrawingArea<SVGBackend<'_>, Shift>,
    title: &str,
    axes: (&str, &str),
    series: &[Series],
) -> Drawn<()> {
    let (mut x_max, mut y_min, mut y_max) = (1e-9f64, f64::INFINITY, f64::NEG_INFINITY);
    for &(x, y) in series.iter().flat_map(|s| s.points.iter()) {
        x_max = x_max.max(x);
        y_min = y_min.min(y);
        y_max = y_max.max(y);
    }
    if !y_min.is_finite() {
        (y_min, y_max) = (0.0, 1.0);
    }
    let pad = ((y_max - y_min) * 0.05).max(1e-3);
    let chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(35)
        .y_label_area_size(55)
        .build_cartesian_2d(0f64..x_max * 1.02, (y_min - pad)..(y_max + pad));
    let mut chart = drawn(chart)?;
    chart
        .configure_mesh()
        .x_desc(axes.0)
        .y_desc(axes.1)
        .draw()
        .map_err(|e| e.to_string())?;
    for s in series {
        let color = s.color;
        drawn(chart.draw_series(LineSeries::new(
            s.points.iter().copied(),
            color.stroke_width(2),
        )))?
        .label(s.name.as_str())
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        if s.markers {
            drawn(chart.draw_series(s.points.iter().map(|&p| Circle::new(p, 3, color.filled()))))?;
        }
    }
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE.mix(0.8))
        .draw()
        .map_err(|e| e.to_string())
}

/// Draws the same quantity against step (left) and wall time (right) into `path`.
fn two_panels(path: &Path, what: &str, by_step: &[Series], by_time: &[Series]) -> Drawn<()> {
    let root = SVGBackend::new(path, (1000, 380)).into_drawing_area();
    drawn(root.fill(&WHITE))?;
    let (left, right) = root.split_horizontally(500);
    chart(
        &left,
        &format!("{what} against step"),
        ("step", what),
        by_step,
    )?;
    chart(
        &right,
        &format!("{what} against wall time"),
        ("wall time (s)", what),
        by_time,
    )?;
    drawn(root.present())
}

/// The error of a plot that could not be drawn into `path`.
fn plot_error(path: &Path, detail: String) -> RankError {
    RankError::Plot {
        path: path.to_path_buf(),
        detail,
    }
}

/// At most [`MAX_POINTS`] points: consecutive runs of points averaged.
fn thinned(points: Vec<(f64, f64)>) -> Vec<(f64, f64)> {
    let run = points.len().div_ceil(MAX_POINTS).max(1);
    if run == 1 {
        return points;
    }
    points
        .chunks(run)
        .map(|c| {
            let n = c.len() as f64;
            let (x, y) = c.iter().fold((0.0, 0.0), |(a, b), (x, y)| (a + x, b + y));
            (x / n, y / n)
        })
        .collect()
}

/// Writes `loss.svg` (every step's training loss, and the test loss of each evaluation)
/// and `accuracy.svg` (test accuracy of each evaluation) into `dir`; returns their paths.
pub fn write_run_plots(dir: &Path, history: &History) -> Result<Vec<PathBuf>> {
    type Axis = fn(u64, f64) -> f64;
    let (step, wall): (Axis, Axis) = (|s, _| s as f64, |_, w| w);
    let records = |f: fn(&EvalPoint) -> Option<f64>, x: Axis| -> Vec<(f64, f64)> {
        let r = history.records.iter();
        r.filter_map(|e| f(e).map(|y| (x(e.step, e.wall_s), y)))
            .collect()
    };
    let line = |name: &str, color, points, markers| Series {
        name: name.to_string(),
        color,
        points,
        markers,
    };
    let loss = |x: Axis| {
        let train = history.losses.iter().map(|p| (x(p.step, p.wall_s), p.loss));
        vec![
            line(
                "train loss (per step)",
                BLUE,
                thinned(train.collect()),
                false,
            ),
            line("test loss", RED, records(|e| e.test_loss, x), true),
        ]
    };
    let acc = |x: Axis| {
        let points = records(|e| e.test_acc, x);
        vec![line("test accuracy", PALETTE[2], points, true)]
    };
    let loss_svg = dir.join("loss.svg");
    two_panels(&loss_svg, "loss", &loss(step), &loss(wall))
        .map_err(|detail| plot_error(&loss_svg, detail))?;
    let acc_svg = dir.join("accuracy.svg");
    two_panels(&acc_svg, "accuracy", &acc(step), &acc(wall))
        .map_err(|detail| plot_error(&acc_svg, detail))?;
    Ok(vec![loss_svg, acc_svg])
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_train::history::LossPoint;

    #[test]
    fn run_plots_are_svg_with_their_series() {
        let dir = tempfile::tempdir().expect("tmp");
        let record = |step: u64, acc| EvalPoint {
            step,
            wall_s: step as f64 / 10.0,
            train_loss: Some(1.0 / step as f64),
            test_loss: Some(0.5 / step as f64),
            test_acc: Some(acc),
            samples_per_s: Some(100.0),
        };
        let history = History {
            losses: (1..=5000)
                .map(|s| LossPoint {
                    step: s,
                    wall_s: s as f64 / 100.0,
                    loss: 1.0 / s as f64,
                })
                .collect(),
            records: vec![record(10, 0.9), record(20, 0.95)],
        };
        let paths = write_run_plots(dir.path(), &history).expect("plots");
        let loss = std::fs::read_to_string(&paths[0]).expect("loss.svg");
        assert!(loss.starts_with("<svg") && loss.contains("train loss"));
        assert!(loss.contains("against wall time"));
        let acc = std::fs::read_to_string(&paths[1]).expect("accuracy.svg");
        assert!(acc.contains("test accuracy") && acc.contains("<polyline"));
        // No records (a run that never evaluated): still drawn, empty.
        write_run_plots(dir.path(), &History::default()).expect("empty plots");
        assert_eq!(thinned(vec![(0.0, 1.0); 5000]).len(), 1000);
    }
}
