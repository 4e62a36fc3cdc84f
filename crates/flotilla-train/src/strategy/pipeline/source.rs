//! What a pipeline's stages are built from — a model spec's layers, or a program's own stage
//! modules ([`crate::StageMaker`]) — kept by an elastic pipeline's members, which build
//! another stage when the members change (`elastic.rs`).

use std::ops::Range;

use flotilla_engine::{ModelSpec, Stage, StageCut, StageEngine};

use super::PipelineOptions;
use crate::error::{Result, TrainError};
use crate::strategy::StageMaker;

/// The model a pipeline's stages are cut from.
#[derive(Clone)]
pub(crate) enum StageSource {
    /// A spec: its layers, cut by layer ranges.
    Spec(ModelSpec),
    /// A program's stage modules (the program cuts the model), and the model's fingerprint.
    Program(StageMaker, String),
}

impl StageSource {
    /// The cut of the given layer ranges (a program's: its own, which must have as many
    /// stages).
    pub(crate) fn cut(
        &self,
        ranges: Vec<Range<usize>>,
        opts: &PipelineOptions,
    ) -> Result<StageCut> {
        match self {
            Self::Spec(spec) => Ok(StageCut::new(spec, ranges)?),
            // The program's cut comes with any of its stages (each build probes them all).
            Self::Program(..) => Ok(self.cut_and_stage(ranges, 0, opts)?.0),
        }
    }

    /// The cut of the given layer ranges and stage `index` of it: one build of a program's
    /// modules (a joiner's, which learns the cut from the members).
    pub(crate) fn cut_and_stage(
        &self,
        ranges: Vec<Range<usize>>,
        index: usize,
        opts: &PipelineOptions,
    ) -> Result<(StageCut, Box<dyn StageEngine>)> {
        let stages = ranges.len();
        let (cut, stage) = match self {
            Self::Spec(spec) => {
                let cut = StageCut::new(spec, ranges)?;
                let stage = self.build(&cut, index, opts)?;
                (cut, stage)
            }
            Self::Program(make, _) => make(index, &opts.optimizer, &opts.device, opts.seed)?,
        };
        if cut.stages() != stages {
            return Err(TrainError::config(
                "pipeline.stages",
                format!(
                    "the members run {stages} stages, this program's model has {}",
                    cut.stages()
                ),
            ));
        }
        Ok((cut, stage))
    }

    /// Stage `index` of `cut`, with its initial parameters (the whole model's from the seed).
    pub(crate) fn build(
        &self,
        cut: &StageCut,
        index: usize,
        opts: &PipelineOptions,
    ) -> Result<Box<dyn StageEngine>> {
        let o = opts;
        Ok(match self {
            Self::Spec(spec) => Box::new(Stage::new(
                spec,
                cut,
                index,
                &o.optimizer,
                &o.device,
                o.seed,
            )?),
            Self::Program(make, _) => make(index, &o.optimizer, &o.device, o.seed)?.1,
        })
    }

    /// What the ranks agree on about the model (a spec's text; a program's fingerprint).
    pub(crate) fn model(&self) -> String {
        match self {
            Self::Spec(spec) => spec.to_yaml(),
            Self::Program(_, fingerprint) => fingerprint.clone(),
        }
    }
}
