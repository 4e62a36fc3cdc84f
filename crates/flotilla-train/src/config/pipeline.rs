//! The `pipeline:` section: pipeline (model) parallelism — stages, micro-batches, schedule,
//! replicas — and its own checks.

use serde::{Deserialize, Serialize};

use super::TrainConfig;
use super::validate::bad;
use crate::error::Result;
use crate::pipeline::Schedule;

/// How a pipeline's stages are chosen (`pipeline.stages`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum StagesSetting {
    /// This many stages, cut automatically by measured per-layer cost within each host's
    /// memory (`stages: 2`).
    Count(usize),
    /// Explicit stages as inclusive layer ranges (`stages: [[0, 7], [8, 15]]`).
    Ranges(Vec<[usize; 2]>),
}

/// What one stage's host offers, for the automatic partition and the memory check.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StageHostSetting {
    /// Memory the stage may use, in MiB (absent: unlimited).
    pub memory_mb: Option<f64>,
    /// Relative speed (1.0: the machine that profiles the model).
    pub speed: f64,
}

impl Default for StageHostSetting {
    fn default() -> Self {
        Self {
            memory_mb: None,
            speed: 1.0,
        }
    }
}

/// Pipeline (model) parallelism, with `topology.arch: pipeline` (`strategy: pipeline`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PipelineSection {
    /// A number of stages (cut automatically) or explicit inclusive layer ranges.
    pub stages: StagesSetting,
    /// Or: the first layer of every stage but the first (`split_points: [8]`).
    pub split_points: Option<Vec<usize>>,
    /// Micro-batches per batch (M); `data.batch_size` is cut into this many.
    pub micro_batches: usize,
    /// Micro-batch schedule: `gpipe` or `1f1b`.
    pub schedule: Schedule,
    /// Replicas of every stage (D): the job has `stages × data_parallel` ranks, and the
    /// replicas of a stage average their gradients.
    pub data_parallel: usize,
    /// Each stage's host capacity, in stage order (absent: unlimited memory, speed 1).
    pub hosts: Vec<StageHostSetting>,
}

impl Default for PipelineSection {
    fn default() -> Self {
        Self {
            stages: StagesSetting::Count(2),
            split_points: None,
            micro_batches: 4,
            schedule: Schedule::OneFOneB,
            data_parallel: 1,
            hosts: Vec::new(),
        }
    }
}

impl PipelineSection {
    /// The number of stages the settings ask for.
    pub fn num_stages(&self) -> usize {
        match (&self.split_points, &self.stages) {
            (Some(points), _) => points.len() + 1,
            (None, StagesSetting::Count(n)) => *n,
            (None, StagesSetting::Ranges(r)) => r.len(),
        }
    }
}

impl TrainConfig {
    /// Checks the pipeline section's own ranges (the cut itself is checked against the model
    /// when it is planned).
    pub(super) fn validate_pipeline(&self) -> Result<()> {
        let p = &self.pipeline;
        if p.num_stages() == 0 {
            return Err(bad("pipeline.stages", "must be at least 1".into()));
        }
        if p.micro_batches == 0 {
            return Err(bad("pipeline.micro_batches", "must be at least 1".into()));
        }
        if p.data_parallel == 0 {
            return Err(bad("pipeline.data_parallel", "must be at least 1".into()));
        }
        if self.data.batch_size < p.micro_batches {
            return Err(bad(
                "pipeline.micro_batches",
                format!(
                    "{} micro-batches do not fit in a batch of {} (data.batch_size)",
                    p.micro_batches, self.data.batch_size
                ),
            ));
        }
        if p.split_points.is_some() && matches!(p.stages, StagesSetting::Ranges(_)) {
            return Err(bad(
                "pipeline.split_points",
                "give either `stages` as ranges or `split_points`, not both".into(),
            ));
        }
        if !p.hosts.is_empty() && p.hosts.len() != p.num_stages() {
            return Err(bad(
                "pipeline.hosts",
                format!(
                    "lists {} hosts for {} stages (one per stage, in order)",
                    p.hosts.len(),
                    p.num_stages()
                ),
            ));
        }
        for (i, h) in p.hosts.iter().enumerate() {
            if !(h.speed.is_finite() && h.speed > 0.0) {
                return Err(bad(
                    &format!("pipeline.hosts[{i}].speed"),
                    format!("must be a positive number, got {}", h.speed),
                ));
            }
            if let Some(m) = h.memory_mb
                && !(m.is_finite() && m > 0.0)
            {
                return Err(bad(
                    &format!("pipeline.hosts[{i}].memory_mb"),
                    format!("must be a positive number of MiB, got {m}"),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_cluster::Arch;

    #[test]
    fn pipeline_keys_and_their_errors() {
        let text =
            "strategy: pipeline\nstages: 3\nschedule: gpipe\nmicro_batches: 8\ndata_parallel: 2\n";
        let c = TrainConfig::from_yaml(text, "p.yaml").expect("parse");
        c.validate().expect("valid");
        assert_eq!(c.topology.arch, Arch::Pipeline);
        assert_eq!(c.pipeline.schedule, Schedule::GPipe);
        assert_eq!(c.effective_world_size().expect("size"), 6);
        // The `schedule` section is still a section.
        let c = TrainConfig::from_yaml("schedule: {epochs: 2}\n", "s").expect("section");
        assert_eq!(c.schedule.epochs, 2);
        let ranges = TrainConfig::from_yaml("arch: pipeline\nstages: [[0, 3], [4, 11]]\n", "r")
            .expect("ranges");
        assert_eq!(
            ranges.pipeline.stages,
            StagesSetting::Ranges(vec![[0, 3], [4, 11]])
        );
        assert_eq!(ranges.effective_world_size().expect("size"), 2);
        let points =
            TrainConfig::from_yaml("arch: pipeline\nsplit_points: [4, 8]\n", "s").expect("points");
        assert_eq!(points.effective_world_size().expect("size"), 3);
        for (text, key) in [
            (
                "strategy: pipeline\nmicro_batches: 0\n",
                "pipeline.micro_batches",
            ),
            (
                "strategy: pipeline\nmicro_batches: 128\n",
                "pipeline.micro_batches",
            ),
            (
                "strategy: pipeline\ndata_parallel: 0\n",
                "pipeline.data_parallel",
            ),
            ("strategy: pipeline\nstages: 0\n", "pipeline.stages"),
            (
                "strategy: pipeline\nstages: [[0, 3], [4, 11]]\nsplit_points: [4]\n",
                "pipeline.split_points",
            ),
            (
                "strategy: pipeline\nstages: 2\npipeline: {hosts: [{memory_mb: 64}]}\n",
                "pipeline.hosts",
            ),
            (
                "strategy: pipeline\npipeline: {hosts: [{speed: 0}, {}]}\n",
                "pipeline.hosts[0].speed",
            ),
            (
                "strategy: pipeline\nparameter_server: {aggr_type: sync, num_workers: 2}\n",
                "parameter_server",
            ),
            ("strategy: pipeline\nschedule: 2f2b\n", "2f2b"),
        ] {
            let e = TrainConfig::from_yaml(text, "p")
                .and_then(|c| c.validate().map(|_| ()))
                .expect_err(text)
                .to_string();
            assert!(e.contains(key), "{text}: {e}");
        }
    }
}
