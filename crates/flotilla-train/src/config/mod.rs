//! The run configuration: one YAML file with everything the CLI accepts. Unknown keys are
//! errors, not silently ignored.

use std::path::PathBuf;
use std::time::Duration;

use flotilla_cluster::{Arch, GlobalServerSpec, ServerSpec, Topology, TopologySpec};
use flotilla_comm::{CommConfig, Compression, Secret, WireFormat};
use flotilla_engine::{ModelSpec, OptimizerSpec};
use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};

mod allreduce;
mod tls;
use crate::pipeline::Schedule;
pub use allreduce::{AllReduceMode, AllReduceSection, StaleCorrection};
pub use tls::TlsSetting;

/// Payload compression on the wire, as written in a config.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CompressionSetting {
    /// No compression.
    #[default]
    None,
    /// LZ4 on large frames.
    Lz4,
}

/// All-reduce element format on the wire, as written in a config.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WireSetting {
    /// Exact `f32`.
    #[default]
    F32,
    /// `bf16` on the wire (half the bytes, approximate sums).
    Bf16,
}

/// Which implementation of the process group a run uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// Flotilla's own TCP transport with its rendezvous (any launcher, or none).
    #[default]
    Tcp,
    /// MPI (Open MPI through rsmpi): start the job with `mpirun -np N flotilla train ...`;
    /// rank and world size come from MPI. Needs a binary built with the `mpi` feature.
    Mpi,
}

/// How the learning rate changes over the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LrSchedule {
    /// The optimizer's `lr` throughout.
    Constant,
    /// Cosine decay from `lr` to 0 over the run's steps (after the warm-up).
    #[default]
    Cosine,
}

impl LrSchedule {
    /// The learning rate at `step` (0-based) of `total` steps, with a linear warm-up over the
    /// first `warmup` steps.
    pub fn lr_at(self, base: f64, step: u64, total: u64, warmup: u64) -> f64 {
        if step < warmup {
            return base * (step + 1) as f64 / warmup as f64;
        }
        match self {
            LrSchedule::Constant => base,
            LrSchedule::Cosine => {
                let span = total.saturating_sub(warmup).max(1) as f64;
                let t = (step - warmup) as f64 / span;
                base * 0.5 * (1.0 + (std::f64::consts::PI * t.min(1.0)).cos())
            }
        }
    }
}

/// The model and how it is initialised.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelSection {
    /// A built-in model name (`lenet5`, `mlp`) or a path to a model spec file.
    pub spec: String,
    /// Seed of parameter initialisation and of the per-epoch shuffle.
    pub seed: u64,
    /// Backend: `flex` (pure-Rust CPU) or `libtorch` (with the `libtorch` feature).
    pub device: String,
}

impl Default for ModelSection {
    fn default() -> Self {
        Self {
            spec: "lenet5".into(),
            seed: 42,
            device: "flex".into(),
        }
    }
}

/// The data set and batching.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataSection {
    /// Directory holding the four MNIST-layout IDX files.
    pub path: PathBuf,
    /// Samples per step on each rank (the global batch is `batch_size * world_size`).
    pub batch_size: usize,
    /// Use only the first `train_limit` training samples (for quick runs and tests).
    pub train_limit: Option<usize>,
}

impl Default for DataSection {
    fn default() -> Self {
        Self {
            path: PathBuf::from("data/mnist"),
            batch_size: 64,
            train_limit: None,
        }
    }
}

