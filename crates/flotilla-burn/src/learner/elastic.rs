//! The `Learner` on the members of an elastic job of peers (sync or async all-reduce, `flotilla
//! launch -n MIN:MAX`), through the one stack's run: when a member is lost or one joins, the
//! run leaves its generation, redoes the step in flight among the members of the next and
//! gives every member the state of the one whose step stood — the `Learner`'s parameters,
//! optimizer and learning-rate scheduler ([`super::state`]), a joiner's over the wire. The
//! `Learner`'s loop runs no collective of its own (a change of members would have to reach
//! it in step with the run's):
//! - the generation's rank 0 shows the training metrics of its own batches;
//! - at the end of every epoch every member makes the model whole (the run's collective),
//!   and the generation's rank 0 validates it on the whole validation set
//!   ([`super::LearnerStrategy::shard_in_order`] gives every process every sample), writes
//!   the `Learner`'s checkpoint and decides early stopping;
//! - a stop (rank 0's early stopping, any member's interrupter) is proposed to the run,
//!   which the members agree on in a vote ([`flotilla_train::Run::propose_stop`]): at the
//!   epoch's end, once rank 0 has validated ([`flotilla_train::Run::vote`]), or after a
//!   step; every member stops after the same step.

use std::cell::RefCell;
use std::rc::Rc;

use burn::data::dataloader::Progress;
use burn::train::{
    InferenceStep, LearnerEvent, LearnerModel, TrainStep, TrainingItem, ValidLoader,
};
use flotilla_train::{Quiet, Run};

use super::engine::Shared;
use super::fit::Fit;
use super::global_output::GlobalOutput;
use crate::error::Result;

/// Steps the run of a member of an elastic job of peers to its end (see the module docs).
pub(super) fn drive<M>(
    fit: &mut Fit<'_, M>,
    run: Run,
    shared: &Rc<RefCell<Shared<M>>>,
    valid: &ValidLoader<M>,
    (samples, _first): (usize, usize),
) -> Result<()>
where
    M: LearnerModel,
    <M as TrainStep>::Output: GlobalOutput,
    <M as InferenceStep>::Output: GlobalOutput,
{
    // The epoch the run stands in, not the Learner's first: in a process that joined the
    // job, the members' (else its first step would look like an epoch's end to it alone);
    // at an epoch end the members have not closed yet, the epoch that ends.
    let at = run.position().epoch;
    let mut member = Member {
        epoch: if run.at_epoch_end() {
            at.saturating_sub(1)
        } else {
            at
        },
        opened: None,
        iteration: 0,
        samples,
    };
    member.drive(fit, run, shared, valid)
}

/// Where a member's `Learner` stands in the run's epochs.
struct Member {
    /// The run's 0-based epoch under way.
    epoch: u32,
    /// The epoch whose training split this process's event processor was told opened (it
    /// shows one only while its rank is 0).
    opened: Option<u32>,
    /// Steps of the epoch shown.
    iteration: usize,
    /// Samples in the training set (every member's steps of an epoch cover them once).
    samples: usize,
}

impl Member {
    fn drive<M>(
        &mut self,
        fit: &mut Fit<'_, M>,
        mut run: Run,
        shared: &Rc<RefCell<Shared<M>>>,
        valid: &ValidLoader<M>,
    ) -> Result<()>
    where
        M: LearnerModel,
        <M as TrainStep>::Output: GlobalOutput,
        <M as InferenceStep>::Output: GlobalOutput,
    {
        self.lead(fit, &run);
        // A process that joined at an epoch end the members have not closed closes it with
        // them.
        self.close_epochs(fit, &mut run, shared, valid)?;
        while let Some(p) = run.step(&mut Quiet)? {
            let out = std::mem::take(&mut shared.borrow_mut().outputs).pop();
            self.lead(fit, &run);
            if let (Some(item), true) = (out, p.progressed) {
                self.iteration += 1;
                // The global batch, the same whatever the members (the job's most).
                let batch = run.config().data.batch_size * fit.strategy.world_size();
                let progress = Progress {
                    items_processed: (self.iteration * batch).min(self.samples),
                    items_total: self.samples,
                    unit: Some("items".into()),
                };
                let lr = Some(shared.borrow().learner.lr_current());
                let item = TrainingItem::new(item, progress, Some(self.iteration), lr);
                fit.train_event(LearnerEvent::ProcessedItem(item));
            }
            if fit.c.interrupter.should_stop() {
                run.propose_stop(&mut Quiet, "the Learner's interrupter stopped")?;
            }
            self.close_epochs(fit, &mut run, shared, valid)?;
        }
        run.finish(&mut Quiet)?;
        Ok(())
    }

    /// Closes the epoch end the run stands at, if any ([`Run::at_epoch_end`]), as every
    /// member does: the model made whole (the run's collective), validated by the
    /// generation's rank 0, the members' vote (which ends the run on a stop proposed); again
    /// in the next generation when a member was lost meanwhile.
    fn close_epochs<M>(
        &mut self,
        fit: &mut Fit<'_, M>,
        run: &mut Run,
        shared: &Rc<RefCell<Shared<M>>>,
        valid: &ValidLoader<M>,
    ) -> Result<()>
    where
        M: LearnerModel,
        <M as TrainStep>::Output: GlobalOutput,
        <M as InferenceStep>::Output: GlobalOutput,
    {
        while run.at_epoch_end() {
            let ended = self.epoch as usize + 1;
            run.prepare_model(&mut Quiet)?;
            // The generation may have changed: its rank 0 validates.
            self.lead(fit, run);
            if fit.shows_valid {
                fit.train_event(LearnerEvent::EndSplit(ended));
                let learner = shared.borrow().learner.clone();
                if fit.end_epoch(&learner, valid, ended)? {
                    run.propose_stop(&mut Quiet, "the Learner stopped")?;
                }
            }
            // Every member, once rank 0 has validated: a stop it proposed ends the run here.
            if run.vote(&mut Quiet)? {
                return Ok(());
            }
            if !run.at_epoch_end() {
                let p = run.position();
                (self.epoch, self.iteration, self.opened) = (p.epoch, 0, None);
                if p.step < p.total {
                    self.lead(fit, run);
                }
            }
        }
        Ok(())
    }

    /// Makes this process show the events while its rank is 0 (the generation's), opening
    /// the training split of the epoch under way for its event processor.
    fn lead<M>(&mut self, fit: &mut Fit<'_, M>, run: &Run)
    where
        M: LearnerModel,
        <M as TrainStep>::Output: GlobalOutput,
        <M as InferenceStep>::Output: GlobalOutput,
    {
        let lead = run.rank() == 0;
        (fit.shows_train, fit.shows_valid) = (lead, lead);
        if lead && self.opened != Some(self.epoch) {
            self.opened = Some(self.epoch);
            fit.train_event(LearnerEvent::StartSplit {
                epoch_number: self.epoch as usize + 1,
                total_items: self.samples,
            });
        }
    }
}
