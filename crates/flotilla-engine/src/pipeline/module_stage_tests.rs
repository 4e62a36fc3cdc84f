//! A pipeline of a user's stage modules: the cut [`module_pipeline`] routes by name (a skip
//! straight to the stage that takes it, shapes from the probe) and what it refuses.

use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;

use crate::error::Result;
use crate::{
    NamedTensors, OptimizerSpec, Shape, StageBuilder, StageInput, StageModule, module_pipeline,
};

/// Stage 0: `x` `[n, 4]` to `h` `[n, 3]` and a skip `s` `[n, 2]`.
#[derive(Module, Debug)]
struct Front {
    fc: Linear,
    skip: Linear,
}

/// Stage 1: `h` to `h2` `[n, 2]`.
#[derive(Module, Debug)]
struct Middle {
    fc: Linear,
}

/// Stage 2: `h2` and `s` to the logits `[n, 2]`.
#[derive(Module, Debug)]
struct Back {
    fc: Linear,
}

impl StageModule for Front {
    fn inputs(&self) -> Vec<String> {
        vec!["x".into()]
    }
    fn outputs(&self) -> Vec<String> {
        vec!["h".into(), "s".into()]
    }
    fn forward(&self, mut t: NamedTensors) -> Result<NamedTensors> {
        let x = t.take::<2>("x")?;
        Ok(NamedTensors::new()
            .with("h", self.fc.forward(x.clone()))
            .with("s", self.skip.forward(x)))
    }
}

impl StageModule for Middle {
    fn inputs(&self) -> Vec<String> {
        vec!["h".into()]
    }
    fn outputs(&self) -> Vec<String> {
        vec!["h2".into()]
    }
    fn forward(&self, mut t: NamedTensors) -> Result<NamedTensors> {
        Ok(NamedTensors::new().with("h2", self.fc.forward(t.take::<2>("h")?)))
    }
}

impl StageModule for Back {
    fn inputs(&self) -> Vec<String> {
        vec!["h2".into(), "s".into()]
    }
    fn outputs(&self) -> Vec<String> {
        vec!["logits".into()]
    }
    fn forward(&self, mut t: NamedTensors) -> Result<NamedTensors> {
        let logits = self.fc.forward(t.take::<2>("h2")?) + t.take::<2>("s")?;
        Ok(NamedTensors::new().with("logits", logits))
    }
}

pub(super) fn front() -> StageBuilder {
    Box::new(|d| {
        Box::new(Front {
            fc: LinearConfig::new(4, 3).init(d),
            skip: LinearConfig::new(4, 2).init(d),
        })
    })
}

pub(super) fn middle() -> StageBuilder {
    Box::new(|d| {
        Box::new(Middle {
            fc: LinearConfig::new(3, 2).init(d),
        })
    })
}

pub(super) fn back() -> StageBuilder {
    Box::new(|d| {
        Box::new(Back {
            fc: LinearConfig::new(2, 2).init(d),
        })
    })
}

pub(super) const INPUT: StageInput = StageInput {
    shape: Shape::Flat(4),
    vocab: None,
};

fn build(builders: &[StageBuilder], index: usize) -> Result<crate::StageCut> {
    module_pipeline(builders, INPUT, index, &OptimizerSpec::default(), "flex", 1)
        .map(|(cut, _)| cut)
}

#[test]
fn a_skip_goes_straight_to_the_stage_that_takes_it_with_the_shape_the_probe_saw() {
    let stages = [front(), middle(), back()];
    let cut = build(&stages, 2).expect("cut");
    let routes: Vec<_> = cut
        .crossings
        .iter()
        .map(|c| (c.name.as_str(), c.from, c.to, c.shape))
        .collect();
    assert_eq!(
        routes,
        [
            ("h", 0, 1, Shape::Flat(3)),
            ("h2", 1, 2, Shape::Flat(2)),
            ("s", 0, 2, Shape::Flat(2)),
        ]
    );
    assert_eq!(
        (cut.stages(), cut.classes, cut.input),
        (3, 2, Shape::Flat(4))
    );
    assert_eq!(cut.inputs(2), [1, 2]);
    assert_eq!(cut.outputs(0), [0, 2]);
}

#[test]
fn a_pipeline_of_modules_refuses_what_it_cannot_route() {
    let err = |stages: &[StageBuilder]| match build(stages, 0) {
        Ok(_) => panic!("built"),
        Err(e) => e.to_string(),
    };
    let e = err(&[front(), back()]);
    assert!(
        e.contains("stage 1 takes `h2`, which no earlier stage gives"),
        "{e}"
    );
    let e = err(&[front(), middle()]);
    assert!(
        e.contains("stage 0 gives `s`, which no later stage takes"),
        "{e}"
    );
    let e = err(&[front()]);
    assert!(e.contains("the last stage gives"), "{e}");
    let e = err(&[]);
    assert!(e.contains("stage 0 does not exist"), "{e}");
}