/// How long to train, the learning-rate schedule, evaluation, checkpoints and stopping.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ScheduleSection {
    /// Passes over the training set.
    pub epochs: u32,
    /// Stop after this many steps in total (for quick runs and tests).
    pub max_steps: Option<u64>,
    /// Learning-rate schedule over the run.
    pub lr_schedule: LrSchedule,
    /// Steps of linear learning-rate warm-up.
    pub warmup_steps: u64,
    /// Evaluate on the test set every this many epochs (0: only at the end). For parameter
    /// servers: every this many server rounds (default: one epoch's worth of rounds).
    pub eval_every: Option<u32>,
    /// Write a checkpoint every this many steps (0: only at the end).
    pub checkpoint_every: u64,
    /// Resume from the newest checkpoint in `telemetry.output` if there is one.
    pub resume: bool,
    /// Parameter servers: stop after this many server rounds (default: `epochs` worth).
    pub num_server_rounds: Option<u64>,
    /// Parameter servers: stop as soon as the root's test accuracy reaches this.
    pub target_accuracy: Option<f64>,
    /// After this many steps (parameter servers: rounds) a run whose test accuracy is at
    /// chance or whose loss is not below its initial value is "not learning" (0: never
    /// check). A NaN or infinite loss is "diverged" at any step. See [`crate::divergence`].
    pub divergence_check_rounds: u64,
    /// What a run that diverged or is not learning does: `true` stops it with an error,
    /// `false` warns and goes on; unset (default) stops on a NaN or infinite loss and warns
    /// when the run is not learning.
    pub abort_on_divergence: Option<bool>,
}

impl Default for ScheduleSection {
    fn default() -> Self {
        Self {
            epochs: 5,
            max_steps: None,
            lr_schedule: LrSchedule::Cosine,
            warmup_steps: 300,
            eval_every: None,
            checkpoint_every: 0,
            resume: false,
            num_server_rounds: None,
            target_accuracy: None,
            divergence_check_rounds: crate::divergence::DEFAULT_CHECK_ROUNDS,
            abort_on_divergence: None,
        }
    }
}

/// Which processes there are and how they cooperate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TopologySection {
    /// Number of ranks (processes) for all-reduce; parameter-server trees derive theirs.
    pub world_size: usize,
    /// Architecture: `allreduce` (default), `flat` or `hierarchical` parameter servers.
    pub arch: Arch,
    /// Flat parameter server: `{aggr_type: sync|async, num_workers: N}`.
    pub parameter_server: Option<ServerSpec>,
    /// Hierarchical: `{aggr_type, local_servers: [{aggr_type, num_workers}, ...]}`.
    pub global_server: Option<GlobalServerSpec>,
    /// Shard servers of a flat topology (parameters split by balanced byte ranges).
    pub servers: usize,
    /// Async servers: a push more than this many versions stale is refused (pull again).
    pub max_staleness: Option<u64>,
    /// Parameter servers: scale each update's learning rate by `1 / (1 + staleness)`.
    /// Unset: on at async servers (they apply each push on arrival), off at sync ones
    /// ([`crate::ps::staleness`]).
    pub staleness_lr: Option<bool>,
    /// Async servers: the SGD momentum of the server's optimizer, instead of
    /// `optimizer.momentum` (asynchrony adds momentum of its own; [`crate::ps::staleness`]).
    pub async_momentum: Option<f64>,
    /// Parameter servers: local steps per push; more than 1 is model averaging (workers push
    /// weight deltas, the server averages them weighted by samples).
    pub local_steps: usize,
    /// Inventory file (hcddl's `[pool]` ini or a plain host list) for placement checks.
    pub inventory: Option<PathBuf>,
}

impl Default for TopologySection {
    fn default() -> Self {
        Self {
            world_size: 2,
            arch: Arch::Allreduce,
            parameter_server: None,
            global_server: None,
            servers: 1,
            max_staleness: None,
            staleness_lr: None,
            async_momentum: None,
            local_steps: 1,
            inventory: None,
        }
    }
}

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

/// Rendezvous, deadlines and the wire.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CommSection {
    /// The process-group implementation: `tcp` (default) or `mpi` (under `mpirun`, with a
    /// binary built with `--features mpi`; the rendezvous keys, `compression` and
    /// `wire_format` then do not apply).
    pub backend: Backend,
    /// Rendezvous address of rank 0.
    pub master_addr: String,
    /// Rendezvous port of rank 0.
    pub master_port: u16,
    /// Deadline in seconds of every wait on another rank.
    pub timeout_s: f64,
    /// Deadline in seconds for all ranks to join.
    pub join_timeout_s: f64,
    /// Payload compression on the wire.
    pub compression: CompressionSetting,
    /// All-reduce element format on the wire.
    pub wire_format: WireSetting,
    /// Gradient fusion bucket size in MiB.
    pub bucket_mb: f64,
    /// A file holding the cluster secret (mode 0600; not accessible to group or others).
    /// The environment's `FLOTILLA_SECRET` / `FLOTILLA_SECRET_FILE` take precedence. The
    /// secret itself is never a config value or a flag, and never enters the config hash.
    pub secret_file: Option<PathBuf>,
    /// Mutual TLS on every connection: `{ca, cert, key}` ([`TlsSetting`]); the environment's
    /// `FLOTILLA_TLS_CA` / `_CERT` / `_KEY` take precedence. Per rank (never hashed).
    pub tls: Option<TlsSetting>,
}

