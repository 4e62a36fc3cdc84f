//! What the one stack's run trains when burn-train's `Learner` drives it: the `Learner`'s
//! model as a [`ModelSource`] (its engine is [`super::engine::LearnerEngine`]), and the
//! training set's sample indices as the run's data ([`IndexSamples`]), so that the run's
//! batches — sharded by rank, reshuffled per epoch, split into micro-batches, resumed — are
//! the indices of the `Learner`'s samples.

use std::cell::RefCell;
use std::rc::Rc;

use burn::prelude::*;
use burn::train::{LearnerModel, TrainStep};
use flotilla_data::{DataError, Samples};
use flotilla_engine::{Engine, OptimizerSpec, ParamLayout};
use flotilla_train::{ModelIo, ModelSource, TrainError};

use super::engine::{BatchMaker, LearnerEngine, Shared};
use super::global_output::GlobalOutput;

/// The training set and batcher of [`super::LearnerStrategy::train_loader`]: how the
/// `Learner`'s input of `I` is made from sample indices, and how many samples there are.
pub(crate) struct TrainData<I> {
    pub(crate) make: BatchMaker<I>,
    pub(crate) len: usize,
}

impl<I> Clone for TrainData<I> {
    fn clone(&self) -> Self {
        Self {
            make: self.make.clone(),
            len: self.len,
        }
    }
}

/// A training set of `len` samples seen by their indices: sample `i` is the number `i` (one
/// value, one label 0), or, selected, the `i`-th of the selected indices. Exact as `f32` up
/// to 2^24 samples (refused above).
#[derive(Debug, Clone)]
pub(crate) struct IndexSamples {
    len: usize,
    selected: Option<Vec<usize>>,
}

impl IndexSamples {
    pub(crate) fn new(len: usize) -> Result<Self, TrainError> {
        if len > 1 << 24 {
            return Err(TrainError::config(
                "data",
                format!("{len} samples: a Learner's run counts its samples as f32 up to 2^24"),
            ));
        }
        Ok(Self {
            len,
            selected: None,
        })
    }

    fn index(&self, i: usize) -> Option<usize> {
        match &self.selected {
            Some(ids) => ids.get(i).copied(),
            None => (i < self.len).then_some(i),
        }
    }
}

impl Samples for IndexSamples {
    fn len(&self) -> usize {
        self.selected.as_ref().map_or(self.len, Vec::len)
    }

    fn sample_shape(&self) -> Vec<usize> {
        vec![1]
    }

    fn labels_per_sample(&self) -> usize {
        1
    }

    fn classes(&self) -> usize {
        1
    }

    fn fill(
        &self,
        indices: &[usize],
        inputs: &mut Vec<f32>,
        labels: &mut Vec<i64>,
    ) -> flotilla_data::Result<()> {
        inputs.clear();
        labels.clear();
        for &i in indices {
            let at = self.index(i).ok_or(DataError::IndexOutOfRange {
                index: i,
                len: self.len(),
            })?;
            inputs.push(at as f32);
            labels.push(0);
        }
        Ok(())
    }

    fn select(&self, indices: &[usize]) -> flotilla_data::Result<Box<dyn Samples>> {
        let ids = indices
            .iter()
            .map(|&i| {
                self.index(i).ok_or(DataError::IndexOutOfRange {
                    index: i,
                    len: self.len(),
                })
            })
            .collect::<flotilla_data::Result<Vec<_>>>()?;
        Ok(Box::new(Self {
            len: self.len,
            selected: Some(ids),
        }))
    }

    fn held_bytes(&self) -> usize {
        self.selected.as_ref().map_or(0, |s| s.len() * 8)
    }
}

/// The `Learner`'s model as the run's [`ModelSource`].
pub(crate) struct LearnerSource<M: LearnerModel> {
    pub(crate) shared: Rc<RefCell<Shared<M>>>,
    pub(crate) make: BatchMaker<<M as TrainStep>::Input>,
    pub(crate) device: Device,
}

impl<M> ModelSource for LearnerSource<M>
where
    M: LearnerModel,
    <M as TrainStep>::Output: GlobalOutput,
{
    fn name(&self) -> &str {
        "learner"
    }

    /// The model's parameter names and shapes: ranks whose models differ are refused at the
    /// rendezvous.
    fn fingerprint(&self) -> flotilla_train::Result<String> {
        let layout = ParamLayout::of(&self.shared.borrow().learner.model());
        let params: Vec<String> = layout
            .params
            .iter()
            .map(|p| format!("{}{:?}", p.name, p.shape))
            .collect();
        Ok(format!("learner {}", params.join(" ")))
    }

    fn io(&self) -> flotilla_train::Result<ModelIo> {
        Ok(ModelIo {
            input: vec![1],
            vocab: None,
            classes: None,
            labels_per_sample: 1,
        })
    }

    /// The `Learner` itself on every rank that trains; its optimizer is the `Learner`'s, not
    /// `_optimizer` (a parameter server's root steps with the job's).
    fn engine(
        &self,
        _optimizer: &OptimizerSpec,
        _device: &str,
        _seed: u64,
    ) -> flotilla_train::Result<Box<dyn Engine>> {
        Ok(Box::new(LearnerEngine::new(
            self.shared.clone(),
            self.make.clone(),
            self.device.clone(),
        )))
    }
}
