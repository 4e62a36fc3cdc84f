//! Cutting a model spec into contiguous pipeline stages, and the tensors that cross between
//! them.
//!
//! Stage `s` owns the layers `ranges[s]`; the ranges are contiguous, non-empty and cover every
//! layer exactly once. A [`Crossing`] is one tensor that one stage sends to another for every
//! micro-batch: the main activation from stage `s - 1` to stage `s` (named [`MAIN`]), and every
//! named tensor (`out_variables`) that a later stage depends on, sent by the stage that produces
//! it straight to the stage that consumes it (a skip over stage 2 does not pass through it).
//! The gradient of a crossing goes back the same way. Crossings are numbered in a fixed order
//! (main activations first, by stage; then named tensors by consuming layer), so every rank that
//! computes the cut of the same spec agrees on the numbers, which tag the messages.

use std::ops::Range;

use crate::error::{EngineError, Result};
use crate::spec::graph;
use crate::spec::{ModelSpec, Shape};

/// The name of the main activation between consecutive stages (not a valid spec name).
pub const MAIN: &str = "~main";

/// One tensor sent from one stage to another for each micro-batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Crossing {
    /// [`MAIN`] or the `out_variables` name.
    pub name: String,
    /// One sample's shape.
    pub shape: Shape,
    /// The stage that produces it.
    pub from: usize,
    /// The stage that consumes it.
    pub to: usize,
}

/// A model cut into stages.
#[derive(Debug, Clone, PartialEq)]
pub struct StageCut {
    /// Each stage's layers.
    pub ranges: Vec<Range<usize>>,
    /// Every tensor that crosses a stage boundary, in tag order.
    pub crossings: Vec<Crossing>,
    /// One sample's input shape (what stage 0 takes).
    pub input: Shape,
    /// One sample's output shape (what the last stage gives): flat logits `[classes]`, or a
    /// sequence of them `[T, classes]`.
    pub output: Shape,
    /// Number of logit values per sample the last stage gives (`output`'s size: the classes,
    /// or `T × classes` for a sequence model).
    pub classes: usize,
}

impl StageCut {
    /// Cuts `spec` into the given layer ranges, checking that they are contiguous, non-empty
    /// and cover every layer once.
    pub fn new(spec: &ModelSpec, ranges: Vec<Range<usize>>) -> Result<Self> {
        check_ranges(&ranges, spec.layers.len())?;
        let io = spec.infer_io()?;
        let producers = graph::producers(&spec.layers)?;
        let stage_of = |layer: usize| ranges.iter().position(|r| r.contains(&layer));
        let mut crossings = Vec::new();
        for (s, range) in ranges.iter().enumerate().skip(1) {
            crossings.push(Crossing {
                name: MAIN.to_string(),
                shape: io[range.start - 1].1,
                from: s - 1,
                to: s,
            });
        }
        for (layer, node) in spec.layers.iter().enumerate() {
            let to = stage_of(layer).unwrap_or(0);
            for name in &node.dependencies {
                // Shape inference has checked that every name has an earlier producer.
                let Some(&producer) = producers.get(name) else {
                    continue;
                };
                let from = stage_of(producer).unwrap_or(0);
                let crossing = Crossing {
                    name: name.clone(),
                    shape: io[producer].1,
                    from,
                    to,
                };
                if from != to && !crossings.contains(&crossing) {
                    crossings.push(crossing);
                }
            }
        }
        let output = spec.output_shape()?;
        Ok(Self {
            ranges,
            crossings,
            input: spec.input_shape()?,
            output,
            classes: output.numel(),
        })
    }

    /// Cuts `spec` before each of the given layer indices (`[4]` gives `[0, 4)` and
    /// `[4, n)`).
    pub fn at(spec: &ModelSpec, points: &[usize]) -> Result<Self> {
        Self::new(spec, ranges_from_points(points, spec.layers.len()))
    }

    /// Number of stages.
    pub fn stages(&self) -> usize {
        self.ranges.len()
    }

    /// The crossings stage `s` receives, as indices into [`StageCut::crossings`], in tag order.
    pub fn inputs(&self, s: usize) -> Vec<usize> {
        self.indices(|c| c.to == s)
    }

    /// The crossings stage `s` sends, as indices into [`StageCut::crossings`], in tag order.
    pub fn outputs(&self, s: usize) -> Vec<usize> {
        self.indices(|c| c.from == s)
    }