impl Default for CommSection {
    fn default() -> Self {
        Self {
            backend: Backend::Tcp,
            master_addr: "127.0.0.1".into(),
            master_port: flotilla_comm::DEFAULT_MASTER_PORT,
            timeout_s: 60.0,
            join_timeout_s: 60.0,
            compression: CompressionSetting::None,
            wire_format: WireSetting::F32,
            bucket_mb: 25.0,
            secret_file: None,
            tls: None,
        }
    }
}

/// Where a run writes what it reports.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetrySection {
    /// Directory for checkpoints, metrics and each rank's `run.log`.
    pub output: PathBuf,
    /// Write a Chrome trace of the job here: each rank records
    /// `<output>/rank-N/timeline.jsonl`, and `flotilla launch` merges them into this file at
    /// the end (`flotilla trace merge` does it for ranks started otherwise).
    pub timeline_path: Option<PathBuf>,
    /// Serve Prometheus metrics: rank `r` on port `metrics_port + r`, at `/metrics`.
    pub metrics_port: Option<u16>,
}

impl Default for TelemetrySection {
    fn default() -> Self {
        Self {
            output: PathBuf::from("runs/latest"),
            timeline_path: None,
            metrics_port: None,
        }
    }
}

/// Everything a training run needs, in sections. Every field has a default, so an empty
/// file is a valid config (LeNet-5 on the vendored MNIST, 2 ranks). Build it with
/// [`crate::layers::Layers`] (defaults < file < environment < flags); the flat keys of
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

/// Config paths that may differ between ranks (where a process runs and writes); everything
/// else must agree at rendezvous and enters [`TrainConfig::cluster_hash`].
pub const PER_RANK: &[&str] = &[
    "model.device",
    "data.path",
    "schedule.resume",
    "topology.inventory",
    "comm.master_addr",
    "comm.master_port",
    "comm.timeout_s",
    "comm.join_timeout_s",
    "comm.compression",
    "comm.secret_file",
    "comm.tls",
    "telemetry",
];

impl TrainConfig {
    /// The learning rate of the run (the optimizer's).
    pub fn base_lr(&self) -> f64 {
        self.optimizer.lr()
    }

    /// The topology keys as the cluster crate takes them.
    pub fn topology_spec(&self) -> TopologySpec {
        let t = &self.topology;
        TopologySpec {
            arch: t.arch,
            parameter_server: t.parameter_server.clone(),
            global_server: t.global_server.clone(),
            servers: t.servers,
        }
    }

    /// The process topology: `world_size` peers for all-reduce, else the parameter-server
    /// tree (whose size is what `world_size` becomes).
    pub fn topology(&self) -> Result<Topology> {
        let t = match self.topology.arch {
            Arch::Allreduce => Topology::allreduce(self.topology.world_size),
            Arch::Pipeline => {
                self.topology_spec()
                    .validate()
                    .map_err(|e| TrainError::config("config", e.to_string()))?;
                Topology::pipeline(self.pipeline.num_stages(), self.pipeline.data_parallel)
            }
            _ => Topology::build(&self.topology_spec()),
        };
        t.map_err(|e| TrainError::config("config", e.to_string()))
    }

    /// The number of processes the job needs.
    pub fn effective_world_size(&self) -> Result<usize> {
        Ok(self.topology()?.world_size())
    }

