//! The run configuration: one YAML file with everything the CLI accepts. Unknown keys are
//! errors, not silently ignored.

use std::path::{Path, PathBuf};
use std::time::Duration;

use flotilla_cluster::{Arch, GlobalServerSpec, ServerSpec, Topology, TopologySpec};
use flotilla_comm::{CommConfig, Compression, WireFormat};
use flotilla_engine::{ModelSpec, OptimizerSpec};
use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};

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

/// Everything a training run needs. Every field has a default, so an empty file is a valid
/// config (LeNet-5 on the vendored MNIST, 2 ranks).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// A built-in model name (`lenet5`, `mlp`) or a path to a model spec file.
    pub model: String,
    /// Directory holding the four MNIST-layout IDX files.
    pub data: PathBuf,
    /// Passes over the training set.
    pub epochs: u32,
    /// Samples per step on each rank (the global batch is `batch_size * world_size`).
    pub batch_size: usize,
    /// Optimizer and learning rate.
    pub optimizer: OptimizerSpec,
    /// Learning-rate schedule over the run.
    pub lr_schedule: LrSchedule,
    /// Steps of linear learning-rate warm-up.
    pub warmup_steps: u64,
    /// Seed of parameter initialisation and of the per-epoch shuffle.
    pub seed: u64,
    /// Number of ranks (processes).
    pub world_size: usize,
    /// Gradient fusion bucket size in MiB.
    pub bucket_mb: f64,
    /// Directory for checkpoints, metrics and each rank's `run.log`.
    pub output: PathBuf,
    /// Write a checkpoint every this many steps (0: only at the end).
    pub checkpoint_every: u64,
    /// Evaluate on the test set every this many epochs (0: only at the end). For parameter
    /// servers: every this many server rounds (default: one epoch's worth of rounds).
    pub eval_every: Option<u32>,
    /// Stop after this many steps in total (for quick runs and tests).
    pub max_steps: Option<u64>,
    /// Use only the first `train_limit` training samples (for quick runs and tests).
    pub train_limit: Option<usize>,
    /// Backend: `flex` (pure-Rust CPU) or `libtorch` (with the `libtorch` feature).
    pub device: String,
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
    /// Resume from the newest checkpoint in `output` if there is one.
    pub resume: bool,
    /// Learning rate; overrides the optimizer's `lr` when set (hcddl's key).
    pub lr: Option<f64>,
    /// Architecture: `allreduce` (default), `flat` or `hierarchical` parameter servers.
    pub arch: Arch,
    /// Flat parameter server: `{aggr_type: sync|async, num_workers: N}`.
    pub parameter_server: Option<ServerSpec>,
    /// Hierarchical: `{aggr_type, local_servers: [{aggr_type, num_workers}, ...]}`.
    pub global_server: Option<GlobalServerSpec>,
    /// Shard servers of a flat topology (parameters split by balanced byte ranges).
    pub servers: usize,
    /// Parameter servers: stop after this many server rounds (default: `epochs` worth).
    pub num_server_rounds: Option<u64>,
    /// Parameter servers: stop as soon as the root's test accuracy reaches this.
    pub target_accuracy: Option<f64>,
    /// Async servers: a push more than this many versions stale is refused (pull again).
    pub max_staleness: Option<u64>,
    /// Async servers: scale the learning rate by `1 / (1 + staleness)`.
    pub staleness_lr: bool,
    /// Parameter servers: local steps per push; more than 1 is model averaging (workers push
    /// weight deltas, the server averages them weighted by samples).
    pub local_steps: usize,
    /// Inventory file (hcddl's `[pool]` ini or a plain host list) for placement checks.
    pub inventory: Option<PathBuf>,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            model: "lenet5".into(),
            data: PathBuf::from("data/mnist"),
            epochs: 5,
            batch_size: 64,
            optimizer: OptimizerSpec::default(),
            lr_schedule: LrSchedule::Cosine,
            warmup_steps: 300,
            seed: 42,
            world_size: 2,
            bucket_mb: 25.0,
            output: PathBuf::from("runs/latest"),
            checkpoint_every: 0,
            eval_every: None,
            max_steps: None,
            train_limit: None,
            device: "flex".into(),
            master_addr: "127.0.0.1".into(),
            master_port: flotilla_comm::DEFAULT_MASTER_PORT,
            timeout_s: 60.0,
            join_timeout_s: 60.0,
            compression: CompressionSetting::None,
            wire_format: WireSetting::F32,
            resume: false,
            lr: None,
            arch: Arch::Allreduce,
            parameter_server: None,
            global_server: None,
            servers: 1,
            num_server_rounds: None,
            target_accuracy: None,
            max_staleness: None,
            staleness_lr: false,
            local_steps: 1,
            inventory: None,
        }
    }
}

