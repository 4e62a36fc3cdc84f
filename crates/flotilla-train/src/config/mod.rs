//! The run configuration: one YAML file with everything the CLI accepts, in sections (one
//! file each here). Unknown keys are errors, not silently ignored. Every key is declared once
//! in [`keys`] (its aliases, environment names and flag); [`sources`] builds a config from
//! defaults < file < environment < flags, remembering where each value came from.

use flotilla_engine::OptimizerSpec;
use serde::{Deserialize, Serialize};

mod allreduce;
mod comm;
mod data;
mod hash;
pub mod keys;
mod model;
mod pipeline;
mod retired;
mod schedule;
pub mod sources;
mod suggest;
mod telemetry;
mod tls;
mod to_env;
mod topology;
mod validate;

pub use allreduce::{AllReduceMode, AllReduceSection, StaleCorrection};
pub use comm::{Backend, CommSection};
pub use data::{DataSection, DataSource, TEXT_PREFIX};
pub use hash::PER_RANK;
pub use model::ModelSection;
pub use pipeline::{PipelineSection, StageHostSetting, StagesSetting};
pub use schedule::{LrSchedule, ScheduleSection};
pub use telemetry::TelemetrySection;
pub use tls::TlsSetting;
pub use topology::{Elasticity, TopologySection};

/// Everything a training run needs, in sections. Every field has a default, so an empty
/// file is a valid config (LeNet-5 on the vendored MNIST, 2 ranks). Build it with
/// [`sources::Sources`] (defaults < file < environment < flags); the flat keys of
/// earlier versions and of hcddl (`lr`, `batch_size`, `arch`, ...) are accepted as aliases.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// The model.
    pub model: ModelSection,
    /// The data set and batching.
    pub data: DataSection,
    /// Optimizer and learning rate (the only place for the learning rate).
    pub optimizer: OptimizerSpec,
    /// Duration, learning-rate schedule, evaluation, checkpoints, stopping.
    pub schedule: ScheduleSection,
    /// Processes and their roles.
    pub topology: TopologySection,
    /// Pipeline stages, micro-batches and schedule (with `topology.arch: pipeline`).
    pub pipeline: PipelineSection,
    /// Sync or async all-reduce, the background cycle, the stall inspector.
    pub allreduce: AllReduceSection,
    /// Rendezvous, deadlines, wire.
    pub comm: CommSection,
    /// Output.
    pub telemetry: TelemetrySection,
}

impl TrainConfig {
    /// The learning rate of the run (the optimizer's).
    pub fn base_lr(&self) -> f64 {
        self.optimizer.lr()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_file_is_all_defaults() {
        let c = TrainConfig::from_yaml("", "t").expect("parse");
        assert_eq!(c, TrainConfig::default());
        assert_eq!(
            TrainConfig::from_yaml("# nothing\n", "t").expect("comment"),
            c
        );
        let spec = c.validate().expect("valid");
        assert_eq!(spec.name, "lenet5");
    }

    #[test]
    fn unknown_keys_are_errors_naming_the_key() {
        let e = TrainConfig::from_yaml("epochs: 2\nbatchsize: 32\n", "run.yaml")
            .expect_err("unknown")
            .to_string();
        assert!(e.contains("run.yaml") && e.contains("batchsize"), "{e}");
        let e = TrainConfig::from_yaml("optimizer: {name: sgd, lr: 0.1, momentun: 0.9}\n", "r")
            .expect_err("unknown nested")
            .to_string();
        assert!(e.contains("momentun"), "{e}");
    }

    #[test]
    fn shipped_examples_parse() {
        for name in [
            "mnist-lenet5.yaml",
            "mnist-mlp.yaml",
            "mnist-pipeline.yaml",
            "ps-flat-sync.yaml",
            "ps-flat-async.yaml",
            "ps-hierarchical.yaml",
            "ps-hierarchical-async.yaml",
        ] {
            let path = std::env::var_os("CARGO_MANIFEST_DIR")
                .map(std::path::PathBuf::from)
                .unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into())
                .join("../../examples")
                .join(name);
            let c = TrainConfig::load(&path).expect("example parses");
            c.validate().expect("example is valid");
        }
    }
}
