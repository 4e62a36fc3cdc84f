//! The `Learner` on a parameter server's ranks (flat, sharded or hierarchical servers, sync
//! or async, model averaging with `local_steps > 1`), through the one stack's run: every rank
//! runs the same program, and its run takes its role. A worker's steps are the `Learner`'s
//! `train_step` on the batches the run draws (its optimizer too under model averaging); a
//! server applies the mean update with its `Learner`'s optimizer and scheduler (a server has
//! no batches). Each rank decides alone — the ranks' group carries the servers' messages, so
//! the `Learner`'s loop runs no collective on it:
//! - the first worker's event processor shows the training metrics of its own batches (no
//!   global batch exists when the servers are asynchronous);
//! - at the end of every epoch of rounds ([`flotilla_train::Run::per_epoch`]) the root server
//!   gathers the whole model, validates it on the whole validation set
//!   ([`super::LearnerStrategy::shard_in_order`] gives it every sample), writes the
//!   `Learner`'s checkpoint and decides early stopping; its interrupter or early stopping
//!   stops every rank through the servers' stop (a worker's interrupter is not heard).

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

/// Steps the run of a parameter server's rank to its end (see the module docs).
pub(super) fn drive<M>(
    fit: &mut Fit<'_, M>,
    mut run: Run,
    shared: &Rc<RefCell<Shared<M>>>,
    valid: &ValidLoader<M>,
    (samples, first): (usize, usize),
) -> Result<()>
where
    M: LearnerModel,
    <M as TrainStep>::Output: GlobalOutput,
    <M as InferenceStep>::Output: GlobalOutput,
{
    let part = fit.strategy.ps.unwrap_or(super::PsPart {
        root: run.rank() == 0,
        first_worker: false,
    });
    fit.shows_train = part.first_worker;
    fit.shows_valid = part.root;
    let per_epoch = run.per_epoch().max(1);
    let batch = run.config().data.batch_size;
    let per_round = batch * run.config().topology.local_steps.max(1);
    // The first worker's items in an epoch of rounds.
    let items = (per_epoch as usize * per_round).min(samples);
    let (mut epoch, mut iteration) = (first, 0usize);
    // Whether an epoch's training split is open: a worker of an asynchronous server may be
    // stopped before its last epoch of rounds ends (the others went faster).
    let mut open = true;
    fit.train_event(LearnerEvent::StartSplit {
        epoch_number: epoch,
        total_items: items,
    });
    while let Some(p) = run.step(&mut Quiet)? {
        let outputs = std::mem::take(&mut shared.borrow_mut().outputs);
        for out in outputs {
            iteration += 1;
            let progress = Progress {
                items_processed: (iteration * batch).min(items),
                items_total: items,
                unit: Some("items".into()),
            };
            let lr = Some(shared.borrow().learner.lr_current());
            let item = TrainingItem::new(out, progress, Some(iteration), lr);
            fit.train_event(LearnerEvent::ProcessedItem(item));
        }
        // A server's step that only answered a pull completed no round.
        if !p.progressed || (p.step % per_epoch != 0 && p.step < p.total) {
            continue;
        }
        fit.train_event(LearnerEvent::EndSplit(epoch));
        open = false;
        let stop = if fit.shows_valid {
            run.prepare_model(&mut Quiet)?;
            let learner = shared.borrow().learner.clone();
            fit.end_epoch(&learner, valid, epoch)?
        } else {
            fit.train_event(LearnerEvent::EndEpoch(epoch));
            false
        };
        if stop {
            run.stop(&mut Quiet, "the Learner stopped")?;
        } else if p.step < p.total {
            (epoch, iteration, open) = (epoch + 1, 0, true);
            fit.train_event(LearnerEvent::StartSplit {
                epoch_number: epoch,
                total_items: items,
            });
        }
    }
    if open && !fit.shows_valid {
        fit.train_event(LearnerEvent::EndSplit(epoch));
        fit.train_event(LearnerEvent::EndEpoch(epoch));
    }
    run.finish(&mut Quiet)?;
    Ok(())
}
