//! [`LearnerStrategy`]'s loop through the one stack's run, for the ways of training the run
//! implements and the strategy's own loop does not (async all-reduce, parameter servers,
//! model averaging): the run draws each step's batch (sample indices, sharded and reshuffled
//! as a job's data) and runs the configured strategy on the `Learner`'s model
//! ([`super::engine::LearnerEngine`]). For all-reduce peers this loop gathers each step's
//! outputs for rank 0's metrics and, at each epoch's end, drains the run and lets the
//! `Learner` validate, checkpoint and decide to stop, as the sync loop does; the members of
//! an elastic job go through [`super::elastic`], a parameter server's ranks through
//! [`super::rounds`].

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;

use burn::data::dataloader::Progress;
use burn::train::{
    InferenceStep, Learner, LearnerEvent, LearnerModel, SupervisedTrainingEventProcessor,
    TrainStep, TrainingComponents, TrainingItem, ValidLoader,
};
use flotilla_train::job_data::JobData;
use flotilla_train::{Quiet, Run};

use super::LearnerStrategy;
use super::engine::Shared;
use super::fit::{Fit, fail};
use super::global_output::GlobalOutput;
use super::source::{IndexSamples, LearnerSource};
use crate::error::Result;

/// The `Learner` trained through the run (see the module docs); its model and event processor.
pub(super) fn fit<M>(
    strategy: &LearnerStrategy,
    c: TrainingComponents<M>,
    learner: Learner<M>,
    valid: &ValidLoader<M>,
    starting_epoch: usize,
) -> (M, SupervisedTrainingEventProcessor<M>)
where
    M: LearnerModel,
    <M as TrainStep>::Output: GlobalOutput,
    <M as InferenceStep>::Output: GlobalOutput,
{
    let shared = Rc::new(RefCell::new(Shared {
        learner,
        outputs: Vec::new(),
        store: c.event_store.clone(),
    }));
    let started = start(strategy, c.num_epochs, &shared, starting_epoch);
    let (run, samples) = match started {
        Ok(started) => started,
        Err(e) => {
            fail(&c, strategy.rank(), e.to_string());
            return (into_learner(shared).model(), c.event_processor);
        }
    };
    let elastic = super::elastic(&strategy.settings);
    let at = (samples, starting_epoch);
    let driven = if run.role() == "peer" && !elastic {
        let mut fit = Fit::new(strategy, c, Some(run.group()));
        let driven = drive(&mut fit, run, &shared, valid, at);
        (fit.c, driven)
    } else {
        // Each rank decides alone: no collective of the Learner's loop on the run's group.
        let mut fit = Fit::new(strategy, c, None);
        let driven = match elastic {
            true => super::elastic::drive(&mut fit, run, &shared, valid, at),
            false => super::rounds::drive(&mut fit, run, &shared, valid, at),
        };
        (fit.c, driven)
    };
    if let (c, Err(e)) = &driven {
        fail(c, strategy.rank(), e.to_string());
    }
    (into_learner(shared).model(), driven.0.event_processor)
}

pub(super) fn into_learner<M: LearnerModel>(shared: Rc<RefCell<Shared<M>>>) -> Learner<M> {
    match Rc::try_unwrap(shared) {
        Ok(cell) => cell.into_inner().learner,
        Err(shared) => shared.borrow().learner.clone(),
    }
}

/// The run of the job's settings for `epochs` epochs of the registered training set; its
/// number of samples.
pub(super) fn start<M>(
    strategy: &LearnerStrategy,
    epochs: usize,
    shared: &Rc<RefCell<Shared<M>>>,
    starting_epoch: usize,
) -> Result<(Run, usize)>
where
    M: LearnerModel,
    <M as TrainStep>::Output: GlobalOutput,
{
    let settings = &strategy.settings;
    if starting_epoch > 1 {
        super::way::resumable(settings)?;
    }
    let data = strategy.train_data::<<M as TrainStep>::Input>()?;
    let mut config = strategy.settings.clone();
    config.schedule.epochs = u32::try_from(epochs).unwrap_or(u32::MAX);
    config.schedule.max_steps = None;
    config.schedule.num_server_rounds = None;
    // The Learner validates: the run evaluates only at its end (its engine counts no test
    // samples there, which its divergence check takes as no evidence).
    config.schedule.eval_every = Some(0);
    config.schedule.eval_every_steps = None;
    let source = LearnerSource {
        shared: shared.clone(),
        make: data.make,
        device: strategy.device.clone(),
    };
    let train = Arc::new(IndexSamples::new(data.len)?);
    let job = JobData::given(&config, &source, train, Box::new(IndexSamples::new(1)?))?
        .starting_at_epoch(u32::try_from(starting_epoch.saturating_sub(1)).unwrap_or(u32::MAX));
    let run = Run::start(
        &config,
        &source,
        Some(job),
        strategy.launcher_rank,
        &mut Quiet,
    )?;
    Ok((run, data.len))
}

/// Steps the run to its end: each step's outputs to rank 0's metrics, each epoch's end to
/// the `Learner`.
fn drive<M>(
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
    let batch = run.config().data.batch_size * run.world_size();
    // The run's 0-based epoch of the data, and the Learner's 1-based one that starts.
    let mut epoch = u32::try_from(first.saturating_sub(1)).unwrap_or(u32::MAX);
    let mut iteration = 0usize;
    fit.train_event(LearnerEvent::StartSplit {
        epoch_number: first,
        total_items: samples,
    });
    while let Some(p) = run.step(&mut Quiet)? {
        iteration += 1;
        let out = std::mem::take(&mut shared.borrow_mut().outputs).pop();
        if let Some(item) = fit.global_output(out)? {
            let progress = Progress {
                items_processed: (iteration * batch).min(samples),
                items_total: samples,
                unit: Some("items".into()),
            };
            let lr = Some(shared.borrow().learner.lr_current());
            let item = TrainingItem::new(item, progress, Some(iteration), lr);
            fit.train_event(LearnerEvent::ProcessedItem(item));
        }
        if !run.at_epoch_end() {
            continue;
        }
        let ended = epoch as usize + 1;
        (epoch, iteration) = (p.epoch, 0);
        fit.train_event(LearnerEvent::EndSplit(ended));
        run.prepare_model(&mut Quiet)?;
        let learner = shared.borrow().learner.clone();
        let stop = fit.agree_stop(false)? || fit.end_epoch(&learner, valid, ended)?;
        if stop {
            run.stop(&mut Quiet, "the Learner stopped")?;
        } else if p.step < p.total {
            fit.train_event(LearnerEvent::StartSplit {
                epoch_number: ended + 1,
                total_items: samples,
            });
        }
    }
    run.finish(&mut Quiet)?;
    Ok(())
}