impl TrainConfig {
    /// Parses a config from YAML text; `source_name` names it in errors.
    pub fn from_yaml(text: &str, source_name: &str) -> Result<Self> {
        // An empty document means "all defaults".
        if text.trim().is_empty() {
            return Ok(Self::default());
        }
        serde_norway::from_str(text).map_err(|e| TrainError::config(source_name, e.to_string()))
    }

    /// Reads a config file. Relative `data`, `output` and `model` paths stay relative to the
    /// working directory, as with every command-line tool.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| TrainError::io(path, e))?;
        Self::from_yaml(&text, &path.display().to_string())
    }

    /// The learning rate: `lr` if set, else the optimizer's.
    pub fn base_lr(&self) -> f64 {
        self.lr.unwrap_or_else(|| self.optimizer.lr())
    }

    /// The topology keys as the cluster crate takes them.
    pub fn topology_spec(&self) -> TopologySpec {
        TopologySpec {
            arch: self.arch,
            parameter_server: self.parameter_server.clone(),
            global_server: self.global_server.clone(),
            servers: self.servers,
        }
    }

    /// The process topology: `world_size` peers for all-reduce, else the parameter-server
    /// tree (whose size is what `world_size` becomes).
    pub fn topology(&self) -> Result<Topology> {
        let t = match self.arch {
            Arch::Allreduce => Topology::allreduce(self.world_size),
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
        let bad = |key: &str, msg: String| TrainError::config("config", format!("`{key}`: {msg}"));
        if self.epochs == 0 && self.max_steps.is_none() {
            return Err(bad("epochs", "must be at least 1".into()));
        }
        if self.batch_size == 0 {
            return Err(bad("batch_size", "must be at least 1".into()));
        }
        if self.world_size == 0 {
            return Err(bad("world_size", "must be at least 1".into()));
        }
        if !(self.bucket_mb.is_finite() && self.bucket_mb > 0.0) {
            return Err(bad(
                "bucket_mb",
                format!("must be positive, got {}", self.bucket_mb),
            ));
        }
        for (key, v) in [
            ("timeout_s", self.timeout_s),
            ("join_timeout_s", self.join_timeout_s),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(bad(
                    key,
                    format!("must be a positive number of seconds, got {v}"),
                ));
            }
        }
        if let Some(lr) = self.lr
            && !(lr.is_finite() && lr > 0.0)
        {
            return Err(bad("lr", format!("must be a positive number, got {lr}")));
        }
        if let Some(t) = self.target_accuracy
            && !(0.0..=1.0).contains(&t)
        {
            return Err(bad(
                "target_accuracy",
                format!("must be in [0, 1], got {t}"),
            ));
        }
        if self.local_steps == 0 {
            return Err(bad("local_steps", "must be at least 1".into()));
        }
        if self.num_server_rounds == Some(0) {
            return Err(bad("num_server_rounds", "must be at least 1".into()));
        }
        let topology = self.topology()?;
        if let Some(path) = &self.inventory {
            let inventory = flotilla_cluster::Inventory::load(path)
                .map_err(|e| bad("inventory", e.to_string()))?;
            flotilla_cluster::place(&topology, &inventory)
                .map_err(|e| bad("inventory", e.to_string()))?;
        }
        if self.train_limit == Some(0) {
            return Err(bad("train_limit", "must be at least 1".into()));
        }
        self.optimizer
            .validate()
            .map_err(|e| bad("optimizer", e.to_string()))?;
        flotilla_engine::device_by_name(&self.device).map_err(|e| bad("device", e.to_string()))?;
        ModelSpec::resolve(&self.model).map_err(|e| bad("model", e.to_string()))
    }

    /// Bucket size in bytes.
    pub fn bucket_bytes(&self) -> usize {
        (self.bucket_mb * (1 << 20) as f64) as usize
    }

    /// A hash of everything all ranks must agree on (model, data shape, optimizer, batch,
    /// seed, world size, bucketing); per-rank settings such as `output` are left out.
    pub fn cluster_hash(&self, spec: &ModelSpec) -> u64 {
        let shared = serde_json::json!({
            "model": spec.to_yaml(),
            "epochs": self.epochs,
            "batch_size": self.batch_size,
            "optimizer": self.optimizer,
            "lr_schedule": self.lr_schedule,
            "warmup_steps": self.warmup_steps,
            "seed": self.seed,
            "world_size": self.world_size,
            "bucket_mb": self.bucket_mb,
            "max_steps": self.max_steps,
            "train_limit": self.train_limit,
            "wire_format": self.wire_format,
            "eval_every": self.eval_every,
            "lr": self.lr,
            "topology": self.topology_spec(),
            "num_server_rounds": self.num_server_rounds,
            "target_accuracy": self.target_accuracy,
            "max_staleness": self.max_staleness,
            "staleness_lr": self.staleness_lr,
            "local_steps": self.local_steps,
        });
        xxhash_rust::xxh3::xxh3_64(shared.to_string().as_bytes())
    }

    /// The communicator settings of `rank` (`None`: let rank 0 assign one).
    pub fn comm_config(&self, rank: Option<usize>, hash: u64, world_size: usize) -> CommConfig {
        CommConfig {
            rank,
            world_size,
            master_addr: self.master_addr.clone(),
            master_port: self.master_port,
            timeout: Duration::from_secs_f64(self.timeout_s),
            join_timeout: Duration::from_secs_f64(self.join_timeout_s),
            config_hash: hash,
            token: std::env::var("FLOTILLA_TOKEN")
                .ok()
                .filter(|t| !t.is_empty()),
            compression: match self.compression {
                CompressionSetting::None => Compression::None,
                CompressionSetting::Lz4 => Compression::Lz4,
            },
            wire_format: match self.wire_format {
                WireSetting::F32 => WireFormat::F32,
                WireSetting::Bf16 => WireFormat::Bf16,
            },
            ..CommConfig::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_file_is_all_defaults() {
        let c = TrainConfig::from_yaml("", "t").expect("parse");
        assert_eq!(c, TrainConfig::default());
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
        assert!(e.contains("batch_size"), "{e}");
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
    fn cluster_hash_ignores_per_rank_settings() {
        let a = TrainConfig::default();
        let spec = a.validate().expect("valid");
        let mut b = a.clone();
        b.output = "elsewhere".into();
        b.data = "other".into();
        assert_eq!(a.cluster_hash(&spec), b.cluster_hash(&spec));
        b.batch_size = 32;
        assert_ne!(a.cluster_hash(&spec), b.cluster_hash(&spec));
    }

    #[test]
    fn hcddl_keys_are_accepted_as_they_are() {
        let text = "num_server_rounds: 5\ntarget_accuracy: 0.9\nbatch_size: 32\narch: hierarchical\nglobal_server:\n  aggr_type: sync\n  local_servers:\n    - type: async\n      num_workers: 2\n    - aggr_type: async\n      num_workers: 2\n";
        let c = TrainConfig::from_yaml(text, "hcddl.yaml").expect("parse");
        c.validate().expect("valid");
        assert_eq!(c.effective_world_size().expect("size"), 7);
        assert_eq!(c.num_server_rounds, Some(5));
        let flat = TrainConfig::from_yaml(
            "arch: flat\nparameter_server: {aggr_type: sync, num_workers: 4}\n",
            "f",
        )
        .expect("flat");
        assert_eq!(flat.effective_world_size().expect("size"), 5);
        let missing = TrainConfig::from_yaml("arch: flat\n", "f").expect("parse");
        let e = missing.validate().expect_err("no server").to_string();
        assert!(e.contains("parameter_server"), "{e}");
    }

    #[test]
    fn shipped_examples_parse() {
        for name in ["mnist-lenet5.yaml", "mnist-mlp.yaml"] {
            let path = Path::new(env!("CARGO_MANIFEST_DIR"))
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