    /// Checks ranges and resolves the model spec; errors name the offending key.
    pub fn validate(&self) -> Result<ModelSpec> {
        self.validate_counts()?;
        self.validate_ranges()?;
        self.validate_topology()?;
        self.optimizer
            .validate()
            .map_err(|e| bad("optimizer", e.to_string()))?;
        flotilla_engine::check_device(&self.model.device)
            .map_err(|e| bad("model.device", e.to_string()))?;
        ModelSpec::resolve(&self.model.spec).map_err(|e| bad("model.spec", e.to_string()))
    }

    /// The counts that must be at least 1.
    fn validate_counts(&self) -> Result<()> {
        let (s, t) = (&self.schedule, &self.topology);
        let at_least_one = |key: &str, ok: bool| {
            if ok {
                Ok(())
            } else {
                Err(bad(key, "must be at least 1".into()))
            }
        };
        at_least_one("schedule.epochs", s.epochs > 0 || s.max_steps.is_some())?;
        at_least_one("data.batch_size", self.data.batch_size > 0)?;
        at_least_one("topology.world_size", t.world_size > 0)?;
        at_least_one("topology.local_steps", t.local_steps > 0)?;
        at_least_one("schedule.num_server_rounds", s.num_server_rounds != Some(0))?;
        at_least_one("data.train_limit", self.data.train_limit != Some(0))
    }

    /// The numbers that must be positive or within a range, and the backend this build has.
    fn validate_ranges(&self) -> Result<()> {
        let (s, t, c) = (&self.schedule, &self.topology, &self.comm);
        if c.backend == Backend::Mpi && !cfg!(feature = "mpi") {
            return Err(TrainError::config(
                "config",
                "`comm.backend: mpi`: this binary was built without the `mpi` feature; rebuild with `cargo build --release --features mpi`",
            ));
        }
        positive("comm.bucket_mb", c.bucket_mb, "number of MiB")?;
        positive("comm.timeout_s", c.timeout_s, "number of seconds")?;
        positive("comm.join_timeout_s", c.join_timeout_s, "number of seconds")?;
        positive("optimizer.lr", self.optimizer.lr(), "number")?;
        if let Some(a) = s.target_accuracy
            && !(0.0..=1.0).contains(&a)
        {
            return Err(bad(
                "schedule.target_accuracy",
                format!("must be in [0, 1], got {a}"),
            ));
        }
        if let Some(m) = t.async_momentum
            && !(0.0..1.0).contains(&m)
        {
            return Err(bad(
                "topology.async_momentum",
                format!("must be in [0, 1), got {m}"),
            ));
        }
        Ok(())
    }

    /// The architecture's own sections, the all-reduce mode it allows, and the placement on
    /// the inventory's hosts.
    fn validate_topology(&self) -> Result<()> {
        let t = &self.topology;
        if t.arch == Arch::Pipeline {
            self.validate_pipeline()?;
        }
        self.allreduce.validate()?;
        if self.allreduce.mode == AllReduceMode::Async && t.arch != Arch::Allreduce {
            return Err(bad(
                "allreduce.mode",
                format!(
                    "async is a mode of data-parallel all-reduce, not of arch {}",
                    t.arch
                ),
            ));
        }
        let topology = self.topology()?;
        if let Some(path) = &t.inventory {
            let inventory = flotilla_cluster::Inventory::load(path)
                .map_err(|e| bad("topology.inventory", e.to_string()))?;
            flotilla_cluster::place(&topology, &inventory)
                .map_err(|e| bad("topology.inventory", e.to_string()))?;
        }
        Ok(())
    }

