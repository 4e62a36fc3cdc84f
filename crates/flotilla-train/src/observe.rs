//! What a run tells its front end (progress bars, status lines) as it goes.

/// Progress events for a terminal front end (progress bars, status lines).
pub trait Observer {
    /// Called after every optimizer step.
    fn step(&mut self, event: &StepEvent);
    /// Called with every line written to `run.log` that the console shows too (not the
    /// per-round timings and end-of-run figures logged quietly).
    fn message(&mut self, line: &str);
    /// Called once the rank is connected and knows its place: rank, world size and role
    /// (`peer`, `root`, `shard-server`, `global-server`, `local-server`, `worker`).
    fn started(&mut self, rank: usize, world: usize, role: &str) {
        let _ = (rank, world, role);
    }
}

/// An observer that ignores everything.
pub struct Quiet;

impl Observer for Quiet {
    fn step(&mut self, _: &StepEvent) {}
    fn message(&mut self, _: &str) {}
}

/// One finished step.
#[derive(Debug, Clone, Copy)]
pub struct StepEvent {
    /// 0-based epoch.
    pub epoch: u32,
    /// Epochs in the run.
    pub epochs: u32,
    /// Steps done in this epoch.
    pub step_in_epoch: u64,
    /// Steps per epoch.
    pub steps_per_epoch: u64,
    /// Steps done in the run.
    pub step: u64,
    /// Steps the run will take.
    pub total_steps: u64,
    /// Global mean loss of this step.
    pub loss: f32,
}
