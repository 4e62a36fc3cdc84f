//! The run loop's bookkeeping with a tiny role on a one-rank in-memory world: what it counts,
//! when it evaluates, records and checkpoints, and when it stops. The role only reports what
//! it was asked (its losses are the step numbers, its accuracy a function of progress), so
//! every number the loop derives is known.

use std::path::PathBuf;
use std::time::Instant;

use flotilla_engine::{EvalStats, ModelState};

use crate::batches::Batches;
use crate::checkpoint::CheckpointState;
use crate::error::{Result, TrainError};
use crate::plan::{Cadence, Counting, LoopPlan};
use crate::runloop::{Finished, run};
use crate::strategy::{Cx, Evaluation, Step, Strategy};
use crate::testkit::{Rank, batches, config, dataset, sgd, world};

/// A role that trains on nothing: each step draws a batch, its loss is the step's number
/// (`done + 1`), and it records every call the loop makes.
struct Tiny {
    evaluation: Evaluation,
    /// Every `idle`-th call completes nothing (a server event that was only a pull).
    idle: Option<u64>,
    calls: u64,
    /// `done` of each step call.
    dones: Vec<u64>,
    /// Progress (completed steps) at each evaluation.
    evaluated_at: Vec<u64>,
    checkpoints: Vec<CheckpointState>,
    stopped: Option<String>,
    /// Progress as the role counts it.
    progress: u64,
    /// Whether its evaluations count samples (a model validated elsewhere counts none).
    counted: bool,
}

impl Tiny {
    fn new(evaluation: Evaluation, idle: Option<u64>, resumed_at: u64) -> Self {
        Self {
            evaluation,
            idle,
            calls: 0,
            dones: Vec::new(),
            evaluated_at: Vec::new(),
            checkpoints: Vec::new(),
            stopped: None,
            progress: resumed_at,
            counted: true,
        }
    }
}

/// Accuracy after `progress` steps: a tenth per step.
fn accuracy(progress: u64) -> f64 {
    progress as f64 / 10.0
}

impl Strategy for Tiny {
    fn name(&self) -> &'static str {
        "tiny"
    }

    fn evaluation(&self) -> Evaluation {
        self.evaluation
    }

    fn model(&mut self) -> Option<&mut dyn ModelState> {
        None
    }

    fn counting(&self) -> Counting {
        Counting::Epochs {
            shards: 1,
            index: 0,
        }
    }

    fn writes_checkpoints(&self) -> bool {
        true
    }

    fn stops_itself(&self) -> bool {
        true
    }

    fn step(&mut self, _cx: &mut Cx<'_>, data: &mut Batches, done: u64) -> Result<Step> {
        self.calls += 1;
        self.dones.push(done);
        if self.idle.is_some_and(|k| self.calls.is_multiple_of(k)) {
            return Ok(Step::default());
        }
        let samples = data.next_batch()?.1.labels.len() as u64;
        self.progress += 1;
        Ok(Step {
            progressed: true,
            loss: Some((done + 1) as f32),
            samples,
            done: None,
        })
    }

    fn stop(&mut self, _cx: &mut Cx<'_>, reason: &str) -> Result<()> {
        self.stopped = Some(reason.to_string());
        Ok(())
    }

    fn evaluate(&mut self, _cx: &mut Cx<'_>) -> Result<EvalStats> {
        self.evaluated_at.push(self.progress);
        if !self.counted {
            return Ok(EvalStats::default());
        }
        // Loss `2 - accuracy`: 2 at the start, falling by a tenth per step.
        Ok(EvalStats {
            loss_sum: 100.0 * (2.0 - accuracy(self.progress)),
            correct: (accuracy(self.progress) * 100.0).round() as usize,
            count: 100,
        })
    }

    fn save_checkpoint(
        &mut self,
        _cx: &mut Cx<'_>,
        state: &CheckpointState,
    ) -> Result<Option<PathBuf>> {
        self.checkpoints.push(state.clone());
        Ok(None)
    }
}

/// Runs `role` for `plan` on 16 samples (4 batches of 4 an epoch) with `set` applied to
/// the config.
fn drive(role: &mut Tiny, plan: &LoopPlan, set: impl FnOnce(&mut crate::TrainConfig)) -> Finished {
    try_drive(role, plan, set).expect("run")
}

/// [`drive`], its error kept.
fn try_drive(
    role: &mut Tiny,
    plan: &LoopPlan,
    set: impl FnOnce(&mut crate::TrainConfig),
) -> Result<Finished> {
    let mut c = config(sgd(0.1, 0.0));
    set(&mut c);
    let comm = world(1).remove(0);
    let mut rank = Rank::new(comm, c, 16);
    rank.rounds = plan.total;
    let data = dataset(16);
    run(role, batches(&data, 1, 0), plan, &mut rank.cx())
}

#[test]
fn an_evaluation_that_counted_no_sample_is_no_evidence_of_not_learning() {
    // Accuracy 0.1 after the first step, below chance for 3 classes: the check (due from step
    // 1, aborting) stops a run whose evaluation counted samples, not one whose counted none.
    let judged = |counted: bool| {
        let mut role = Tiny::new(Evaluation::Collective, None, 0);
        role.counted = counted;
        let plan = plan(4, Cadence::Epochs { every: 1 }, 0);
        try_drive(&mut role, &plan, |c| {
            c.schedule.eval_every_steps = Some(1);
            c.schedule.divergence_check_rounds = 1;
            c.schedule.abort_on_divergence = Some(true);
        })
        .map(|done| done.progress)
    };
    let e = judged(true).expect_err("at chance");
    assert!(matches!(e, TrainError::NotLearning { .. }), "{e}");
    assert_eq!(judged(false).expect("no evidence"), 4);
}