    /// Checks the pipeline section's own ranges (the cut itself is checked against the model
    /// when it is planned).
    fn validate_pipeline(&self) -> Result<()> {
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

    /// Bucket size in bytes.
    pub fn bucket_bytes(&self) -> usize {
        (self.comm.bucket_mb * (1 << 20) as f64) as usize
    }

    /// A hash of everything all ranks must agree on: the whole config except the
    /// [`PER_RANK`] paths, with the model spec resolved (a file path and the built-in name of
    /// the same model hash alike; two different files of the same name do not).
    pub fn cluster_hash(&self, spec: &ModelSpec) -> u64 {
        let mut shared = serde_json::to_value(self).unwrap_or_default();
        for path in PER_RANK {
            remove_path(&mut shared, path);
        }
        if let Some(m) = shared.get_mut("model").and_then(|m| m.as_object_mut()) {
            m.insert("spec".into(), serde_json::Value::String(spec.to_yaml()));
        }
        xxhash_rust::xxh3::xxh3_64(shared.to_string().as_bytes())
    }

    /// The job's cluster secret: the environment's (`FLOTILLA_SECRET`, `FLOTILLA_SECRET_FILE`),
    /// else the file of `comm.secret_file`; `None` when neither is set.
    pub fn secret(&self) -> Result<Option<Secret>> {
        if let Some(s) = Secret::from_env()? {
            return Ok(Some(s));
        }
        match &self.comm.secret_file {
            Some(path) => Ok(Some(Secret::from_file(path)?)),
            None => Ok(None),
        }
    }

    /// The communicator settings of `rank` (`None`: let rank 0 assign one), with the job's
    /// secret ([`TrainConfig::secret`]) and this rank's TLS ([`TrainConfig::tls`]).
    pub fn comm_config(
        &self,
        rank: Option<usize>,
        hash: u64,
        world_size: usize,
    ) -> Result<CommConfig> {
        let c = &self.comm;
        Ok(CommConfig {
            rank,
            world_size,
            master_addr: c.master_addr.clone(),
            master_port: c.master_port,
            timeout: Duration::from_secs_f64(c.timeout_s),
            join_timeout: Duration::from_secs_f64(c.join_timeout_s),
            config_hash: hash,
            secret: self.secret()?,
            tls: self.tls()?,
            compression: match c.compression {
                CompressionSetting::None => Compression::None,
                CompressionSetting::Lz4 => Compression::Lz4,
            },
            wire_format: match c.wire_format {
                WireSetting::F32 => WireFormat::F32,
                WireSetting::Bf16 => WireFormat::Bf16,
            },
            ..CommConfig::default()
        })
    }
}

/// Removes `a.b.c` from a JSON tree, if present.
fn remove_path(v: &mut serde_json::Value, path: &str) {
    let mut parts: Vec<&str> = path.split('.').collect();
    let Some(last) = parts.pop() else { return };
    let mut cur = v;
    for p in parts {
        match cur.get_mut(p) {
            Some(next) => cur = next,
            None => return,
        }
    }
    if let Some(m) = cur.as_object_mut() {
        m.remove(last);
    }
}

/// A config error naming `key`.
fn bad(key: &str, msg: String) -> TrainError {
    TrainError::config("config", format!("`{key}`: {msg}"))
}

/// `Ok` when `v` is a positive finite number, else an error naming `key`.
fn positive(key: &str, v: f64, what: &str) -> Result<()> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err(bad(key, format!("must be a positive {what}, got {v}")))
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
    fn bad_values_name_the_key() {
        let c = TrainConfig::from_yaml("batch_size: 0\n", "r").expect("parse");
        let e = c.validate().expect_err("zero batch").to_string();
        assert!(e.contains("data.batch_size"), "{e}");
        let c = TrainConfig::from_yaml("model: resnet999\n", "r").expect("parse");
        let e = c.validate().expect_err("model").to_string();
        assert!(e.contains("model") && e.contains("resnet999"), "{e}");
        let c = TrainConfig::from_yaml("optimizer: {name: sgd, lr: -1}\n", "r").expect("parse");
        assert!(c.validate().expect_err("lr").to_string().contains("lr"));
        let c = TrainConfig::from_yaml("device: tpu\n", "r").expect("parse");
        assert!(
            c.validate()
                .expect_err("device")
                .to_string()
                .contains("tpu")
        );
        let e = TrainConfig::from_yaml("epochs: many\n", "r")
            .expect_err("type")
            .to_string();
        assert!(e.contains("epochs"), "{e}");
    }

