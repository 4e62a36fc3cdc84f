//! burn-train's `SupervisedLearningStrategy` for [`LearnerStrategy`]: which loop trains the
//! `Learner` — the strategy's own (sync all-reduce, ZeRO-0 or 1: `fit.rs`) or the one stack's
//! run (async all-reduce: `stack.rs`).

use burn::train::{
    InferenceStep, Learner, LearnerModel, SupervisedLearningStrategy,
    SupervisedTrainingEventProcessor, TrainLoader, TrainStep, TrainingComponents, ValidLoader,
};

use super::LearnerStrategy;
use super::global_output::GlobalOutput;

impl<M> SupervisedLearningStrategy<M> for LearnerStrategy
where
    M: LearnerModel,
    <M as TrainStep>::Output: GlobalOutput,
    <M as InferenceStep>::Output: GlobalOutput,
{
    fn fit(
        &self,
        components: TrainingComponents<M>,
        mut learner: Learner<M>,
        dataloader_train: TrainLoader<M>,
        dataloader_valid: ValidLoader<M>,
        starting_epoch: usize,
    ) -> (M, SupervisedTrainingEventProcessor<M>) {
        let valid = dataloader_valid.to_device(&self.device.clone().inner());
        learner.fork(&self.device);
        if self.through_run {
            return super::stack::fit(self, components, learner, &valid, starting_epoch);
        }
        let train = dataloader_train.to_device(&self.device);
        super::fit::fit(self, components, learner, (&train, &valid), starting_epoch)
    }
}