fn plan(total: u64, cadence: Cadence, resumed_at: u64) -> LoopPlan {
    LoopPlan {
        total,
        per_epoch: 1,
        cadence,
        resumed_at,
        model: "mlp2".into(),
        config_hash: 7,
        started: Instant::now(),
        workers: 1,
        async_momentum: None,
    }
}

/// `(step, epoch, step_in_epoch)` of each checkpoint.
fn positions(role: &Tiny) -> Vec<(u64, u32, u64)> {
    role.checkpoints
        .iter()
        .map(|s| (s.step, s.epoch, s.step_in_epoch))
        .collect()
}

#[test]
fn epochs_are_counted_evaluated_and_checkpointed_on_their_cadence() {
    let mut role = Tiny::new(Evaluation::Collective, None, 0);
    let done = drive(&mut role, &plan(10, Cadence::Epochs { every: 2 }, 0), |c| {
        c.schedule.checkpoint_every = 3
    });
    assert_eq!(role.dones, (0..10).collect::<Vec<_>>(), "one call per step");
    assert_eq!(done.progress, 10);
    assert_eq!(done.samples, 40);
    assert_eq!(role.stopped.as_deref(), Some("10 rounds done"));
    // Every second epoch (step 8) and at the end (step 10, a partial third epoch).
    assert_eq!(role.evaluated_at, vec![8, 10]);
    let records: Vec<_> = done
        .history
        .records
        .iter()
        .map(|r| (r.step, r.train_loss, r.test_acc))
        .collect();
    assert_eq!(
        records,
        vec![
            (4, Some(2.5), None),
            (8, Some(6.5), Some(0.8)),
            (10, Some(9.5), Some(1.0)),
        ],
        "epoch ends: mean loss of the epoch's steps, accuracy when evaluated"
    );
    let losses: Vec<_> = done
        .history
        .losses
        .iter()
        .map(|l| (l.step, l.loss))
        .collect();
    assert_eq!(losses, (1..=10).map(|s| (s, s as f64)).collect::<Vec<_>>());
    assert_eq!(done.train_loss, 9.5);
    assert_eq!(done.eval.map(|e| e.correct), Some(100));
    // Every third step, then the final one, each at its place in the data.
    assert_eq!(
        positions(&role),
        vec![(3, 0, 3), (6, 1, 2), (9, 2, 1), (10, 2, 2)]
    );
    assert_eq!(role.checkpoints[3].test_acc, Some(1.0));
}

#[test]
fn rounds_count_only_progress_evaluate_every_k_and_stop_at_the_target() {
    // Resumed at round 2; every third call completes nothing; evaluation every 3 rounds.
    let mut role = Tiny::new(Evaluation::Local, Some(3), 2);
    let done = drive(&mut role, &plan(20, Cadence::Rounds { every: 3 }, 2), |c| {
        c.schedule.target_accuracy = Some(0.55)
    });
    // Call 3 completes nothing, so `done` repeats after it.
    assert_eq!(role.dones, vec![2, 3, 4, 4, 5]);
    assert_eq!(done.progress, 6, "rounds 3..=6 after the resume");
    assert_eq!(done.samples, 4 * 4);
    // Round 3 (0.3) and round 6 (0.6 >= 0.55, which stops the run); the final evaluation
    // of a local evaluator is not recorded twice.
    assert_eq!(role.evaluated_at, vec![3, 6, 6]);
    assert_eq!(
        role.stopped.as_deref(),
        Some("test accuracy 0.6000 reached target 0.55")
    );
    let records: Vec<_> = done
        .history
        .records
        .iter()
        .map(|r| (r.step, r.test_acc))
        .collect();
    assert_eq!(records, vec![(3, Some(0.3)), (6, Some(0.6))]);
    assert_eq!(
        positions(&role),
        vec![(6, 0, 4)],
        "only the final checkpoint"
    );
}

#[test]
fn peers_evaluate_every_k_steps_within_an_epoch_and_stop_at_the_target_loss() {
    // 4 steps an epoch; evaluation every 3 steps and at epoch ends; loss 2 - step / 10;
    // target_loss is checked at both.
    let mut role = Tiny::new(Evaluation::Collective, None, 0);
    let done = drive(&mut role, &plan(20, Cadence::Epochs { every: 1 }, 0), |c| {
        c.schedule.eval_every_steps = Some(3);
        c.schedule.target_loss = Some(1.35);
    });
    // Steps 3 (1.7), 4 (epoch end, 1.6), 6 (1.4), 8 (epoch end, 1.2 <= 1.35: stops).
    assert_eq!(role.evaluated_at, vec![3, 4, 6, 8]);
    assert_eq!(done.progress, 8);
    assert_eq!(
        role.stopped.as_deref(),
        Some("test loss 1.2000 reached target 1.35")
    );
    let records: Vec<_> = done
        .history
        .records
        .iter()
        .map(|r| (r.step, r.test_loss.map(|l| (l * 10.0).round() / 10.0)))
        .collect();
    assert_eq!(
        records,
        vec![
            (3, Some(1.7)),
            (4, Some(1.6)),
            (6, Some(1.4)),
            (8, Some(1.2))
        ]
    );
    // The last evaluation is the final one (not repeated).
    assert_eq!(done.eval.map(|e| e.correct), Some(80));
}