    #[test]
    fn backend_is_tcp_by_default_and_mpi_needs_the_feature() {
        assert_eq!(TrainConfig::default().comm.backend, Backend::Tcp);
        let c = TrainConfig::from_yaml("backend: mpi\n", "b.yaml").expect("alias");
        assert_eq!(c.comm.backend, Backend::Mpi);
        let c = TrainConfig::from_yaml("comm: {backend: mpi}\n", "b.yaml").expect("section");
        assert_eq!(c.comm.backend, Backend::Mpi);
        let checked = c.validate();
        if cfg!(feature = "mpi") {
            checked.expect("valid with the feature");
        } else {
            let e = checked.expect_err("needs the feature").to_string();
            assert!(
                e.contains("built without the `mpi` feature") && e.contains("--features mpi"),
                "{e}"
            );
        }
        let e = TrainConfig::from_yaml("backend: nccl\n", "b.yaml")
            .expect_err("unknown backend")
            .to_string();
        assert!(e.contains("nccl"), "{e}");
    }

    #[test]
    fn cluster_hash_ignores_per_rank_settings() {
        let a = TrainConfig::default();
        let spec = a.validate().expect("valid");
        let mut b = a.clone();
        b.telemetry.output = "elsewhere".into();
        b.data.path = "other".into();
        b.comm.master_port = 1234;
        b.comm.timeout_s = 5.0;
        b.comm.secret_file = Some("/etc/flotilla/secret".into());
        b.comm.tls = Some(TlsSetting {
            ca: "/etc/flotilla/ca.pem".into(),
            cert: "/etc/flotilla/node1.pem".into(),
            key: "/etc/flotilla/node1.key".into(),
        });
        b.schedule.resume = true;
        assert_eq!(a.cluster_hash(&spec), b.cluster_hash(&spec));
        // Every shared section counts, including fields added later (no list to forget).
        for change in [
            |c: &mut TrainConfig| c.data.batch_size = 32,
            |c: &mut TrainConfig| c.schedule.warmup_steps = 1,
            |c: &mut TrainConfig| c.comm.bucket_mb = 1.0,
            |c: &mut TrainConfig| c.comm.wire_format = WireSetting::Bf16,
            |c: &mut TrainConfig| c.topology.local_steps = 2,
            |c: &mut TrainConfig| c.model.seed = 1,
        ] {
            let mut d = a.clone();
            change(&mut d);
            assert_ne!(a.cluster_hash(&spec), d.cluster_hash(&spec), "{d:?}");
        }
    }

    #[test]
    fn hcddl_keys_are_accepted_as_they_are() {
        let text = "num_server_rounds: 5\ntarget_accuracy: 0.9\nbatch_size: 32\narch: hierarchical\nglobal_server:\n  aggr_type: sync\n  local_servers:\n    - type: async\n      num_workers: 2\n    - aggr_type: async\n      num_workers: 2\n";
        let c = TrainConfig::from_yaml(text, "hcddl.yaml").expect("parse");
        c.validate().expect("valid");
        assert_eq!(c.effective_world_size().expect("size"), 7);
        assert_eq!(c.schedule.num_server_rounds, Some(5));
        let flat = TrainConfig::from_yaml(
            "arch: flat\nparameter_server: {aggr_type: sync, num_workers: 4}\n",
            "f",
        )
        .expect("flat");
        assert_eq!(flat.effective_world_size().expect("size"), 5);
        let missing = TrainConfig::from_yaml("arch: flat\n", "f").expect("parse");
        let e = missing.validate().expect_err("no server").to_string();
        let _ = &c.topology;
        assert!(e.contains("parameter_server"), "{e}");
    }

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

#[cfg(test)]
mod schedule_tests {
    use super::LrSchedule;

    #[test]
    fn cosine_decays_from_base_to_zero_after_warmup() {
        let s = LrSchedule::Cosine;
        assert!((s.lr_at(0.1, 0, 100, 10) - 0.01).abs() < 1e-12);
        assert!((s.lr_at(0.1, 9, 100, 10) - 0.1).abs() < 1e-12);
        assert!((s.lr_at(0.1, 10, 100, 10) - 0.1).abs() < 1e-12);
        assert!((s.lr_at(0.1, 55, 100, 10) - 0.05).abs() < 1e-12);
        assert!(s.lr_at(0.1, 99, 100, 10) < 0.001);
        assert_eq!(LrSchedule::Constant.lr_at(0.1, 50, 100, 0), 0.1);
    }
}