    fn indices(&self, keep: impl Fn(&Crossing) -> bool) -> Vec<usize> {
        (0..self.crossings.len())
            .filter(|&i| keep(&self.crossings[i]))
            .collect()
    }
}

/// The ranges between split points: `[3, 7]` over 10 layers is `[0, 3), [3, 7), [7, 10)`.
pub fn ranges_from_points(points: &[usize], layers: usize) -> Vec<Range<usize>> {
    let mut ranges = Vec::with_capacity(points.len() + 1);
    let mut start = 0;
    for &p in points {
        ranges.push(start..p);
        start = p;
    }
    ranges.push(start..layers);
    ranges
}

fn check_ranges(ranges: &[Range<usize>], layers: usize) -> Result<()> {
    let err = |m: String| Err(EngineError::InvalidSpec(format!("stages: {m}")));
    if ranges.is_empty() {
        return err("no stages".into());
    }
    let mut next = 0;
    for (s, r) in ranges.iter().enumerate() {
        if r.start != next {
            return err(format!(
                "stage {s} starts at layer {} but layer {next} is the next one to place (stages must be contiguous and cover every layer once)",
                r.start
            ));
        }
        if r.start >= layers {
            return err(format!(
                "stage {s} starts at layer {} but the model's layers are 0..{}",
                r.start,
                layers - 1
            ));
        }
        if r.end > layers {
            return err(format!(
                "stage {s} ends at layer {} but the model's last layer is {}",
                r.end - 1,
                layers - 1
            ));
        }
        if r.end <= r.start {
            return err(format!("stage {s} ({}..{}) has no layer", r.start, r.end));
        }
        next = r.end;
    }
    if next != layers {
        return err(format!(
            "the stages end at layer {next} but the model has {layers} layers (layers {next}..{layers} would be dropped)"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resnet() -> ModelSpec {
        ModelSpec::builtin("resnet-mnist").expect("shipped spec")
    }

    #[test]
    fn ranges_must_cover_every_layer_once() {
        let spec = resnet();
        let n = spec.layers.len();
        assert!(StageCut::new(&spec, vec![0..3, 3..n]).is_ok());
        let dropped = StageCut::new(&spec, vec![0..3, 3..n - 1])
            .unwrap_err()
            .to_string();
        assert!(dropped.contains("would be dropped"), "{dropped}");
        let gap = StageCut::new(&spec, vec![0..3, 4..n])
            .unwrap_err()
            .to_string();
        assert!(gap.contains("stage 1 starts at layer 4"), "{gap}");
        let empty = StageCut::at(&spec, &[3, 3]).unwrap_err().to_string();
        assert!(empty.contains("has no layer"), "{empty}");
        let past = StageCut::new(&spec, vec![0..3, 3..n + 4])
            .unwrap_err()
            .to_string();
        assert!(
            past.contains(&format!(
                "ends at layer {} but the model's last layer is {}",
                n + 3,
                n - 1
            )),
            "{past}"
        );
        let beyond = StageCut::at(&spec, &[n + 2]).unwrap_err().to_string();
        assert!(beyond.contains("the model's last layer is"), "{beyond}");
    }

    #[test]
    fn a_skip_goes_straight_from_producer_to_consumer() {
        let spec = ModelSpec::from_yaml(
            "input: [8]\nlayers:\n  - linear: {out: 8}\n    out_variables: [a]\n  - relu\n  - linear: {out: 8}\n  - relu\n  - linear: {out: 8}\n    dependencies: [a]\n  - linear: {out: 3}\n",
            "inline",
        )
        .expect("spec");
        let cut = StageCut::at(&spec, &[2, 4]).expect("cut");
        let names: Vec<(&str, usize, usize)> = cut
            .crossings
            .iter()
            .map(|c| (c.name.as_str(), c.from, c.to))
            .collect();
        assert_eq!(names, vec![(MAIN, 0, 1), (MAIN, 1, 2), ("a", 0, 2)]);
        assert_eq!(cut.outputs(0), vec![0, 2]);
        assert_eq!(cut.inputs(2), vec![1, 2]);
        assert!(cut.inputs(1) == vec![0] && cut.outputs(2).is_empty());
        assert_eq!(cut.classes, 3);
        // Cut inside the same stage: nothing named crosses.
        let cut = StageCut::at(&spec, &[5]).expect("cut");
        assert_eq!(cut.crossings.len(), 1);
    }
}
