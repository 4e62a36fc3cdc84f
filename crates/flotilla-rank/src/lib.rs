//! One rank of a Flotilla job as a process runs it — `flotilla train` and a user's program
//! (`flotilla_burn::train`) alike: its telemetry ([`telemetry`]: tracing, the timeline, the
//! `/metrics` endpoint), its display ([`progress`]: a bar, plain lines, or events for a
//! supervising launcher), the run itself ([`flotilla_train::run()`]), and rank 0's report
//! ([`report`]: `summary.json` and the plots of [`plots`]).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod error;
pub mod plots;
pub mod progress;
pub mod report;
pub mod telemetry;
mod threads;

use std::path::{Path, PathBuf};

use flotilla_engine::EvalStats;
use flotilla_telemetry::RankEvent;
use flotilla_train::job_data::JobData;
use flotilla_train::{ModelSource, Progress, RunSummary, TrainConfig};

pub use error::{RankError, Result};

/// Runs this process's rank of the job `config` describes, training `model`: telemetry
/// started, progress shown, and at the end the checkpoint's place, rank 0's report and the
/// final line printed (the launcher reads them). `rank`: this process's rank (`None`:
/// assigned at the rendezvous). A [`Session`] stepped to its end.
pub fn run(
    config: &TrainConfig,
    model: &dyn ModelSource,
    rank: Option<usize>,
) -> Result<RunSummary> {
    let mut session = Session::start(config, model, None, rank)?;
    while session.step()?.is_some() {}
    session.finish()
}

/// One rank of a job as a process runs it, driven step by step by the caller's own loop: the
/// run of [`flotilla_train::Run`] with this process's telemetry (the timeline, `/metrics`)
/// and display, and at [`Session::finish`] what [`run`] prints and writes (the checkpoint's
/// place, rank 0's report, the final line). An error of any call names the rank to blame, if
/// another, on the line the launcher reads.
pub struct Session {
    inner: Option<flotilla_train::Run>,
    observer: progress::TrainObserver,
    config: TrainConfig,
    /// Rank, world size and role.
    place: (usize, usize, &'static str),
}

impl Session {
    /// Starts the telemetry and joins the job to train `model` on `data` (`None`: what
    /// `data.path` names; see [`flotilla_train::Run::start`]). The calling thread, which is
    /// to step the run, becomes worker 0 of a rayon pool of its own for the rest of its life
    /// (of `RAYON_NUM_THREADS` threads), so that the steps' splits run on it rather than
    /// being handed to the global pool and waited for.
    pub fn start(
        config: &TrainConfig,
        model: &dyn ModelSource,
        data: Option<JobData>,
        rank: Option<usize>,
    ) -> Result<Session> {
        threads::join_own_pool()?;
        let rank_telemetry = telemetry::init(Some((config, rank)))?;
        let t = &config.telemetry;
        let mut observer =
            progress::TrainObserver::new(rank_telemetry, t.metrics_port, &t.metrics_addr);
        let started = flotilla_train::Run::start(config, model, data, rank, &mut observer);
        let inner = match started {
            Ok(inner) => inner,
            Err(e) => {
                observer.finish();
                return Err(fail(e));
            }
        };
        Ok(Session {
            place: (inner.rank(), inner.world_size(), inner.role()),
            inner: Some(inner),
            observer,
            config: config.clone(),
        })
    }

    /// This process's rank (see [`flotilla_train::Run::rank`]).
    pub fn rank(&self) -> usize {
        self.place.0
    }

    /// Ranks in the job.
    pub fn world_size(&self) -> usize {
        self.place.1
    }

    /// This rank's role (see [`flotilla_train::Run::role`]).
    pub fn role(&self) -> &'static str {
        self.place.2
    }

    /// The newest training loss (NaN before the first, or once the run has failed).
    pub fn train_loss(&self) -> f64 {
        self.inner.as_ref().map_or(f64::NAN, |s| s.train_loss())
    }

    /// The last evaluation of the run, if this role evaluates and has.
    pub fn last_eval(&self) -> Option<EvalStats> {
        self.inner.as_ref().and_then(|s| s.last_eval())
    }

    /// One unit of this rank's part of the run; `None` once the run has ended (see
    /// [`flotilla_train::Run::step`]).
    pub fn step(&mut self) -> Result<Option<Progress>> {
        let r = self.call(|s, o| s.step(o))?;
        Ok(r.flatten())
    }

    /// Ends the run after this step for `reason` (see [`flotilla_train::Run::stop`]).
    pub fn stop(&mut self, reason: &str) -> Result<()> {
        self.call(|s, o| s.stop(o, reason)).map(drop)
    }

    /// Evaluates the current model now (see [`flotilla_train::Run::evaluate`]).
    pub fn evaluate(&mut self) -> Result<Option<EvalStats>> {
        Ok(self.call(|s, o| s.evaluate(o))?.flatten())
    }

    /// Writes a checkpoint now (see [`flotilla_train::Run::checkpoint`]).
    pub fn checkpoint(&mut self) -> Result<Option<PathBuf>> {
        Ok(self.call(|s, o| s.checkpoint(o))?.flatten())
    }

    /// Writes the whole model's parameters to `path` now (see
    /// [`flotilla_train::Run::save_model`]); the rank that writes gets the file.
    pub fn save_model(&mut self, path: &Path) -> Result<Option<PathBuf>> {
        Ok(self.call(|s, o| s.save_model(o, path))?.flatten())
    }

    /// The end of the run (see [`flotilla_train::Run::finish`]), and what a rank prints
    /// and writes at its end.
    pub fn finish(mut self) -> Result<RunSummary> {
        let Some(inner) = self.inner.take() else {
            return Err(flotilla_train::TrainError::config(
                "session",
                "the run has already failed".to_string(),
            )
            .into());
        };
        let result = inner.finish(&mut self.observer);
        self.observer.finish();
        let summary = match result {
            Ok(s) => s,
            Err(e) => return Err(fail(e)),
        };
        if let Some(dir) = &summary.checkpoint {
            println!("checkpoint: {}", dir.display());
        }
        if summary.rank == 0 {
            let written = report::write_run(&self.config, &summary)?;
            let paths: Vec<String> = written.iter().map(|p| p.display().to_string()).collect();
            println!("report: {}", paths.join(", "));
        }
        if self.observer.emits_events() {
            let event = RankEvent::Finished {
                role: summary.role.to_string(),
                figures: summary.figures.clone(),
            };
            println!("{}", event.line());
        }
        println!("{}", summary.final_line());
        Ok(summary)
    }

    /// `f` on the run; an error ends it (the display and telemetry closed, the rank to blame
    /// named as [`fail`] does). `None` once it has failed before.
    fn call<T>(
        &mut self,
        f: impl FnOnce(
            &mut flotilla_train::Run,
            &mut dyn flotilla_train::Observer,
        ) -> flotilla_train::Result<T>,
    ) -> Result<Option<T>> {
        let Some(inner) = self.inner.as_mut() else {
            return Ok(None);
        };
        match f(inner, &mut self.observer) {
            Ok(v) => Ok(Some(v)),
            Err(e) => {
                self.inner = None;
                self.observer.finish();
                Err(fail(e))
            }
        }
    }
}

/// A failed run's error, after the line naming the rank to blame (if another) is printed for
/// the launcher.
fn fail(e: flotilla_train::TrainError) -> RankError {
    if let Some(blamed) = e.blamed_rank() {
        println!("{}", RankEvent::Failed { blamed }.line());
    }
    e.into()
}
